"""The plan advisor: which mesh, strategy and remat policy to run a model and global batch on N devices of a
hardware profile (`jaxpar.plan(...)`, `run.py --plan --hardware PROFILE [--devices N]`).

How a plan is priced (the cost model of `jaxpar.explain`, see docs/cost-model.md):
- Meshes: every factorisation of N into data x fsdp x model (stage only when asked for). A mesh the model does
  not divide over (a dimension not a multiple of the model axis, a batch not a multiple of data x fsdp) is refused
  with the Trainer's own one-line reason.
- Each mesh is compiled once, under sync SGD with the compiler's all-reduce (`jaxpar.explain`): its FLOPs, its
  collectives priced on the profile, and XLA's memory analysis.
- Strategies are priced from that one compiled step, never compiled themselves (`prices.py`): sync with a
  hand-written allreduce replaces the compiled gradient all-reduce over data by the algorithm's textbook traffic
  (`theoretical_traffic`: steps x alpha + bytes / bandwidth on the data link); local SGD and DiLoCo with period H
  take (H - 1) local steps (the compiled step minus its exchange over data) and one meeting (the whole step)
  per H (`Strategy.project`). Their memory is the compiled step's with the train state swapped for the
  strategy's own (`Trainer.state_bytes_per_device`, from shapes only). Sync with an explicit allreduce and a codec
  (`codecs`, default bf16, int8, powersgd:4) replaces it by the codec's exchange (its payload's textbook traffic)
  on each collective kind's own link, plus the codec's compute (calibrated, else at the sustained FLOP/s) and the
  loss's own all-reduce, and adds its error-feedback residuals to the memory (`jaxpar.cost.codecs`). A codec on
  whole arrays (PowerSGD) on a mesh whose replica spans devices is compiled once per mesh: the within-replica
  collectives its step adds (the compiler resharding its matmuls and QR) are added too. A codec changes the math,
  so its steps to target come from `steps_ratio` under its label or "sync compress=CODEC". Where the codec also
  compresses the gradient's fsdp leg (fsdp > 1, rows split over fsdp by hand: `codecs.fsdp_leg`), the compiled
  step's gradient reduction over fsdp (its all-reduces and reduce-scatters over exactly fsdp) is replaced by the
  leg's textbook seconds on the fsdp link plus its compute.
- Remat policies are compiled on one mesh only (the first that builds): their ratios of temporaries and FLOPs to
  no remat are applied to every mesh (an estimate, said in the output).
- Time to a target loss: a strategy that averages less often may need more steps for the same loss. Those step
  ratios cannot be known before training; the advisor takes them from `steps_ratio` (default: none known, so plans
  are ranked by step time and local SGD / DiLoCo are marked "steps to target not known"). `benchmarks/
  strategies.py` measures such ratios for the built-in models; pass them as `steps_ratio={"local_sgd H=4": 1.25}`.

Plans that do not fit a device's memory (the profile's `memory`, else the device's own) are listed with the
reason, after the ones that do. Ranked by projected seconds per step (times the step ratio where known;
`ranking.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import jax

from jaxpar.advisor.candidates import (ALLREDUCE, COMPILED, COMPRESS, DEFAULT_CODECS, DEFAULT_PERIODS, DEFAULT_REMATS,
                                       PERIOD, Candidate, Choice, long_sequence, mesh_specs, strategy_choices)
from jaxpar.advisor.compiling import compiled_meshes
from jaxpar.advisor.prices import (allreduce_seconds, codec_seconds, exchange_seconds, fsdp_leg_seconds,
                                   remat_ratios, resharding_seconds)
from jaxpar.advisor.ranking import rank
from jaxpar.cost import strategy_costs
from jaxpar.cost.explain import explain
from jaxpar.cost.hardware_flag import parse_hardware
from jaxpar.cost.memory_fit import budget_of
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.parallel.mesh import make_mesh, replica_count
from jaxpar.train.remat import policy_of
from jaxpar.train.trainer import Trainer


# the most devices `run.py --plan` plans for: it starts them (on CPU, emulated devices) and compiles every mesh of
# them. On the 2-core test machine 1,024 CPU devices started in 5.5 s and the MLP's meshes of them compiled in 8 to
# 27 s each (`advise(..., meshes=[spec])`); 4,096 took 31 s to start, 100,000 would take hours
MAX_DEVICES = 1024


@dataclass(frozen=True)
class Search:
    """What `advise` weighs, and how: its keyword arguments (see `advise`)."""

    rules: object = None  # the sharding rules every Trainer is built with
    meshes: tuple | list | None = None  # the --mesh specs to weigh (default: every factorisation of the devices)
    periods: tuple = DEFAULT_PERIODS  # local SGD's and DiLoCo's periods
    remats: tuple = DEFAULT_REMATS
    codecs: tuple = DEFAULT_CODECS
    stages: bool = False  # meshes with a stage axis too
    steps_ratio: dict | None = None  # strategy label -> steps to the target loss relative to sync
    progress: Callable[[str], None] | None = None  # told each mesh's outcome
    workers: int | None = None  # meshes compiled at once (`compiled_meshes`)


@dataclass(frozen=True)
class Problem:
    """What is planned: `model`, `loss_fn` and `optimizer` on global batches shaped like `batch`, over the devices
    `pool` priced on `profile`."""

    model: Callable
    loss_fn: Callable
    optimizer: object
    batch: dict
    profile: object
    pool: list
    rules: object = None

    def trainer(self, mesh, strategy=None, priced: bool = True) -> Trainer:
        """A Trainer of the problem on `mesh` (a Mesh, or a --mesh spec over `pool`), priced on the profile."""
        mesh = make_mesh(mesh, devices=self.pool) if isinstance(mesh, str) else mesh
        return Trainer(self.model, self.loss_fn, self.optimizer, mesh, rules=self.rules, strategy=strategy,
                       hardware=self.profile if priced else None)


class SyncStep(NamedTuple):
    """A mesh's compiled sync step: the parts every strategy on that mesh is priced from."""

    spec: str
    trainer: Trainer
    variant: str
    entry: dict  # its `jaxpar.explain` entry
    params: list  # the explain report's parameters (whole shapes, bytes per device)
    compute: float  # projected seconds
    comm: float
    hidden: float  # the compiler's gradient all-reduce hidden under the backward pass
    exchange: float  # the collectives over data
    replicas: int
    gradient: int  # bytes of one replica's gradient on one device
    memory: int  # the compiled step's bytes per device
    temporaries: int
    state: int  # the sync train state's bytes per device


