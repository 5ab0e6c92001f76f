"""jaxpar: data-, FSDP- and model-parallel training of Flax NNX models on a JAX device mesh.

The public API is what this module exports. The packages show the parts: `parallel` (mesh, partitioning,
collectives), `strategies` (how replicas agree, and their simulated clock), `train` (state, step, Trainer, loop,
actions), `cost` (HLO, hardware profiles, explain), `io` (data, checkpoints, metrics, reports), `runtime`
(processes and devices) and `cli` (what `run.py` runs: `jaxpar.cli.Config`). `import jaxpar` loads the library
only, never `cli`, `models` or `configs`; `jaxpar.Config` is `jaxpar.cli.Config`, imported when first used.
"""

import sys

from jaxpar.cost.explain import explain, format_explain
from jaxpar.advisor import advise as plan
from jaxpar.cost.hardware import PROFILES, Profile, parse_hardware
from jaxpar.errors import (CheckpointError, ConfigError, DataError, FitError, JaxparError, MeshError, ModelError,
                           OptionError, ResourceError, ShardingError, StateError)
from jaxpar.parallel.collectives import Communicator, communicator
from jaxpar.parallel.context import attention
from jaxpar.parallel.mesh import make_mesh
from jaxpar.parallel.partitioning import DEFAULT_RULES
from jaxpar import pipeline
from jaxpar.pipeline import Pipeline, Stack
from jaxpar.runtime import distributed
from jaxpar.runtime.compile_cache import use_compile_cache
from jaxpar.runtime.resources import DeviceError
from jaxpar.strategies import ASP, SSP, DiLoCo, LocalSGD, Sync
from jaxpar.train import actions
from jaxpar.train.actions import Action, Evaluate, StepEvent, Trace
from jaxpar.train.linen import from_linen
from jaxpar.train.step import TrainState
from jaxpar.train import pricer as _pricer
from jaxpar.cost.step_pricer import StepPricer as _StepPricer
from jaxpar.train.trainer import Trainer

_pricer.register(_StepPricer.for_hardware)  # `Trainer(hardware=...)`: the cost analyser prices the trainer's steps

# `jaxpar.actions` and `jaxpar.distributed` are public namespaces: `import jaxpar.actions` works as well as the
# attribute
sys.modules[__name__ + ".actions"] = actions
sys.modules[__name__ + ".distributed"] = distributed

__all__ = ["ASP", "Action", "CheckpointError", "Checkpointer", "Communicator", "Config", "ConfigError", "DEFAULT_RULES",
           "DataError", "DeviceError", "DiLoCo", "Evaluate", "FitError", "JaxparError", "LocalSGD", "MeshError",
           "ModelError", "OptionError", "PROFILES", "Pipeline", "Profile", "ResourceError", "SSP", "ShardingError", "StateError",
           "Stack", "StepEvent", "Sync", "Trace", "TrainState", "Trainer", "actions", "attention", "communicator", "distributed",
           "explain", "format_explain", "from_linen", "make_mesh", "parse_hardware", "pipeline", "plan", "use_compile_cache"]


def __getattr__(name):  # imported when first used: `jaxpar.Checkpointer` (orbax), `jaxpar.Config` (the CLI's)
    if name == "Checkpointer":
        from jaxpar.io.checkpoint import Checkpointer

        return Checkpointer
    if name == "Config":
        from jaxpar.cli.config import Config

        return Config
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
