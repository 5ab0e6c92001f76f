"""JAX's persistent compilation cache, on by default: a program compiled once on a machine is read from disk by the
next run (`run.py` and `jaxpar.Trainer`), as MaxText does.

The folder, first that is given:
  1. a cache folder already configured: `JAX_COMPILATION_CACHE_DIR`, or `jax.config.update(
     "jax_compilation_cache_dir", ...)` before jaxpar's first Trainer (kept as it is, never overridden);
  2. `$JAXPAR_COMPILE_CACHE`;
  3. `$XDG_CACHE_HOME/jaxpar/xla`, or `~/.cache/jaxpar/xla`.

`use_compile_cache(None)` (`run.py --no-compile-cache`) turns the cache off, the user's own folder included. A folder
that cannot be created or written costs one note (the `jaxpar` logger) and the run continues uncached. Programs
compiled in under `MIN_COMPILE_SECONDS` are not written (reading them back would cost about what compiling does);
a threshold the user set (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, or
`jax.config`) wins.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxpar.errors import ConfigError

log = logging.getLogger("jaxpar")

ENV = "JAXPAR_COMPILE_CACHE"
MIN_COMPILE_SECONDS = 0.2
_DEFAULT = object()  # "the default folder"
_decided: list = []  # the folder in use (or None: off) once a run or the user decided; empty: not yet


def default_folder() -> str:
    """`$JAXPAR_COMPILE_CACHE`, else `$XDG_CACHE_HOME/jaxpar/xla`, else `~/.cache/jaxpar/xla`."""
    if os.environ.get(ENV):
        return os.path.expanduser(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar", "xla")


def _reset() -> None:
    """JAX decides once, at the first compilation, whether a cache is used: let it decide again."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - a JAX that moved it: the setting applies if nothing compiled yet
        return
    compilation_cache.reset_cache()


def use_compile_cache(folder=_DEFAULT) -> str | None:
    """Turns JAX's persistent compilation cache on in `folder` (default: a folder already configured, else
    `default_folder()`), or off with `None`; anything but a path is a `ConfigError`. Returns the folder in use, or
    None. Call it before the first Trainer
    to choose; `Trainer` and `run.py` otherwise call `ensure_compile_cache()`, which picks the default."""
    if folder is not None and folder is not _DEFAULT and not isinstance(folder, (str, os.PathLike)):
        raise ConfigError(f"use_compile_cache({folder!r}): not a folder; pass a path (a str or os.PathLike), None to "
                          f"turn the cache off, or nothing for the default folder")
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        _reset()
        _decided[:] = [None]
        return None
    configured = jax.config.jax_compilation_cache_dir
    if folder is _DEFAULT and configured:  # the user's (or a test harness's) folder: kept
        chosen = configured
    else:
        chosen = default_folder() if folder is _DEFAULT else os.path.expanduser(os.fspath(folder))
        try:
            os.makedirs(chosen, exist_ok=True)
            if not os.access(chosen, os.W_OK | os.X_OK):
                raise PermissionError("not writable")
        except OSError as error:
            log.warning(f"compilation cache {chosen!r} cannot be used ({error.strerror or error}); this run compiles "
                        f"without it (set {ENV} to another folder, or pass --no-compile-cache)")
            _decided[:] = [None]
            return None
        jax.config.update("jax_compilation_cache_dir", chosen)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ and \
            jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # JAX's default: nobody chose
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_enable_compilation_cache", True)
    _reset()
    _decided[:] = [chosen]
    return chosen


def ensure_compile_cache() -> str | None:
    """The default, once: `use_compile_cache()` unless it was already called (with a folder or None)."""
    if not _decided:
        use_compile_cache()
    return _decided[0]