def advise(model: Callable, loss_fn: Callable, optimizer, batch, hardware, devices: int | None = None,
           **search) -> dict:
    """Ranks the plans for `model` (a factory, as `Trainer` takes), `loss_fn`, `optimizer` and global batches
    shaped like `batch` on `devices` devices (default: all) of the hardware profile `hardware` (see the module
    docstring). Keywords (`Search`): rules, meshes, periods, remats, codecs, stages, steps_ratio, progress, workers.
    Returns {"plans": [Candidate, ...] ranked, "refused": {mesh: reason}, "budget": bytes, "remat_mesh": the mesh
    remat ratios were compiled on, "profile": its name, "devices": N}."""
    search = Search(**search)
    problem = _problem(model, loss_fn, optimizer, batch, hardware, devices, search.rules)
    devices = len(problem.pool)
    choices = strategy_choices(search.periods, search.codecs)
    # long sequences: meshes with a seq axis too (context parallelism; the model must call jaxpar.attention)
    specs = list(search.meshes or mesh_specs(devices, search.stages, long_sequence(batch)))
    say = search.progress or (lambda line: None)
    say(f"{len(specs)} mesh(es) of {devices} devices to compile, each reported as it is priced")
    plans, refused, reshards = [], {}, {}
    ratios = remat_mesh = budget = None
    for spec, built in compiled_meshes(specs, problem.trainer, problem.batch, search.workers):
        try:
            if isinstance(built, JaxparError):
                raise built
            step = _sync_step(problem, spec, *built)
        except JaxparError as error:
            refused[spec] = str(error)
            say(f"{spec}: refused ({str(error)[:100]})")
            continue
        budget = budget or budget_of(step.trainer)[0]
        if ratios is None:
            ratios, remat_mesh = _remat_ratios(problem, step, search.remats), spec
        for choice in choices:
            priced = _strategy_seconds(problem, step, choice, reshards)
            if priced is None:
                continue  # no replicas to average over: the same as sync
            try:
                state = step.state if choice.how != PERIOD else problem.trainer(
                    step.trainer.mesh, choice.strategy, priced=False).state_bytes_per_device()
            except JaxparError as error:
                refused[f"{spec} {choice.label}"] = str(error)
                continue
            plans += _candidates(step, choice, priced, state, ratios, remat_mesh, budget, search)
        say(f"{spec}: compiled; sync {(step.compute + step.comm - step.hidden) * 1e3:.4g} ms per step projected")
    return {"plans": rank(plans), "refused": refused, "budget": budget, "remat_mesh": remat_mesh,
            "profile": problem.profile.name, "devices": devices}


