"""The prices the advisor reads off a mesh's one compiled sync step (its `jaxpar.explain` entry) to price the other
strategies: the exchange over data, a hand-written allreduce's textbook time, a codec's exchange, compute and
state, the collectives a whole-array codec adds within a replica, a codec's fsdp leg, and the remat ratios."""

from __future__ import annotations

from jaxpar.cost import codecs
from jaxpar.cost.explain import explain
from jaxpar.cost.hardware import collective_seconds
from jaxpar.cost.hlo import Collective, loop_flops
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.collectives import theoretical_traffic
from jaxpar.runtime.resources import step_bytes, step_flops


def exchange_seconds(entry) -> float:
    """Projected seconds of the compiled step's collectives over the data axis (the gradient average)."""
    return sum(c.get("seconds", 0.0) for c in entry["communication"] if mesh_lib.DATA in c["axes"].split("+"))


def allreduce_seconds(algorithm: str, replicas: int, gradient_bytes: int, profile) -> float:
    """The textbook time of averaging `gradient_bytes` over `replicas` with `algorithm` on the data link of a
    collective-permute (the profile's own, where calibrated)."""
    if replicas <= 1:
        return 0.0
    traffic = theoretical_traffic(algorithm, replicas, gradient_bytes)
    link = profile.link((mesh_lib.DATA,), "collective-permute")  # the algorithms are made of permutes
    return traffic["steps"] * link.alpha + traffic["bytes_sent_per_device"] / link.bandwidth


def codec_seconds(strategy, replicas: int, params: list[dict], profile) -> tuple[float, float, int]:
    """(seconds of the compressed exchange on the data link, seconds of the codec's compute, bytes of its state per
    device) for `params` (the plan's parameters: whole shapes and bytes per device; `jaxpar.cost.codecs`). The
    exchange includes the explicit step's own all-reduce of its loss and metrics over data: the compiled step's
    data collectives it replaces held them (the compiler combines them with the gradient's)."""
    communicator = strategy.communicator
    codec = codecs.codec_of(communicator)
    shapes = [tuple(p["shape"]) if not communicator.per_shard else (p["bytes_per_device"] // 4,) for p in params]
    splits = None if communicator.per_shard else [tuple(p["splits"]) for p in params]
    state = sum(p["bytes_per_device"] for p in params) if getattr(codec, "error_feedback", False) else 0
    axes = (mesh_lib.DATA,)
    wire = codecs.exchange_seconds(communicator, shapes, replicas, profile, axes, splits)
    wire += collective_seconds(Collective("all-reduce", 4, replicas, axes), profile)  # the loss mean
    return wire, codecs.compute_seconds(codec, shapes, replicas, profile), state


def resharding_seconds(trainer, batch, sync_entry) -> float:
    """Seconds of the within-replica collectives a whole-array codec's step adds to the sync step's (`sync_entry`,
    the mesh's explain entry): PowerSGD's matmuls and QR on arrays split over fsdp / model make the compiler
    reshard them, a collective per matrix and round. Measured: on data=2,model=4 the MLP's PowerSGD step has 19
    permutes, 21 all-gathers and 4 all-reduces over model that its sync step does not, and the advisor projected
    1.9-2.5 ms for a step measured at 7.2-7.4 ms (docs/cost-model.md). `trainer`: that codec's Sync on the mesh,
    compiled here (once per mesh and codec: the algorithm over data does not change them)."""
    def within(entry) -> float:
        return sum(c.get("seconds", 0.0) for c in entry["communication"]
                   if mesh_lib.DATA not in c["axes"].split("+"))

    entry = next(iter(explain(trainer, batch)["variants"].values()))
    return max(within(entry) - within(sync_entry), 0.0)


def fsdp_leg_seconds(trainer, variant, entry, batch, strategy, profile) -> tuple[float, float]:
    """(seconds the compressed fsdp leg saves against the compiled step's float32 reduction over fsdp, seconds of the
    leg's codec compute) for `strategy` on `trainer`'s mesh; (0, 0) where no codec compresses that leg."""
    leg = codecs.fsdp_leg(trainer, variant, batch, strategy)
    if leg is None:
        return 0.0, 0.0
    compiled = sum(c.get("seconds", 0.0) for c in entry["communication"]
                   if c["axes"] == mesh_lib.FSDP and c["kind"] in ("all-reduce", "reduce-scatter"))
    return compiled - codecs.fsdp_leg_seconds(leg, profile), leg["flops"] / profile.compute_flops


def remat_ratios(trainer, batch, variant, remats, base) -> dict:
    """Per remat policy: (temporaries ratio, FLOPs ratio) to no remat (`base`: the trainer's own step's
    (temporaries, FLOPs per device), already compiled), each other policy compiled on `trainer`'s mesh."""
    measured = {"none": base}
    for name in dict.fromkeys(remats):
        if name == "none":
            continue
        compiled = trainer.compiled_step(variant, batch, remat=name)
        memory = step_bytes(compiled)
        flops = loop_flops(compiled, step_flops(compiled)).per_device
        measured[name] = (memory["temporaries"] if memory else None, flops)
    base_temps, base_flops = measured["none"]
    return {name: ((temps / base_temps) if temps is not None and base_temps else 1.0,
                   (flops / base_flops) if flops and base_flops else 1.0)
            for name, (temps, flops) in measured.items() if name in remats}
