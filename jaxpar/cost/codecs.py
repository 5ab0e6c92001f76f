"""The price of a gradient codec (`jaxpar.parallel.compression`): the bytes and textbook seconds of its exchange on
the data link, its own compute, and the theory `--explain` states for it.

- Bytes: `CompressedCommunicator.traffic` (the codec's payload per collective, sent by the chosen algorithm).
- Seconds of the exchange (the plan advisor, which does not compile codecs): per collective, steps x alpha +
  bytes sent / bandwidth on the data link of that collective's kind (`link_kind`: a hand-written algorithm's
  collectives are ppermutes), as `jaxpar.advisor` prices an uncompressed hand-written all-reduce.
- Compute: measured where the profile calibrated the codec (`Profile.codecs`, seconds per gradient element with
  every device busy, `python -m jaxpar.calibrate`; `jaxpar.calibration.codecs`); else the codec's
  `flops(shapes, n)` (elementwise encode / decode, PowerSGD's matmuls 6 n m R and its
  orthogonalisation about 4 n R^2 per matrix) at the profile's sustained FLOP/s. A compiled step's FLOPs already
  hold what XLA counts of the codec (its elementwise work and matmuls), so `compiled_step_cost` adds only what XLA
  does not count: the QR, a LAPACK call on CPU.
- A compiled compressed step's HLO already carries the codec's bytes (bf16, int8), so the profile's `wire` dtype
  (which models a native all-reduce in bf16) is not applied to it again.

Elementwise work is priced as FLOPs; on an accelerator it is bound by memory bandwidth, which the profiles do not
model, so on an A100 profile the codec's compute is a lower bound (docs/cost-model.md).
"""
from __future__ import annotations

import math
from dataclasses import replace

import jax
from jax.sharding import NamedSharding


def codec_of(communicator):
    """The codec wrapping `communicator`'s exchange, or None."""
    return getattr(communicator, "codec", None)


def gradient_shapes(trainer) -> list[tuple]:
    """The per-device gradient shapes the trainer's codec encodes: each device's shard for the elementwise codecs
    (they run per shard), the whole arrays for PowerSGD (the compiler shards its matmuls)."""
    per_shard = getattr(trainer.ctx.communicator, "per_shard", True)
    out = []
    for leaf in jax.tree.leaves(trainer.abstract_state(neutral=True).params):
        sharding = getattr(leaf, "sharding", None)
        whole = not per_shard or not isinstance(sharding, NamedSharding)
        out.append(tuple(leaf.shape) if whole else tuple(sharding.shard_shape(leaf.shape)))
    return out


def gradient_splits(trainer) -> list[tuple] | None:
    """For a whole-array codec (PowerSGD) on a replica of several devices: per leaf, the pieces each dimension is
    cut into inside a replica (`partitioning.within_replica_splits`), which decide each device's part of the factors
    it sends; None for the elementwise codecs, whose `gradient_shapes` are already the shards."""
    from jaxpar.parallel import mesh as mesh_lib
    from jaxpar.parallel import partitioning as shd

    if getattr(trainer.ctx.communicator, "per_shard", True) or mesh_lib.size(
            trainer.mesh, mesh_lib.WITHIN_REPLICA_AXES) == 1:
        return None
    return [shd.within_replica_splits(leaf.sharding, leaf.ndim)
            for leaf in jax.tree.leaves(trainer.abstract_state(neutral=True).params)]


def link_kind(algorithm: str, collective: str, codec) -> str:
    """The collective kind whose calibrated link (`Profile.kinds`) carries a `traffic` entry: every collective of
    the hand-written algorithms (ring, torus2d, ps) is a ppermute; fp16's scales are a native pmax (an all-reduce);
    under psum, a 16-bit sum is an all-to-all + all-gather (`collectives.allreduce._native_sum_16`), the rest native."""
    if collective.startswith("scales"):
        return "all-reduce"
    if algorithm != "psum":
        return "collective-permute"
    if collective in ("all-gather", "all-to-all"):
        return collective
    return "all-to-all" if getattr(codec, "dtype", None) is not None else "all-reduce"


def exchange_seconds(communicator, shapes, n: int, profile, axes, splits=None) -> float:
    """Textbook seconds of the codec's exchange over `n` replicas on `profile`'s links of mesh `axes`: per
    collective, steps x alpha + bytes the busiest device sends / bandwidth, each on its own kind's link
    (`link_kind`). `splits`: as `CompressedCommunicator.traffic`."""
    if n <= 1:
        return 0.0
    codec = codec_of(communicator)
    total = 0.0
    for t in communicator.traffic(shapes, n, splits):
        link = profile.link(axes, link_kind(communicator.name, t["collective"], codec))
        steps = t["steps"]
        if t["collective"] in ("all-gather", "all-to-all", "push + pull") and communicator.name != "psum":
            chain = {"all-gather": gather_steps(communicator, n), "all-to-all": n - 1, "push + pull": 2 * (n - 1)}
            steps = chain[t["collective"]] * gathered_arrays(codec)
        total += steps * link.alpha + t["bytes_sent_per_device"] / link.bandwidth
    return total


