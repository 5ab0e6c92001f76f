"""The default run: a 2-layer byte-level transformer LM on the standard library's Python source, 2x4 mesh."""

import jaxpar


def get_config() -> jaxpar.Config:
    return jaxpar.Config()
