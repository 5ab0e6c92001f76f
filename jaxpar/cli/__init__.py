"""`python run.py`: the run configuration (`Config`) and its flags, building a run from it, the run itself and
resuming."""

from jaxpar.cli.config import Config

__all__ = ["Config"]
