"""jaxpar: data-, FSDP- and model-parallel training of Flax NNX models on a JAX device mesh."""

from jaxpar import actions, distributed
from jaxpar.actions import Action, Evaluate, StepEvent
from jaxpar.collectives import Communicator, communicator
from jaxpar.config import Config
from jaxpar.explain import explain, format_explain
from jaxpar.errors import (CheckpointError, ConfigError, DataError, FitError, JaxparError, MeshError, ModelError, OptionError,
                           ResourceError, ShardingError, StateError)
from jaxpar.linen import from_linen
from jaxpar.mesh import make_mesh
from jaxpar.hardware import PROFILES, Profile, parse_hardware
from jaxpar.resources import DeviceError
from jaxpar.sharding import DEFAULT_RULES
from jaxpar.step import TrainState
from jaxpar.strategies import ASP, SSP, DiLoCo, LocalSGD, Sync
from jaxpar.trainer import Trainer

__all__ = ["Action", "CheckpointError", "Checkpointer", "Communicator", "Config", "ConfigError", "DataError", "DEFAULT_RULES", "DeviceError", "Evaluate", "FitError",
           "JaxparError", "MeshError", "ModelError", "OptionError", "PROFILES", "Profile", "ResourceError", "ShardingError", "StateError", "StepEvent", "ASP", "DiLoCo", "LocalSGD", "SSP", "Sync",
           "Trainer", "TrainState", "actions", "communicator", "distributed", "explain", "format_explain", "from_linen", "make_mesh", "parse_hardware"]


def __getattr__(name):  # `jaxpar.Checkpointer` imports orbax only when first used
    if name == "Checkpointer":
        from jaxpar.checkpoint import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
