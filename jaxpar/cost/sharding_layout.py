"""Where a trainer's state sits: every parameter's shape, partition spec and bytes per device, and the per-device
totals of parameters, model state, optimizer, strategy and communicator state, split into replicated and sharded
bytes; the gradient and fsdp-group bytes theory is stated in."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.names import named_leaves
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd


def spec_text(sharding) -> str:
    """A sharding's spec as --explain prints it: (None, model), (data+fsdp)."""
    spec = getattr(sharding, "spec", ())
    return "(" + ", ".join("None" if e is None else (e if isinstance(e, str) else "+".join(e)) for e in spec) + ")"


def itemsize(dtype) -> int:
    """Bytes of one element, PRNG key dtypes included (a threefry key is 8 bytes)."""
    return int(getattr(dtype, "itemsize", 0) or np.dtype(dtype).itemsize)


def placed_bytes(tree) -> dict:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs: total, replicated part, sharded part."""
    out = dict(total=0, replicated=0, sharded=0)
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shard = sharding.shard_shape(leaf.shape) if isinstance(sharding, NamedSharding) else leaf.shape
        size = math.prod(shard) * itemsize(leaf.dtype)
        out["total"] += size
        out["sharded" if tuple(shard) != tuple(leaf.shape) else "replicated"] += size
    return out


def sharding_layout(trainer) -> dict:
    """Every parameter's placement and the per-device state totals (`jaxpar.explain`'s "plan")."""
    state = trainer.abstract_state()
    params = []
    for name, leaf in named_leaves(state.params):  # named as checkpoints and errors name them
        shard = leaf.sharding.shard_shape(leaf.shape)
        size = itemsize(leaf.dtype)
        params.append({"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype),
                       "spec": spec_text(leaf.sharding), "bytes": math.prod(leaf.shape) * size,
                       "bytes_per_device": math.prod(shard) * size,
                       "splits": list(shd.within_replica_splits(leaf.sharding, leaf.ndim))})
    totals = {part: placed_bytes(getattr(state, field)) for part, field in
              (("parameters", "params"), ("model_state", "model_state"), ("optimizer", "opt_state"),
               ("strategy", "strategy_state"), ("communicator", "comm_state"))}
    totals["all"] = {k: sum(t[k] for t in totals.values()) for k in ("total", "replicated", "sharded")}
    return {"parameters": params, "per_device": totals}


def gradient_bytes(trainer) -> int:
    """Bytes of one replica's gradient on one device: its parameters' shards (float32 gradients of float params)."""
    return placed_bytes(trainer.abstract_state(neutral=True).params)["total"]


def fsdp_group_bytes(trainer) -> int:
    """P_f: what one fsdp group gathers, = fsdp size x the shard of every fsdp-sharded parameter on one device."""
    n = mesh_lib.size(trainer.mesh, mesh_lib.FSDP)
    total = 0
    for leaf in jax.tree.leaves(trainer.abstract_state(neutral=True).params):
        spec = [(e,) if isinstance(e, str) else tuple(e or ()) for e in leaf.sharding.spec]
        if any(mesh_lib.FSDP in axes for axes in spec):
            total += n * math.prod(leaf.sharding.shard_shape(leaf.shape)) * itemsize(leaf.dtype)
    return total