def gathered_arrays(codec) -> int:
    """Arrays a codec's all-to-all / all-gather sends, each its own chain of ppermutes: int8's codes and scales."""
    from jaxpar.parallel.compression import Int8

    return 2 if isinstance(codec, Int8) else 1


def gather_steps(communicator, n: int) -> int:
    """Sequential ppermutes of one array's hand-written all-gather (`collectives.rings.gather_leaf`): ring N-1, torus2d
    (X-1) + (Y-1), ps 2(N-1) (every worker to the root, then the root to every worker, one at a time). Measured:
    the compiled int8 step on data=4 with ps has 12 permutes over data (2 arrays x 2 x 3), where `traffic` says 3."""
    from jaxpar.parallel.collectives import torus_shape

    if communicator.name == "ps":
        return 2 * (n - 1)
    if communicator.name == "torus2d":
        x, y = torus_shape(n, communicator.torus_x)
        return (x - 1) + (y - 1)
    return n - 1


def compute_seconds(codec, shapes, n: int, profile) -> float:
    """Seconds of the codec's own compute per device per step. Where the profile calibrated this codec
    (`Profile.codecs[name]`: seconds per gradient element measured with every device busy, and the codec's FLOPs
    per element in that measurement), its FLOPs at the rate measured for it (so int8's decoding of N replicas'
    codes and PowerSGD's rank and shapes still scale by the FLOP count); else its FLOPs at the sustained FLOP/s."""
    measured = (getattr(profile, "codecs", None) or {}).get(codec.name)
    if not measured:
        return flops(codec, shapes, n) / profile.compute_flops
    return flops(codec, shapes, n) * measured["seconds_per_element"] / measured["flops_per_element"]


def flops(codec, shapes, n: int) -> float:
    """All the codec's own FLOPs per device per step."""
    return float(sum(codec.flops(shapes, n).values()))


def uncounted_flops(codec, shapes, n: int) -> float:
    """The codec's FLOPs that XLA's cost analysis of a compiled step misses: PowerSGD's QR (a LAPACK custom call)."""
    return float(codec.flops(shapes, n).get("orthogonalise", 0))


def compiled_step_cost(trainer, compiled, gradients: bool, exchanges: bool, profile):
    """`jaxpar.cost.hardware.compiled_cost` of a compiled step of `trainer` on `profile`, with its codec priced: no
    wire-dtype
    scaling of bytes the codec already encoded, plus the codec's compute XLA does not count (in a variant that
    `exchanges` over the replica axis)."""
    from jaxpar.cost.hardware import compiled_cost

    codec = codec_of(trainer.ctx.communicator)
    if codec is None:
        return compiled_cost(compiled, trainer.mesh, profile, gradients)
    cost = compiled_cost(compiled, trainer.mesh, replace(profile, wire="float32"), gradients)
    if not exchanges:
        return cost
    extra = uncounted_flops(codec, gradient_shapes(trainer), trainer.num_replicas) / profile.compute_flops
    return cost._replace(compute=cost.compute + extra)


def _matrices(codec, shapes) -> str:
    from jaxpar.parallel.compression import as_matrix_shape

    shown = []
    for s in dict.fromkeys(tuple(s) for s in shapes):
        if codec.compresses(s):
            n, m = as_matrix_shape(s)
            shown.append(f"{n}x{m} {(n + m) * codec.rank / (n * m):.3f}")
    more = f", and {len(shown) - 6} more" if len(shown) > 6 else ""
    return ", ".join(shown[:6]) + more if shown else "none"


def theory_text(codec, shapes, n: int) -> str:
    """What theory says the codec sends, against float32 (the `--explain` line's words)."""
    from jaxpar.parallel.compression import INT8_CHUNK, Cast, Int8, PowerSGD

    if isinstance(codec, Cast):
        extra = ", plus one float32 scale per leaf (pmax)" if codec.name == "fp16" else ""
        return f"{codec.name} on the wire: 1/2 of float32{extra}"
    if isinstance(codec, Int8):
        return (f"int8 two-shot: int8 codes + a float32 scale per {INT8_CHUNK} elements sent by an all-to-all "
                f"(reduce-scatter), summed in float32, requantized by each shard's owner and all-gathered (2(N-1)/N x "
                f"n bytes against float32's 2(N-1)/N x 4n): (1 + 4/{INT8_CHUNK}) / 4 = "
                f"{(1 + 4 / INT8_CHUNK) / 4:.3f} of float32, plus padding to whole chunks and shards")
    if isinstance(codec, PowerSGD):
        return (f"PowerSGD R={codec.rank}: P (n x R) and Q (m x R) instead of n x m, (n+m)R/(nm) per matrix "
                f"({_matrices(codec, shapes)}); vectors and small matrices whole")
    return f"{getattr(codec, 'name', type(codec).__name__)}: its own payload"


