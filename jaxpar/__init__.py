"""jaxpar: data- and model-parallel training of Flax NNX models on a JAX device mesh."""

from jaxpar.config import Config
from jaxpar.errors import ConfigError, DataError, JaxparError, MeshError, ShardingError
from jaxpar.linen import from_linen
from jaxpar.mesh import make_mesh
from jaxpar.sharding import DEFAULT_RULES
from jaxpar.step import TrainState
from jaxpar.strategies import ASP, SSP, DiLoCo, LocalSGD, Sync
from jaxpar.trainer import Trainer

__all__ = ["Config", "ConfigError", "DataError", "DEFAULT_RULES", "JaxparError", "MeshError", "ShardingError",
           "ASP", "DiLoCo", "LocalSGD", "SSP", "Sync", "Trainer", "TrainState", "from_linen", "make_mesh"]
