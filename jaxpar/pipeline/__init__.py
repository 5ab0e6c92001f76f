"""Pipeline parallelism over the mesh's stage axis: `Stack` (a model's stack of identical blocks), `Pipeline`
(schedule, microbatches, repeats), the schedules (GPipe, circular, 1F1B) and 1F1B's split of the loss."""

from jaxpar.pipeline.config import CIRCULAR, GPIPE, ONE_F_ONE_B, SCHEDULES, Pipeline
from jaxpar.pipeline.stack import LAYERS, Stack

__all__ = ["CIRCULAR", "GPIPE", "LAYERS", "ONE_F_ONE_B", "SCHEDULES", "Pipeline", "Stack"]