def report(trainer, float32_bytes: float) -> dict | None:
    """The codec's part of an `--explain` variant: its name, the bytes its exchange sends per device against the
    float32 exchange's (`float32_bytes`, theory), theory's words, and its FLOPs per device by kind."""
    communicator = trainer.ctx.communicator
    codec = codec_of(communicator)
    n = trainer.num_replicas
    if codec is None or n <= 1:
        return None
    shapes = gradient_shapes(trainer)
    traffic = communicator.traffic(shapes, n, gradient_splits(trainer))
    sent = sum(t["bytes_sent_per_device"] for t in traffic)
    return {"name": codec.name, "bytes_sent_per_device": sent, "steps": sum(t["steps"] for t in traffic),
            "float32_bytes": float32_bytes, "ratio": sent / float32_bytes if float32_bytes else None,
            "theory": theory_text(codec, shapes, n), "flops": {k: int(v) for k, v in codec.flops(shapes, n).items()},
            "elements": sum(math.prod(s) for s in shapes)}


# --- the gradient's fsdp leg (`jaxpar.parallel.fsdp_reduce`): its theory, compute and seconds ---------------------

# the leg's codec FLOPs per element of each device's full-size partial gradient: bf16 cast, decode and the float32
# sum (3); fp16 also |x|, max and the scaling (5); int8 |x|, max, divide, round, clip (2), cast (7) to encode, then
# decode, scale and sum (3). float32 (PowerSGD's leg): a plain reduce-scatter, no codec work.
FSDP_LEG_FLOPS_PER_ELEMENT = {"float32": 0, "bf16": 3, "fp16": 5, "int8": 10}


def fsdp_leg(trainer, variant: str, batch=None, strategy=None) -> dict | None:
    """The compressed fsdp leg of `variant`'s step on `trainer`'s mesh (`strategy`: default the trainer's; the plan
    advisor asks for a codec the trainer does not run), or None where the leg is the partitioner's float32
    reduction: no codec averaging that variant's gradient, fsdp = 1, a pipeline, model state other than RNG state,
    or rows that do not split over fsdp (`jaxpar.strategies.replicas.fsdp_leg_codec`). `fsdp_reduce.leg_traffic`
    plus the codec's "name" and its "flops" per device."""
    from jaxpar.parallel import fsdp_reduce
    from jaxpar.parallel import mesh as mesh_lib
    from jaxpar.strategies import replicas

    strategy = strategy or trainer.strategy
    if mesh_lib.size(trainer.mesh, mesh_lib.FSDP) <= 1:
        return None
    state = trainer.abstract_state()
    n = max(1, mesh_lib.replica_count(trainer.mesh))
    rows = {} if batch is None else {k: jax.ShapeDtypeStruct((v.shape[0] // n,) + tuple(v.shape[1:]), v.dtype)
                                     for k, v in batch.items()}
    codec = replicas.fsdp_leg_codec(strategy, trainer.ctx, variant, state.model_state, rows)
    if codec is None:
        return None
    out = fsdp_reduce.leg_traffic(codec, trainer.state_shardings.params, state.params)
    out.update(name=codec.name, flops=FSDP_LEG_FLOPS_PER_ELEMENT[out["wire"]] * out["elements"])
    return out


def fsdp_leg_seconds(leg: dict, profile) -> float:
    """Textbook seconds of the leg on the profile's fsdp link (the collective kind's own link where the profile has
    `kinds`): steps x alpha + bytes sent / bandwidth."""
    from jaxpar.parallel import mesh as mesh_lib

    link = profile.link((mesh_lib.FSDP,), leg["kind"])
    return leg["steps"] * link.alpha + leg["bytes_sent_per_device"] / link.bandwidth


def fsdp_leg_text(leg: dict) -> str:
    """`--explain`'s words for the leg."""
    how = {"float32": "a float32 reduce-scatter (PowerSGD's leg is uncompressed)",
           "bf16": "an all-to-all of bf16 blocks summed in float32: 1/2 of float32",
           "fp16": "an all-to-all of fp16 blocks (a power-of-two scale per leaf, one pmax) summed in float32: 1/2 of "
                   "float32",
           "int8": f"an all-to-all of int8 codes + a float32 scale per {_int8_chunk()} elements, summed in float32 "
                   f"(ZeRO++ qgZ): (1 + 4/{_int8_chunk()}) / 4 of float32"}[leg["wire"]]
    ratio = leg["bytes_sent_per_device"] / leg["float32_bytes"] if leg["float32_bytes"] else 0.0
    return (f"gradient leg compressed by {leg['name']}: {how}, no error feedback; {leg['bytes_sent_per_device']:,.0f} "
            f"bytes in {leg['steps']} steps against float32's {leg['float32_bytes']:,.0f} ({ratio:.3f})")


def _int8_chunk() -> int:
    from jaxpar.parallel.compression import INT8_CHUNK
    return INT8_CHUNK
