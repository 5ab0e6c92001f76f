"""What fits a device: per rematerialization policy, the step's memory and FLOPs, and the largest global batch.

`what_fits(trainer, batch, variant)` compiles the step `variant` (the trainer's most memory-hungry one) under every
named remat policy (`jaxpar.train.remat.POLICIES`) at the run's global batch and at twice that batch, and reads
XLA's memory analysis of each. Per policy, memory per device is taken as affine in the batch rows through those
two points (the train state is fixed; activations, the batch and the logits grow with it), which gives the
largest batch that fits the device's memory, rounded down to a batch the mesh and strategy accept. The suggestion
is then compiled at its own batch and its real memory reported, stepping down while it does not fit.

The suggestion prefers, in order: the current batch with the policy that fits it and recomputes least (fewest
FLOPs); if no policy fits it, the largest batch any policy fits. Nothing runs; every program is only compiled.
"""

from __future__ import annotations

import math

import jax

from jaxpar.cost.hlo import loop_flops
from jaxpar.cost.step_pricer import profile_of
from jaxpar.runtime.resources import device_memory, step_bytes, step_flops
from jaxpar.train.remat import REMATS

_VERIFY_TRIES = 4  # compiles of a suggested batch that does not fit before the advice gives up on it
# A largest batch beyond this multiple of the run's batch is reported as the estimate, not compiled: XLA's compile
# time grows with such sizes (constant folding of batch-sized scatters took 20-40 s at a million rows), and the
# estimate is what matters there: a batch that far from the run's is a different run.
VERIFY_UP_TO = 16


def budget_of(trainer) -> tuple[int, str]:
    """(bytes a device may use, where that number comes from): the hardware profile's memory if it states one,
    else the device's own (on CPU: the machine's memory shared by its devices)."""
    profile = profile_of(trainer)
    if profile is not None and profile.memory:
        return int(profile.memory), f"the {profile.name} profile"
    return device_memory(trainer.mesh), "this machine's device"


def batch_unit(trainer) -> int:
    """Every global batch a multiple of this is accepted: split over the batch axes (data x fsdp), into the
    pipeline's microbatches on each, and into equal replica slices of `grad_accum` microbatches."""
    pipeline = trainer.pipeline.microbatches if trainer.pipeline is not None else 1
    return math.lcm(trainer.batch_divisor * pipeline, trainer.num_replicas * trainer.grad_accum)


def _rows(batch) -> int:
    return int(next(iter(batch.values())).shape[0])


def _resized(batch, rows: int) -> dict:
    return {k: jax.ShapeDtypeStruct((rows,) + tuple(v.shape[1:]), v.dtype) for k, v in batch.items()}


def _measure(trainer, variant, inputs, batch, policy) -> dict | None:
    compiled = trainer.compiled_step(variant, batch, inputs, remat=policy)
    memory = step_bytes(compiled)
    if memory is None:
        return None
    flops = loop_flops(compiled, step_flops(compiled)).per_device  # a scan's body counted once per trip
    return {"bytes": memory["total"], "temporaries": memory["temporaries"],
            "flops_per_device": None if flops is None else float(flops)}


