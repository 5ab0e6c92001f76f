"""Run by tests/runtime/test_distributed.py under `python -m jaxpar.launch`: a user's own script that joins the processes
with `jaxpar.runtime.distributed.initialize()` (settings from the launcher), restores a checkpoint onto a 2x4 mesh over
all processes and has process 0 save the gathered parameters.   ARGS: CHECKPOINT_DIR STEP OUT.npz"""

import sys

import jaxpar

jaxpar.runtime.distributed.initialize()

import optax  # noqa: E402

import models  # noqa: E402
from jaxpar.io.checkpoint import Checkpointer  # noqa: E402
from jaxpar.cli.config import Config  # noqa: E402
from tests.runtime.test_distributed import _flat  # noqa: E402

import numpy as np  # noqa: E402

folder, step, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
config = Config(model="mlp").resolved()  # run.py's MLP (its checkpoint was written by run.py)
trainer = jaxpar.Trainer(model=models.factory(config), loss_fn=models.loss_for(config), optimizer=optax.adamw(0.01),
                         mesh=jaxpar.make_mesh("2x4"), strategy=jaxpar.LocalSGD(period=3))
checkpoints = Checkpointer(folder)
state, meta, notes = checkpoints.restore(trainer, step)
params = _flat(trainer.params(state))  # every process takes part in the gather
if jaxpar.runtime.distributed.is_main():
    np.savez(out, **params)
checkpoints.close()
print(f"process {jaxpar.runtime.distributed.process_index()}: restored step {meta['step']}")
