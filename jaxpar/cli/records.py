"""The config record a run writes (metrics file, checkpoints): the resolved config as JSON, with library versions."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
from collections.abc import Mapping

from jaxpar.cli.defaults import resolved as resolve


def to_record(config) -> dict:
    """The full resolved config as a JSON-serialisable dict, plus {"versions": {package: version}}."""
    resolved = resolve(config)
    record = {f.name: jsonable(getattr(resolved, f.name)) for f in dataclasses.fields(config)}
    record["versions"] = versions()
    return record


def from_record(cls, record: Mapping):
    """The `cls` (Config) of a `to_record()` dict (its "versions" and any unknown keys are ignored)."""
    values = {f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record}
    if isinstance(values.get("channels"), list):
        values["channels"] = tuple(values["channels"])
    if isinstance(values.get("rules"), list):
        values["rules"] = [(name, tuple(t) if isinstance(t, list) else t) for name, t in values["rules"]]
    elif isinstance(values.get("rules"), dict):
        values["rules"] = {k: tuple(t) if isinstance(t, list) else t for k, t in values["rules"].items()}
    return cls(**values)


def versions() -> dict[str, str | None]:
    """Installed versions of jaxpar and the libraries a run's numbers depend on."""
    out = {}
    for package in ("jaxpar", "jax", "flax", "optax"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = getattr(sys.modules.get(package), "__version__", None)
    return out


def jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    return value
