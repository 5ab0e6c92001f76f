"""`LayerRun`: how a model's `Stack` runs in a trainer's step (the mesh whose stage axis splits it, the `Pipeline`, the
remat policy of each layer). The trainer chooses it when it is built and sets it on every Stack of the model its steps
are built from (`jaxpar.pipeline.stack.bind`), so it is part of the step's graphdef; a Stack that was never bound (a
model called outside a trainer) runs its layers as one plain scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from jaxpar.parallel import mesh as mesh_lib
from jaxpar.pipeline.config import ONE_F_ONE_B, Pipeline


@dataclass(frozen=True)
class LayerRun:
    mesh: Any = None  # the trainer's mesh (None: no stage axis)
    pipeline: Pipeline = Pipeline()
    remat: Callable | None = None  # a `jax.checkpoint_policies` policy each layer runs under (`jaxpar.train.remat`)

    @property
    def stages(self) -> int:
        return 1 if self.mesh is None else mesh_lib.size(self.mesh, mesh_lib.STAGE_AXIS)

    @property
    def splits_loss(self) -> bool:
        """A stage mesh: the training step cuts the loss at the stack (`jaxpar.pipeline.split`), so the rest of the
        model runs inside the schedule, per microbatch. With a seq axis GPipe and circular keep the whole-batch step
        (the stack pipelined, the rest of the model outside it), which runs context parallelism; 1F1B always splits
        (with seq, every stage runs both sides of its schedule's choices: `jaxpar.pipeline.schedules.branch`)."""
        if self.stages == 1:
            return False
        return self.pipeline.schedule == ONE_F_ONE_B or mesh_lib.seq_ways(self.mesh) == 1


ALONE = LayerRun()  # a Stack outside a trainer