def largest_batch(at_rows: int, at_bytes: int, probe_rows: int, probe_bytes: int, budget: int,
                  unit: int) -> int | None:
    """The largest multiple of `unit` whose memory, on the line through the two measured points, is within
    `budget`; None when even one unit does not fit (or memory does not grow with the batch: then any batch
    fits as well as this one, reported as None too and handled by the caller)."""
    slope = (probe_bytes - at_bytes) / (probe_rows - at_rows)
    if slope <= 0:
        return None
    base = at_bytes - slope * at_rows
    rows = int((budget - base) // slope) // unit * unit
    return rows if rows >= unit else None


def what_fits(trainer, batch, variant: str, inputs=None) -> dict:
    """Memory, FLOPs and the largest batch per remat policy for `trainer`'s step `variant` on global batches
    shaped like `batch`, and a suggestion (see the module docstring)."""
    budget, source = budget_of(trainer)
    unit, rows = batch_unit(trainer), _rows(batch)
    probe = 2 * rows
    policies = {}
    for name in REMATS:
        here = _measure(trainer, variant, inputs, _resized(batch, rows), name)
        there = _measure(trainer, variant, inputs, _resized(batch, probe), name)
        if here is None or there is None:
            return {"budget": budget, "budget_source": source, "unavailable": "the backend gives no memory analysis"}
        grows = there["bytes"] > here["bytes"]
        largest = largest_batch(rows, here["bytes"], probe, there["bytes"], budget, unit) if grows else None
        policies[name] = {**here, "bytes_at_double": there["bytes"], "fits": here["bytes"] <= budget,
                          "largest_batch": largest, "grows": grows}
    out = {"budget": budget, "budget_source": source, "batch": rows, "unit": unit, "variant": variant,
           "policies": policies}
    out["suggestion"] = _suggest(trainer, variant, inputs, batch, policies, rows, budget)
    return out


def _cheapest(names, policies):
    """The policy among `names` with the fewest FLOPs (ties: the least memory)."""
    return min(names, key=lambda n: (policies[n]["flops_per_device"] or 0.0, policies[n]["bytes"]))


def _suggest(trainer, variant, inputs, batch, policies, rows, budget) -> dict:
    fitting = [name for name, p in policies.items() if p["fits"]]
    if fitting:
        name = _cheapest(fitting, policies)
        growing = [n for n in policies if policies[n]["largest_batch"]]
        best = max(growing, key=lambda n: policies[n]["largest_batch"], default=None)
        out = {"remat": name, "batch": rows, "bytes": policies[name]["bytes"], "reason": "fits this batch"}
        if best is not None and policies[best]["largest_batch"] > rows:
            largest = policies[best]["largest_batch"]
            out["largest"] = (_verified(trainer, variant, inputs, batch, best, largest, budget)
                              if largest <= VERIFY_UP_TO * rows else {"remat": best, "batch": largest,
                                                                       "bytes": _line(policies[best], rows, largest),
                                                                       "compiled": False})
        return out
    growing = [n for n in policies if policies[n]["largest_batch"]]
    if not growing:
        return {"remat": None, "batch": None, "reason": "no remat policy fits even the smallest batch the mesh "
                                                        "accepts: split the model over more devices (fsdp / model "
                                                        "axes) or use a smaller model"}
    best = max(growing, key=lambda n: policies[n]["largest_batch"])
    largest = _verified(trainer, variant, inputs, batch, best, policies[best]["largest_batch"], budget)
    if largest is None:
        return {"remat": None, "batch": None, "reason": "the batches the estimate fits did not fit when compiled"}
    return {**largest, "reason": "this batch does not fit under any policy; the largest that does"}


def _line(policy: dict, rows: int, at: int) -> int:
    """A policy's bytes at `at` rows on the line through its two measured points (`rows` and twice that)."""
    slope = (policy["bytes_at_double"] - policy["bytes"]) / rows
    return int(policy["bytes"] + slope * (at - rows))


def _verified(trainer, variant, inputs, batch, name, rows, budget) -> dict | None:
    """`name` at `rows`, compiled: its real bytes; stepping down a unit at a time (a few tries) while over."""
    unit = batch_unit(trainer)
    for _ in range(_VERIFY_TRIES):
        if rows < unit:
            return None
        measured = _measure(trainer, variant, inputs, _resized(batch, rows), name)
        if measured is not None and measured["bytes"] <= budget:
            return {"remat": name, "batch": rows, "bytes": measured["bytes"], "compiled": True}
        rows -= unit
    return None


def lines(advice: dict) -> list[str]:
    """The text `--explain` prints for `what_fits`'s result."""
    head = f"what fits a device ({advice['budget']:,} bytes, {advice['budget_source']})"
    if "unavailable" in advice:
        return ["", f"{head}: not known ({advice['unavailable']})"]
    rows = advice["batch"]
    out = ["", f"{head}: step variant {advice['variant']!r} compiled under each --remat policy at the global batch "
               f"{rows} and {2 * rows} (batches are multiples of {advice['unit']}):"]
    none = advice["policies"].get("none")
    for name, p in advice["policies"].items():
        flops = p["flops_per_device"]
        ratio = (f" ({flops / none['flops_per_device']:.2f}x none)"
                 if flops and none and none["flops_per_device"] else "")
        largest = (f"largest batch that fits about {p['largest_batch']:,}" if p["largest_batch"]
                   else "memory does not grow with the batch" if not p["grows"] else "no batch fits")
        out.append(f"  {name:<14} {p['bytes']:>14,} bytes per device ({p['temporaries']:,} temporaries), "
                   f"FLOPs per device {flops or 0:,.0f}{ratio}; {'fits' if p['fits'] else 'DOES NOT FIT'}; "
                   f"{largest}")
    s = advice["suggestion"]
    if s["remat"] is None:
        out.append(f"  suggestion: none ({s['reason']})")
        return out
    out.append(f"  suggestion: --remat {s['remat']} at --batch-size {s['batch']} ({s['reason']}; "
               f"{s['bytes']:,} bytes per device{', compiled at that batch' if s.get('compiled') else ''})")
    largest = s.get("largest")
    if largest:
        how = ("compiled at that batch" if largest["compiled"] else
               f"estimated from the two compiled batches; not compiled: more than {VERIFY_UP_TO}x this batch")
        out.append(f"  largest batch: --remat {largest['remat']} --batch-size {largest['batch']} "
                   f"({'' if largest['compiled'] else 'about '}{largest['bytes']:,} bytes per device, {how})")
    return out
