"""Loading a config file: `get_config()` from a Python file such as configs/NAME.py."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os

from jaxpar.cli.config import Config
from jaxpar.errors import ConfigError
from jaxpar.io.data import path_kind

PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def load_config_file(path: str) -> Config:
    """Runs `get_config()` from a Python file (configs/NAME.py; any name: the file is read as Python source)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ConfigError(f"--config {path!r}: is {path_kind(path)}, not a file; pass a Python file such as "
                          f"configs/mlp.py")
    if not os.path.isfile(path):
        names = sorted(f for f in os.listdir(PRESETS) if f.endswith(".py") and not f.startswith("_")) \
            if os.path.isdir(PRESETS) else []
        raise ConfigError(f"--config {path!r}: no such file" + (f"; presets: {', '.join('configs/' + n for n in names)}"
                                                                 if names else ""))
    loader = importlib.machinery.SourceFileLoader("jaxpar_user_config", path)  # also for names without .py
    spec = importlib.util.spec_from_loader("jaxpar_user_config", loader)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ConfigError(f"--config {path!r}: defines no get_config() returning jaxpar.Config")
        config = module.get_config()
    except ConfigError:
        raise
    except Exception as error:  # a user's file: report it as a bad flag value, not a traceback
        raise ConfigError(f"--config {path!r}: could not be loaded ({type(error).__name__}: {error})") from error
    if not isinstance(config, Config):
        raise ConfigError(f"--config {path!r}: get_config() returned {type(config).__name__}, not jaxpar.Config")
    return config