def _problem(model, loss_fn, optimizer, batch, hardware, devices, rules) -> Problem:
    """The problem, its profile read and its devices checked (one ConfigError line each)."""
    profile = parse_hardware(hardware)
    if profile is None:
        raise ConfigError("plan: no hardware profile: pass hardware= (a profile name, key=value items, or a "
                          "calibration file from python -m jaxpar.calibrate)")
    devices = devices or len(jax.devices())
    pool = jax.devices()[:devices]
    if len(pool) < devices:
        raise ConfigError(f"plan: devices={devices}, but JAX has {len(pool)}; plan for at most {len(pool)}, or "
                          f"start with more (on CPU: run.py --plan --devices {devices} starts that many)")
    return Problem(model, loss_fn, optimizer, batch, profile, pool, rules)


def _sync_step(problem: Problem, spec: str, trainer: Trainer, compiled: dict) -> SyncStep:
    """The mesh's compiled sync step, explained and priced (`jaxpar.explain` on the step already compiled)."""
    report = explain(trainer, problem.batch, compiled=compiled)
    variant, entry = next(iter(report["variants"].items()))
    projected, memory = entry["projected_seconds"], entry["memory"]
    params = report["plan"]["parameters"]
    return SyncStep(spec, trainer, variant, entry, params, projected["compute"], projected["communication"],
                    projected.get("overlap", 0.0), exchange_seconds(entry), replica_count(trainer.mesh),
                    int(sum(p["bytes_per_device"] for p in params)), memory["total"] if memory else 0,
                    memory["temporaries"] if memory else 0, trainer.state_bytes_per_device())


def _remat_ratios(problem: Problem, step: SyncStep, remats) -> dict:
    """Per remat policy, (temporaries, FLOPs) ratios to no remat, compiled on `step`'s mesh."""
    own = policy_of(None) == step.trainer.remat  # the trainer's own step is the no-remat one
    base = ((step.entry["memory"] or {}).get("temporaries"), step.entry["flops_per_device"]) if own else None
    return remat_ratios(step.trainer, problem.batch, step.variant, remats, base)


def _strategy_seconds(problem: Problem, step: SyncStep, choice: Choice, reshards: dict):
    """(projected seconds per step, codec compute seconds, codec state bytes) of `choice` on `step`'s mesh, or None
    where it needs replicas the mesh does not have. `reshards`: (mesh, codec) -> seconds, filled as compiled."""
    base = step.compute + step.comm
    if choice.how == COMPILED:
        return base - step.hidden, 0.0, 0
    if step.replicas <= 1:
        return None
    if choice.how == ALLREDUCE:
        return base - step.exchange + allreduce_seconds(choice.algorithm, step.replicas, step.gradient,
                                                         problem.profile), 0.0, 0
    if choice.how == PERIOD:
        return strategy_costs.project(type(choice.strategy), base, base - step.exchange, choice.period)[0], 0.0, 0
    assert choice.how == COMPRESS, choice.how
    wire, compute, state = codec_seconds(choice.strategy, step.replicas, step.params, problem.profile)
    mesh = step.trainer.mesh
    if not choice.strategy.communicator.per_shard and mesh.size > step.replicas:  # a replica spans devices
        key = (step.spec, choice.codec)
        if key not in reshards:
            reshards[key] = resharding_seconds(problem.trainer(mesh, choice.strategy), problem.batch, step.entry)
        wire += reshards[key]
    saved, leg_compute = fsdp_leg_seconds(step.trainer, step.variant, step.entry, problem.batch, choice.strategy,
                                          problem.profile)
    compute += leg_compute
    return base - step.exchange - saved + wire + compute, compute, state


def _candidates(step: SyncStep, choice: Choice, priced, state: int, ratios: dict, remat_mesh: str, budget: int,
                search: Search) -> list[Candidate]:
    """`choice` on `step`'s mesh under each remat policy, memory and time scaled by the policy's ratios."""
    seconds, codec_compute, codec_state = priced
    steps_ratio = dict(search.steps_ratio or {})
    known = 1.0 if choice.how in (COMPILED, ALLREDUCE) else next(
        (steps_ratio[k] for k in choice.ratio_labels if k in steps_ratio), None)
    out = []
    for remat in search.remats:
        temp_ratio, flops_ratio = ratios.get(remat, (1.0, 1.0))
        memory = int(step.memory - step.state + state + codec_state - step.temporaries + step.temporaries * temp_ratio)
        seconds_now = seconds + step.compute * (flops_ratio - 1.0)
        estimated = [] if (choice.how == COMPILED and remat == "none") else ["memory"]
        if remat != "none":
            estimated.append(f"remat ratios from {remat_mesh}")
        flags = f"--mesh {step.spec} {choice.flags}" + (f" --remat {remat}" if remat != "none" else "")
        out.append(Candidate(
            step.spec, choice.label, flags, remat, seconds_now, memory, memory <= budget, known,
            {"compute": step.compute * flops_ratio + codec_compute,
             "communication": seconds_now - step.compute * flops_ratio - codec_compute,
             "exchange": step.exchange, "estimated": estimated}))
    return out
