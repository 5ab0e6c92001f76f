"""The default run: a 2-layer byte-level transformer LM on the standard library's Python source, 2x4 mesh."""

from jaxpar.cli import Config


def get_config() -> Config:
    return Config()
