"""The run behind `python run.py`, by its parts (kept as one import place): `train` (jaxpar.cli.training), building a
run (build), batch sizes (batching), notes (notes), --explain (explaining), processes (processes)."""

import models  # noqa: F401  (tests patch `experiment.models.loss_for`)
from jaxpar.cli.batching import batch_sizes  # noqa: F401
from jaxpar.cli.build import build, datasets, make_optimizer  # noqa: F401
from jaxpar.cli.explaining import explain_run  # noqa: F401
from jaxpar.cli.notes import divergence_hint, run_notes  # noqa: F401
from jaxpar.cli.processes import join_processes  # noqa: F401
from jaxpar.cli.training import evaluate, train  # noqa: F401
