"""The plan advisor: which mesh, strategy and remat policy to run a model and global batch on N devices of a
hardware profile (`jaxpar.plan(...)`, `run.py --plan --hardware PROFILE [--devices N]`).

How a plan is priced (the cost model of `jaxpar.explain`, see docs/cost-model.md):
- Meshes: every factorisation of N into data x fsdp x model (stage only when asked for). A mesh the model does
  not divide over (a dimension not a multiple of the model axis, a batch not a multiple of data x fsdp) is refused
  with the Trainer's own one-line reason.
- Each mesh is compiled once, under sync SGD with the compiler's all-reduce (`jaxpar.explain`): its FLOPs, its
  collectives priced on the profile, and XLA's memory analysis.
- Strategies are priced from that one compiled step, never compiled themselves: sync with a hand-written
  allreduce replaces the compiled gradient all-reduce over data by the algorithm's textbook traffic
  (`theoretical_traffic`: steps x alpha + bytes / bandwidth on the data link); local SGD and DiLoCo with period H
  take (H - 1) local steps (the compiled step minus its exchange over data) and one meeting (the whole step)
  per H (`jaxpar.cost.strategy_costs.project`). Their memory is the compiled step's with the train state swapped for the
  strategy's own (`Trainer.state_bytes_per_device`, from shapes only). Sync with an explicit allreduce and a codec
  (`codecs`, default bf16, int8, powersgd:4) replaces it by the codec's exchange (its payload's textbook traffic)
  on each collective kind's own link, plus the codec's compute (calibrated, else at the sustained FLOP/s) and the
  loss's own all-reduce, and adds its error-feedback residuals to the memory (`jaxpar.cost.codecs`). A codec on
  whole arrays (PowerSGD) on a mesh whose replica spans devices is compiled once per mesh: the within-replica
  collectives its step adds (the compiler resharding its matmuls and QR) are added too (`_resharding_seconds`). A
  codec changes the math, so its steps to target come from `steps_ratio` under its label or "sync compress=CODEC".
  Where the codec also compresses the gradient's fsdp leg (fsdp > 1, rows split over fsdp by hand:
  `codecs.fsdp_leg`), the compiled step's gradient reduction over fsdp (its all-reduces and reduce-scatters over
  exactly fsdp) is replaced by the leg's textbook seconds on the fsdp link plus its compute.
- Remat policies are compiled on one mesh only (the first that builds): their ratios of temporaries and FLOPs to
  no remat are applied to every mesh (an estimate, said in the output).
- Time to a target loss: a strategy that averages less often may need more steps for the same loss. Those step
  ratios cannot be known before training; the advisor takes them from `steps_ratio` (default: none known, so plans
  are ranked by step time and local SGD / DiLoCo are marked "steps to target not known"). `benchmarks/
  strategies.py` measures such ratios for the built-in models; pass them as `steps_ratio={"local_sgd H=4": 1.25}`.

Why about 300 lines: the candidates, their pricing and the ranking text are one contract with `run.py --plan`.

Plans that do not fit a device's memory (the profile's `memory`, else the device's own) are listed with the
reason, after the ones that do. Ranked by projected seconds per step (times the step ratio where known).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

from jaxpar.errors import JaxparError

DEFAULT_PERIODS = (4, 16)
DEFAULT_REMATS = ("none", "full")
DEFAULT_CODECS = ("bf16", "int8", "powersgd:4")  # sync with an explicit allreduce, its exchange compressed


class Candidate(NamedTuple):
    """One plan: the flags that run it and what the advisor projects for it."""

    mesh: str  # a --mesh spec
    strategy: str  # e.g. "sync", "sync allreduce=ring", "local_sgd H=4"
    flags: str  # the run.py flags that run it
    remat: str
    seconds: float  # projected seconds per step
    memory: int  # bytes per device (compiled, or estimated: see `estimated`)
    fits: bool
    steps_ratio: float | None  # steps to the target loss relative to sync (None: not known)
    parts: dict  # compute / communication / exchange seconds, and what was estimated
    why: str = ""  # why it loses (set when ranked)


def factorizations(devices: int, axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered way to write `devices` as a product of `axes` positive integers."""
    if axes == 1:
        return [(devices,)]
    return [(d,) + rest for d in range(1, devices + 1) if devices % d == 0
            for rest in factorizations(devices // d, axes - 1)]


def mesh_specs(devices: int, stages: bool = False) -> list[str]:
    """The --mesh specs of every factorisation (data, fsdp, model; with `stages`, stage too), data-only first."""
    from jaxpar.parallel import mesh as mesh_lib

    roles = ((mesh_lib.DATA, mesh_lib.STAGE, mesh_lib.FSDP, mesh_lib.MODEL) if stages
             else (mesh_lib.DATA, mesh_lib.FSDP, mesh_lib.MODEL))
    specs = []
    for sizes in sorted(factorizations(devices, len(roles)), key=lambda s: tuple(-x for x in s)):
        specs.append(",".join(f"{role}={size}" for role, size in zip(roles, sizes)))
    return specs


def _strategies(periods, codecs=DEFAULT_CODECS):
    """(label, strategy instance or None for the compiled sync, flags, how to price) of every candidate."""
    from jaxpar.strategies import DiLoCo, LocalSGD, Sync

    out = [(Sync.name, Sync(), f"--strategy {Sync.name}", ("compiled",))]
    for algorithm in ("ring", "torus2d", "ps"):
        out.append((f"{Sync.name} allreduce={algorithm}", Sync(algorithm), f"--strategy {Sync.name} --allreduce {algorithm}",
                    ("allreduce", algorithm)))
        for codec in codecs:
            out.append((f"{Sync.name} allreduce={algorithm} compress={codec}", Sync(algorithm, compress=codec),
                        f"--strategy {Sync.name} --allreduce {algorithm} --compress {codec}",
                        ("compress", algorithm, codec, f"{Sync.name} compress={codec}")))
    for cls in (LocalSGD, DiLoCo):
        for h in periods:
            out.append((f"{cls.name} H={h}", cls(period=h), f"--strategy {cls.name} --sync-period {h}",
                        ("period", cls, h)))
    return out


def _exchange_seconds(entry) -> float:
    """Projected seconds of the compiled step's collectives over the data axis (the gradient average)."""
    from jaxpar.parallel import mesh as mesh_lib

    return sum(c.get("seconds", 0.0) for c in entry["communication"]
               if mesh_lib.DATA in c["axes"].split("+"))


def _allreduce_seconds(algorithm: str, replicas: int, gradient_bytes: int, profile) -> float:
    """The textbook time of averaging `gradient_bytes` over `replicas` with `algorithm` on the data link of a
    collective-permute (the profile's own, where calibrated)."""
    from jaxpar.parallel import mesh as mesh_lib
    from jaxpar.parallel.collectives import theoretical_traffic

    if replicas <= 1:
        return 0.0
    traffic = theoretical_traffic(algorithm, replicas, gradient_bytes)
    link = profile.link((mesh_lib.DATA,), "collective-permute")  # the algorithms are made of permutes
    return traffic["steps"] * link.alpha + traffic["bytes_sent_per_device"] / link.bandwidth


def _codec_seconds(strategy, replicas: int, params: list[dict], profile) -> tuple[float, float, int]:
    """(seconds of the compressed exchange on the data link, seconds of the codec's compute, bytes of its state per
    device) for `params` (the plan's parameters: whole shapes and bytes per device; `jaxpar.cost.codecs`). The
    exchange includes the explicit step's own all-reduce of its loss and metrics over data: the compiled step's
    data collectives it replaces held them (the compiler combines them with the gradient's)."""
    from jaxpar.cost import codecs
    from jaxpar.cost.hardware import collective_seconds
    from jaxpar.cost.hlo import Collective
    from jaxpar.parallel import mesh as mesh_lib

    communicator = strategy.communicator
    codec = codecs.codec_of(communicator)
    shapes = [tuple(p["shape"]) if not communicator.per_shard else (p["bytes_per_device"] // 4,) for p in params]
    splits = None if communicator.per_shard else [tuple(p["splits"]) for p in params]
    state = sum(p["bytes_per_device"] for p in params) if getattr(codec, "error_feedback", False) else 0
    axes = (mesh_lib.DATA,)
    wire = codecs.exchange_seconds(communicator, shapes, replicas, profile, axes, splits)
    wire += collective_seconds(Collective("all-reduce", 4, replicas, axes), profile)  # the loss mean
    return wire, codecs.compute_seconds(codec, shapes, replicas, profile), state


def _resharding_seconds(trainer, batch, sync_entry) -> float:
    """Seconds of the within-replica collectives a whole-array codec's step adds to the sync step's (`sync_entry`,
    the mesh's explain entry): PowerSGD's matmuls and QR on arrays split over fsdp / model make the compiler
    reshard them, a collective per matrix and round. Measured: on data=2,model=4 the MLP's PowerSGD step has 19
    permutes, 21 all-gathers and 4 all-reduces over model that its sync step does not, and the advisor projected
    1.9-2.5 ms for a step measured at 7.2-7.4 ms (docs/cost-model.md). `trainer`: that codec's Sync on the mesh,
    compiled here (once per mesh and codec: the algorithm over data does not change them)."""
    from jaxpar.cost.explain import explain
    from jaxpar.parallel import mesh as mesh_lib

    def within(entry) -> float:
        return sum(c.get("seconds", 0.0) for c in entry["communication"]
                   if mesh_lib.DATA not in c["axes"].split("+"))

    entry = next(iter(explain(trainer, batch)["variants"].values()))
    return max(within(entry) - within(sync_entry), 0.0)


def _fsdp_leg_seconds(trainer, variant, entry, batch, strategy, profile) -> tuple[float, float]:
    """(seconds the compressed fsdp leg saves against the compiled step's float32 reduction over fsdp, seconds of the
    leg's codec compute) for `strategy` on `trainer`'s mesh; (0, 0) where no codec compresses that leg."""
    from jaxpar.cost import codecs
    from jaxpar.parallel import mesh as mesh_lib

    leg = codecs.fsdp_leg(trainer, variant, batch, strategy)
    if leg is None:
        return 0.0, 0.0
    compiled = sum(c.get("seconds", 0.0) for c in entry["communication"]
                   if c["axes"] == mesh_lib.FSDP and c["kind"] in ("all-reduce", "reduce-scatter"))
    return compiled - codecs.fsdp_leg_seconds(leg, profile), leg["flops"] / profile.compute_flops


def _remat_ratios(trainer, batch, variant, remats, base) -> dict:
    """Per remat policy: (temporaries ratio, FLOPs ratio) to no remat (`base`: the trainer's own step's
    (temporaries, FLOPs per device), already compiled), each other policy compiled on `trainer`'s mesh."""
    from jaxpar.cost.hlo import loop_flops
    from jaxpar.runtime.resources import step_bytes, step_flops

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


def _compile_meshes(specs, make_trainer, batch, workers: int | None) -> dict:
    """{mesh spec: (its sync Trainer, {first variant: compiled step}) or the JaxparError that refused it}. Every
    mesh is built and lowered here one after another (tracing is Python), then the programs are compiled `workers`
    at a time: XLA compiles outside Python's lock, and compiling is most of a plan's time. Default 1: on the
    2-core machine under load, 2 workers took the transformer's plan from 165.9 s to 188.0 s (and the MLP's from
    41.0 to 34.0 s); `python -m benchmarks.plan_speed` compares them on a quiet machine."""
    from concurrent.futures import ThreadPoolExecutor

    lowered, out = {}, {}
    for spec in specs:
        try:
            trainer = make_trainer(spec)
            first = trainer.strategy.plan(trainer.ctx, 0)
            lowered[spec] = (trainer, first.variant, trainer.lowered_step(first.variant, batch, first.inputs))
        except JaxparError as error:
            out[spec] = error
    workers = max(1, min(workers or 1, len(lowered) or 1))
    with ThreadPoolExecutor(workers) as threads:
        futures = {spec: threads.submit(low.compile) for spec, (_, _, low) in lowered.items()}
        for spec, (trainer, variant, _) in lowered.items():
            out[spec] = (trainer, {variant: futures[spec].result()})
    return out


def plan(model: Callable, loss_fn: Callable, optimizer, batch, hardware, devices: int | None = None, *,
         rules=None, meshes=None, periods=DEFAULT_PERIODS, remats=DEFAULT_REMATS, codecs=DEFAULT_CODECS,
         stages: bool = False, steps_ratio: dict | None = None, progress: Callable[[str], None] | None = None,
         workers: int | None = None) -> dict:
    """Ranks the plans for `model` (a factory, as `Trainer` takes), `loss_fn`, `optimizer` and global batches
    shaped like `batch` on `devices` devices (default: all) of the hardware profile `hardware` (see the module
    docstring). Returns {"plans": [Candidate, ...] ranked, "refused": {mesh: reason}, "budget": bytes,
    "remat_mesh": the mesh remat ratios were compiled on}. `workers`: meshes compiled at once (default 1;
    `_compile_meshes`)."""
    import jax

    from jaxpar.cost.explain import explain
    from jaxpar.cost.fit import budget_of
    from jaxpar.cost import strategy_costs
    from jaxpar.cost.hardware import parse_hardware
    from jaxpar.errors import ConfigError
    from jaxpar.parallel.mesh import make_mesh, replica_count
    from jaxpar.train.remat import policy_of
    from jaxpar.train.trainer import Trainer

    profile = parse_hardware(hardware)
    if profile is None:
        raise ConfigError("plan: no hardware profile: pass hardware= (a profile name, key=value items, or a "
                          "calibration file from python -m jaxpar.calibrate)")
    devices = devices or len(jax.devices())
    pool = jax.devices()[:devices]
    if len(pool) < devices:
        raise ConfigError(f"plan: devices={devices}, but JAX has {len(pool)}; plan for at most {len(pool)}, or "
                          f"start with more (on CPU: run.py --plan --devices {devices} starts that many)")
    steps_ratio = dict(steps_ratio or {})
    strategies = _strategies(periods, codecs)
    plans, refused, ratios, remat_mesh, budget = [], {}, None, None, None
    reshards = {}  # (mesh, codec): seconds of the within-replica collectives a whole-array codec adds
    specs = meshes or mesh_specs(devices, stages)
    built = _compile_meshes(specs, lambda spec: Trainer(model, loss_fn, optimizer, make_mesh(spec, devices=pool),
                                                        rules=rules, hardware=profile), batch, workers)
    for spec in specs:
        try:
            if isinstance(built[spec], JaxparError):
                raise built[spec]
            trainer, compiled = built[spec]
            mesh = trainer.mesh
            report = explain(trainer, batch, compiled=compiled)
        except JaxparError as error:
            refused[spec] = str(error)
            if progress:
                progress(f"{spec}: refused ({str(error)[:100]})")
            continue
        budget = budget or budget_of(trainer)[0]
        variant, entry = next(iter(report["variants"].items()))
        if ratios is None:
            own = policy_of(None) == trainer.remat  # the trainer's own step is the no-remat one
            base = ((entry["memory"] or {}).get("temporaries"), entry["flops_per_device"]) if own else None
            ratios = _remat_ratios(trainer, batch, variant, remats, base)
            remat_mesh = spec
        compiled_total = entry["memory"]["total"] if entry["memory"] else 0
        temps = entry["memory"]["temporaries"] if entry["memory"] else 0
        sync_state = trainer.state_bytes_per_device()
        compute = entry["projected_seconds"]["compute"]
        comm = entry["projected_seconds"]["communication"]
        hidden = entry["projected_seconds"].get("overlap", 0.0)  # the compiler's gradient all-reduce only
        exchange = _exchange_seconds(entry)
        replicas = replica_count(mesh)
        gradient = int(sum(p["bytes_per_device"] for p in report["plan"]["parameters"]))
        for label, strategy, flags, how in strategies:
            codec_state, codec_compute = 0, 0.0
            if how[0] == "allreduce":
                if replicas <= 1:
                    continue  # no replicas to average over: the same as sync
                seconds = compute + comm - exchange + _allreduce_seconds(how[1], replicas, gradient, profile)
            elif how[0] == "compress":
                if replicas <= 1:
                    continue
                wire, codec_compute, codec_state = _codec_seconds(strategy, replicas, report["plan"]["parameters"],
                                                                  profile)
                if not strategy.communicator.per_shard and mesh.size > replicas:  # a replica spans devices
                    key = (spec, how[2])
                    if key not in reshards:
                        reshards[key] = _resharding_seconds(
                            Trainer(model, loss_fn, optimizer, mesh, rules=rules, strategy=strategy,
                                    hardware=profile), batch, entry)
                    wire += reshards[key]
                saved, leg_compute = _fsdp_leg_seconds(trainer, variant, entry, batch, strategy, profile)
                codec_compute += leg_compute
                seconds = compute + comm - exchange - saved + wire + codec_compute
            elif how[0] == "period":
                if replicas <= 1:
                    continue
                seconds = strategy_costs.project(how[1], compute + comm, compute + comm - exchange, how[2])[0]
            else:
                seconds = compute + comm - hidden
            try:
                state = (sync_state if how[0] != "period" else
                         Trainer(model, loss_fn, optimizer, mesh, rules=rules, strategy=strategy)
                         .state_bytes_per_device())
            except JaxparError as error:
                refused[f"{spec} {label}"] = str(error)
                continue
            for remat in remats:
                temp_ratio, flops_ratio = ratios.get(remat, (1.0, 1.0))
                memory = int(compiled_total - sync_state + state + codec_state - temps + temps * temp_ratio)
                step = seconds + compute * (flops_ratio - 1.0)
                estimated = [] if (how[0] == "compiled" and remat == "none") else ["memory"]
                if remat != "none":
                    estimated.append(f"remat ratios from {remat_mesh}")
                plans.append(Candidate(
                    spec, label, f"--mesh {spec} {flags}" + (f" --remat {remat}" if remat != "none" else ""),
                    remat, step, memory, memory <= budget,
                    1.0 if how[0] in ("compiled", "allreduce") else steps_ratio.get(
                        label, steps_ratio.get(how[3]) if how[0] == "compress" else None),
                    {"compute": compute * flops_ratio + codec_compute,
                     "communication": step - compute * flops_ratio - codec_compute,
                     "exchange": exchange, "estimated": estimated}))
        if progress:
            progress(f"{spec}: compiled; sync {(compute + comm - hidden) * 1e3:.4g} ms per step projected")
    ranked = _rank(plans)
    return {"plans": ranked, "refused": refused, "budget": budget, "remat_mesh": remat_mesh,
            "profile": profile.name, "devices": devices}


def _score(c: Candidate) -> tuple:
    """Fits first; then plans whose steps to target are known (sync's are: the same math), by time to target
    (seconds per step x steps ratio), then the others by step time alone; ties: less memory."""
    return (not c.fits, c.steps_ratio is None, c.seconds * (c.steps_ratio or 1.0), c.memory)


def _rank(plans) -> list[Candidate]:
    ranked = sorted(plans, key=_score)
    if not ranked:
        return []
    best = ranked[0]
    out = [best._replace(why="best")]
    for c in ranked[1:]:
        out.append(c._replace(why=_why(c, best)))
    return out


def _why(c: Candidate, best: Candidate) -> str:
    if not c.fits:
        return "does not fit a device's memory"
    reasons = []
    if c.parts["communication"] > best.parts["communication"] * 1.05:
        reasons.append(f"communication {c.parts['communication'] * 1e3:.3g} ms vs {best.parts['communication'] * 1e3:.3g}")
    if c.parts["compute"] > best.parts["compute"] * 1.05:
        reasons.append(f"compute {c.parts['compute'] * 1e3:.3g} ms vs {best.parts['compute'] * 1e3:.3g} (recompute or "
                       f"less parallel compute)")
    if c.steps_ratio is None:
        reasons.append("steps to target not known (a strategy that averages less often may need more steps)")
    elif math.isinf(c.steps_ratio):
        reasons.append("did not reach the target loss in the measured run")
    elif c.steps_ratio > 1:
        reasons.append(f"needs {c.steps_ratio:.2f}x the steps")
    return "; ".join(reasons) or "slightly slower"


def lines(result: dict, top: int = 5) -> list[str]:
    """The text `run.py --plan` prints."""
    plans = result["plans"]
    out = [f"jaxpar plan: {len(plans)} plans on {result['devices']} devices of {result['profile']} (a projection from "
           f"the cost model, not a measurement; memory budget {result['budget'] or 0:,} bytes per device)"]
    if not plans:
        out.append("no plan: every mesh was refused")
    for rank, c in enumerate(plans[:top], 1):
        ratio = ("" if c.steps_ratio in (None, 1.0) else
                 f", x{c.steps_ratio:.2f} steps -> {c.seconds * c.steps_ratio * 1e3:.4g} ms per sync step")
        estimated = f" (estimated: {', '.join(c.parts['estimated'])})" if c.parts["estimated"] else ""
        out.append(f"{rank:>3}. {c.seconds * 1e3:10.4g} ms/step{ratio}  {c.memory:>14,} bytes/device{estimated}"
                   f"{'' if c.fits else '  DOES NOT FIT'}")
        out.append(f"     python run.py {c.flags}")
    losers = plans[top:]
    if losers:
        out.append(f"and {len(losers)} more; why the next ones lose:")
        for c in losers[:top]:
            out.append(f"     {c.flags}: {c.seconds * 1e3:.4g} ms/step; {c.why}")
    for spec, reason in result["refused"].items():
        out.append(f"refused {spec}: {reason}")
    return out
