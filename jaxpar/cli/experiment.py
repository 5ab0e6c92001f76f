"""`train(config)`: the whole run behind `python run.py` — config -> data -> mesh -> trainer -> `fit` with actions
-> summary.

Everything that can be checked before JAX starts (flags, files, mesh spec, batch divisibility) is checked first, so
a bad input fails in a second with one line and nothing written.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time

import jax
import numpy as np
import optax

import models
from jaxpar.train import actions
from jaxpar.io import data
from jaxpar.runtime import distributed
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.cli.config import APPLIES_TO, Config
from jaxpar.errors import CheckpointError, ConfigError, DataError, JaxparError, Preempted, ShardingError, Terminated, cli_message
from jaxpar.runtime.preemption import StopRequest
from jaxpar.io.metrics import JsonlFile, RunLogger, TensorBoardFile, records_before
from jaxpar.train.schedules import batch_size_fn, lr_schedule, parse_batch_ramp
from jaxpar.strategies import from_config as strategy_from_config
from jaxpar.strategies import option_default
from jaxpar.train.trainer import Trainer


def batch_sizes(config: Config, ways: int, replicas: int) -> list[int]:
    """Every global batch size the run will use (ramp stages that start at or after --steps never run and are not
    checked), checked against the batch axes and --grad-accum."""
    if config.batch_ramp:
        sizes = [size for start, size in parse_batch_ramp(config.batch_ramp, ways, config.steps)
                 if start < config.steps]
        flag = "--batch-ramp"
    else:
        sizes, flag = [config.batch_size], "--batch-size"
    axes = " x ".join(mesh_lib.BATCH_AXES)
    for size in sizes:
        if size % ways:
            good = max(ways, size // ways * ways)
            raise ConfigError(f"{flag} {size} does not divide by the {ways} devices the batch is split over ({axes} "
                              f"of --mesh {config.mesh}); use a multiple of {ways}, e.g. {flag} {good}")
        if (size // replicas) % config.grad_accum:
            raise ConfigError(f"--grad-accum {config.grad_accum} does not divide the per-replica batch "
                              f"{size // replicas} ({flag} {size} / {replicas} replicas)")
    return sizes


def make_optimizer(config: Config, schedule) -> optax.GradientTransformation:
    if config.optimizer == "adamw":
        return optax.adamw(schedule, weight_decay=config.weight_decay)
    momentum = 0.9 if config.optimizer == "momentum" else None
    return optax.chain(optax.add_decayed_weights(config.weight_decay), optax.sgd(schedule, momentum=momentum))


def datasets(config: Config, size_at, largest: int):
    """(train batches, held-out source or None) for the config's model."""
    if config.model == "transformer":
        tokens = data.load_text(config.data)
        models.check_labels({"tokens": tokens}, config.vocab)  # bytes < 256 <= vocab: a cheap guard all the same
        train_tokens, val_tokens = data.split_text(tokens, seq_len=config.seq_len)
        train = data.text_batches(train_tokens, size_at, config.seq_len, config.seed, "training text",
                                  largest_batch=largest)
        held_out = data.TextWindows(val_tokens, config.seq_len)
    else:
        train_split, test_split = data.load_digits()
        for split in (train_split, test_split):
            models.check_labels(split, 10)
        train = data.array_batches(train_split, size_at, config.seed, "digits training split", largest_batch=largest)
        held_out = data.ArraySource(test_split)
    return train, held_out


def divergence_hint(config: Config, size_at):
    """`hint(loss, step)` for `StopIfDiverged`: the likely culprits among the settings this run changed from their
    defaults, most likely first (a too-high lr, made higher by --lr-scaling; no warmup; a large batch)."""
    default = Config()
    base = config.base_batch_size or size_at(0)
    sizes = [size for _, size in getattr(size_at, "stages", [(0, size_at(0))])]
    scale = max(size / base for size in sizes)
    peak = config.lr * (scale if config.lr_scaling == "linear" else
                        math.sqrt(scale) if config.lr_scaling == "sqrt" else 1.0)

    def hint(loss: float, step: int) -> str:
        advice = []
        if config.lr != default.lr or config.optimizer != default.optimizer:
            advice.append(f"lower --lr (it is {config.lr:g} with --optimizer {config.optimizer}; try 10x smaller)")
        else:
            advice.append("lower --lr")
        if peak > config.lr * 1.0001:
            advice.append(f"--lr-scaling {config.lr_scaling} raises it to {peak:g} at the largest batch: use sqrt or "
                          f"a smaller --batch-ramp")
        if config.weight_decay > 0.1 and config.optimizer != "adamw":
            advice.append(f"lower --weight-decay (it is {config.weight_decay:g}: L2 that large makes SGD unstable)")
        if not config.warmup_steps:
            advice.append("add --warmup-steps")
        if config.batch_size != default.batch_size or config.batch_ramp:
            advice.append("or use a smaller --batch-size")
        return ", ".join(advice)

    return hint


def run_notes(config: Config) -> list[str]:
    """One line per setting that cannot act within --steps (printed, not refused: the run is still valid)."""
    steps, notes = config.steps, []
    default = Config()

    def given(name):  # set to something other than its default (by a flag or a config file)
        value = getattr(config, name)
        if value is None:
            return False
        fallback = getattr(default, name)
        if fallback is None and config.applies(name):
            fallback = option_default(config.strategy, name) if name in APPLIES_TO else None
        return value != fallback

    if config.warmup_steps > steps:
        notes.append(f"--warmup-steps {config.warmup_steps} is larger than --steps {steps}: the lr never reaches "
                     f"its peak")
    if given("sync_period") and config.sync_period > steps:
        notes.append(f"--sync-period {config.sync_period} is larger than --steps {steps}: the replicas never meet "
                     f"after their local steps")
    if given("local_after") and config.local_after > steps:
        notes.append(f"--local-after {config.local_after} is larger than --steps {steps}: the whole run is "
                     f"synchronous")
    if given("staleness") and config.staleness > steps:
        notes.append(f"--staleness {config.staleness} is larger than --steps {steps}: no gradient can be that stale, "
                     f"so this run is ASP (the version buffer holds {steps + 1})")
    if config.eval_every > steps:
        notes.append(f"--eval-every {config.eval_every} is larger than --steps {steps}: evaluation only at the end")
    if config.log_every > steps and given("log_every"):
        notes.append(f"--log-every {config.log_every} is larger than --steps {steps}: only the first and last steps "
                     f"are logged")
    if config.batch_ramp:
        late = [f"{size}:{start}" for start, size in parse_batch_ramp(config.batch_ramp) if start >= steps]
        if late:
            notes.append(f"--batch-ramp stage(s) {','.join(late)} start at or after --steps {steps}: never used")
    return notes


# Counts up to this many steps are never capped: the SSP version buffer (staleness + 1) of a run does not depend on
# --steps, so a resumed run with a larger --steps restores it exactly.
CAP_FLOOR = 64


def strategy_config(config: Config) -> Config:
    """The config the strategy is built from: counts that only matter up to --steps are capped at max(--steps,
    CAP_FLOOR) (identical training; bounded host and device memory: the SSP version buffer is staleness + 1, the
    post-local clock is simulated up to local_after)."""
    bound = max(config.steps, CAP_FLOOR)
    capped = {name: min(getattr(config, name), bound) for name in ("staleness", "local_after")
              if getattr(config, name) is not None}
    return config.replace(**capped) if capped else config


# The flag that sets each logical dimension of the built-in models (None: fixed by the dataset).
_DIMENSION_FLAGS = {"transformer": {"mlp": "d_ff", "heads": "heads", "vocab": "vocab", "embed": "d_model"},
                    "mlp": {"mlp": "hidden"}, "cnn": {"mlp": "channels"}}
_NOT_DIVISIBLE = re.compile(r"^model dimension '(?P<name>[^']+)' = (?P<size>\d+) \(parameter [^)]*\) is not divisible "
                            r"by mesh axis '(?P<axis>[^']+)' of size (?P<ways>\d+)")


def _as_flag_error(error: ShardingError, config: Config) -> JaxparError:
    """A built-in model's dimension that does not divide, said in flags (`--hidden`, not the logical `mlp`)."""
    found = _NOT_DIVISIBLE.match(str(error))
    flag = found and _DIMENSION_FLAGS.get(config.model, {}).get(found["name"])
    if not flag:
        return error
    size, axis, ways = found["size"], found["axis"], int(found["ways"])
    shown = f"--{flag.replace('_', '-')}" if flag != "channels" else "channels (config file)"
    fits = [d for d in range(1, ways + 1) if int(size) % d == 0 and ways % d == 0][-1]
    return ConfigError(f"{shown} {size} does not divide by the {axis} axis of size {ways} (--mesh {config.mesh}); "
                       f"use a multiple of {ways} for {shown}, or a {axis} axis that divides {size} (e.g. {fits})")


def join_processes(config: Config) -> bool:
    """Starts JAX's distributed runtime when the config or the environment asks for several processes (see
    `jaxpar.distributed`); each process then creates mesh size / processes CPU devices. True if several."""
    shape = mesh_lib.parse_mesh_spec(config.mesh)
    given = (config.coordinator, config.num_processes, config.process_id)
    count = config.num_processes or distributed.settings_from_environment().get("num_processes")
    local = None
    if count and count > 1 and -1 not in shape:
        if math.prod(shape) % count:
            raise ConfigError(f"--mesh {config.mesh} has {math.prod(shape)} devices, which do not divide over "
                              f"--num-processes {count}; use a mesh whose size is a multiple of {count}")
        local = math.prod(shape) // count
    if any(value is not None for value in given):
        return distributed.initialize(*given, local_devices=local)
    return distributed.initialize(local_devices=local)


def train(config: Config) -> dict:
    """Trains `config.model` and returns a summary (final training metrics, held-out metrics, throughput).

    With several processes (see `join_processes`) every process calls this; only process 0 prints and writes the
    metrics file, and every process returns the same summary."""
    config = config.validate().resolved()
    if join_processes(config) and not distributed.is_main():
        logging.getLogger("jaxpar").setLevel(logging.ERROR)  # process 0 reports the notes
    for line in run_notes(config):
        logging.getLogger("jaxpar").warning(line)
    # opened (and probed: a byte written and fsync'd) before any work, so an unwritable path fails in a second;
    # renamed onto --metrics only once training has started (see jaxpar.metrics)
    jsonl = JsonlFile(config.metrics) if config.metrics and distributed.is_main() else None
    try:
        board = TensorBoardFile(config.tensorboard) if config.tensorboard and distributed.is_main() else None
        try:
            return _train(config, jsonl, board)
        finally:
            if board is not None:
                board.close()  # (the logger closes it first when training started)
    finally:
        if jsonl is not None:
            jsonl.discard()  # a no-op once committed


def _train(config: Config, jsonl, board=None) -> dict:
    shape = dict(zip(mesh_lib.AXES, mesh_lib.parse_mesh_spec(config.mesh)))
    if -1 not in shape.values():
        batch_sizes(config, math.prod(shape[a] for a in mesh_lib.BATCH_AXES), shape[mesh_lib.REPLICA_AXIS])
    ramp = parse_batch_ramp(config.batch_ramp) if config.batch_ramp else None
    size_at = batch_size_fn(config.batch_size, ramp)
    largest = max(batch_sizes(config, 1, 1))
    train_batches, held_out = datasets(config, size_at, largest)
    strategy = strategy_from_config(strategy_config(config))
    mesh = mesh_lib.make_mesh(config.mesh)
    crossing = mesh_lib.crossing_axes(mesh)
    if mesh_lib.TENSOR_AXIS in crossing:
        logging.getLogger("jaxpar").warning(
            f"--mesh {config.mesh}: the {mesh_lib.TENSOR_AXIS} axis spans processes (each has "
            f"{len(mesh.local_devices)} devices): its per-layer collectives cross hosts; a {mesh_lib.TENSOR_AXIS} axis "
            f"of at most {len(mesh.local_devices)} stays inside one")
    ways, replicas = mesh_lib.batch_ways(mesh), mesh_lib.replica_count(mesh)
    batch_sizes(config, ways, replicas)
    if config.eval_batches and len(held_out) < ways:
        raise DataError(f"the held-out split has {len(held_out)} examples, fewer than the {ways} devices the batch "
                        f"is split over; use more data (--data) or --eval-batches 0")

    schedule = lr_schedule(config.lr, config.steps, scaling=config.lr_scaling, base_batch_size=config.base_batch_size,
                           batch_at=size_at, warmup_steps=config.warmup_steps, schedule=config.lr_schedule,
                           decay_steps=config.decay_steps(), decay_factor=config.lr_decay_factor)
    local_bn = config.bn == "local" or strategy.local_statistics  # (also in _run)
    # local BatchNorm = each replica's slice; under shard_map the replica's slice is all the step sees already
    bn_groups = replicas if local_bn and not strategy.local_statistics else 1
    try:
        trainer = Trainer(model=models.factory(config, bn_groups=bn_groups),
                          loss_fn=models.loss_for(config), eval_loss_fn=models.LOSSES[config.model],
                          optimizer=make_optimizer(config, schedule), mesh=mesh,
                          rules=config.rules, strategy=strategy, grad_accum=config.grad_accum,
                          skip_nonfinite=config.on_nonfinite == "skip", hardware=config.hardware)
    except ShardingError as error:
        raise _as_flag_error(error, config) from None
    train_batches.rows = trainer.local_rows  # each process loads only its rows of every global batch
    if config.explain:
        return explain_run(config, trainer, train_batches)
    checkpoints = None
    if config.checkpoint_dir:
        from jaxpar.io.checkpoint import Checkpointer  # orbax is imported only by runs that checkpoint

        created = not os.path.exists(config.checkpoint_dir)
        checkpoints = Checkpointer(config.checkpoint_dir, config.keep)
        existing = checkpoints.steps()
        if existing and not config.resume:
            raise CheckpointError(checkpoints.directory, f"already holds checkpoints of another run (steps "
                                                         f"{', '.join(map(str, existing))}); pass {{resume}} to "
                                                         f"continue it, or use an empty folder")
    # SIGTERM / Ctrl-C from here to the end of the last save: save a checkpoint and stop (see jaxpar.preemption)
    # (several processes: always, since SIGTERM belongs to JAX's preemption notifier there and must stop every process
    # after the same step, with or without a checkpoint)
    agreed = checkpoints is not None or jax.process_count() > 1
    with StopRequest() if agreed else contextlib.nullcontext() as stop:
        try:
            summary = _run(config, jsonl, trainer, checkpoints, stop, train_batches, held_out, size_at, largest,
                           schedule, board)
        except BaseException:
            if checkpoints is not None:
                checkpoints.close(quiet=True)  # durable if it can be; the error on its way out is the one to report
                if created and distributed.is_main() and not os.listdir(checkpoints.directory):
                    os.rmdir(checkpoints.directory)  # a run that saved nothing leaves no folder behind
            raise
        if checkpoints is not None:
            checkpoints.close()  # every save started is durable before the run reports success
        return summary


def explain_run(config: Config, trainer: Trainer, train_batches) -> dict:
    """--explain: the plan, memory, collectives and FLOPs of the first batch's step variants; nothing trains."""
    from jaxpar.cost.explain import explain, format_explain

    rows = next(iter(train_batches))  # this process's rows: the step is compiled for the global batch's shape
    batch = {k: jax.ShapeDtypeStruct((trainer.global_rows(len(v)),) + v.shape[1:], v.dtype) for k, v in rows.items()}
    blocks = config.layers if config.model == "transformer" else None
    report = explain(trainer, batch, blocks=blocks)
    if distributed.is_main():
        print(format_explain(report), flush=True)
    return {"explain": report}


def _run(config, jsonl, trainer, checkpoints, stop, train_batches, held_out, size_at, largest, schedule,
         board=None) -> dict:
    strategy, mesh, replicas = trainer.strategy, trainer.mesh, trainer.num_replicas
    local_bn = config.bn == "local" or strategy.local_statistics
    state, start, meta = None, 0, {}
    if config.resume:
        from jaxpar.cli.resume import resume_run

        state, start, meta = resume_run(checkpoints, trainer, config, train_batches)
    if state is None:
        state = trainer.init(config.seed)
    replica_check = actions.CheckReplicas(config.check_every)
    if config.check_every:
        replica_check.check(trainer, state, start)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    bn = ""
    if config.model == "cnn":  # only the CNN has BatchNorm; say why it is local when the strategy decides it
        why = " (each replica computes on its own slice under this strategy)" if strategy.local_statistics else ""
        bn = f"; BatchNorm {'local' if local_bn else 'sync'}{why}"
    per_replica = f"{size_at(0) // replicas} per replica" + (" at first" if config.batch_ramp else "")
    say = print if distributed.is_main() else (lambda *args, **kwargs: None)  # process 0 reports
    count = jax.process_count()
    processes = f" in {count} processes, {len(mesh.local_devices)} each" if count > 1 else ""
    say(f"jaxpar: {config.model} ({n_params:,} parameters, {config.dtype}) on mesh {mesh_lib.shape_line(mesh)} "
        f"({mesh.size} {mesh.devices.flat[0].platform} devices{processes}); global batch "
        f"{config.batch_ramp or config.batch_size} ({per_replica}); strategy {config.strategy}{bn}; "
        f"{config.steps} steps" + (f", resumed at step {start}" if start else ""), flush=True)
    if config.strategy in ("ssp", "asp") and not config.stragglers:
        say(f"jaxpar: note: --strategy {config.strategy} without --stragglers: every replica is equally fast, so "
            f"every update applies every replica's fresh gradient, as sync SGD does (give --stragglers to see "
            f"staleness)", flush=True)

    peak = None
    if trainer.hardware is not None:
        peak = trainer.hardware.flops * mesh.size
        say(f"jaxpar: sim_time is priced on {trainer.hardware.describe()}: a projection from each compiled step's "
            f"FLOPs and collectives, not this machine's time; flops_utilization is against that profile's peak",
            flush=True)
    elif mesh.devices.flat[0].platform == "cpu":  # the utilisation's denominator: a measured peak, said as such
        from jaxpar.runtime.resources import measured_matmul_peak

        peak = measured_matmul_peak()
        say(f"jaxpar: flops_utilization in the metrics is the step's FLOPs (XLA cost analysis) per second against "
            f"a measured float32 matmul peak of this CPU, {peak / 1e9:.1f} GFLOP/s (all devices share its cores)",
            flush=True)
    host_lrs = schedule  # evaluated on the host for logged steps only (no per-step table: --steps may be huge)
    # without a straggler profile sim_time is just the step count: kept in the JSONL, not printed
    logger = RunLogger(config.steps, size_at, config.log_every, jsonl, stream=None if distributed.is_main() else
                       open(os.devnull, "w"),
                       quiet=("skipped",) if config.stragglers or config.hardware else ("sim_time", "skipped"), start_step=start,
                       tokens_per_example=config.seq_len if config.model == "transformer" else None,
                       tensorboard=board, peak_flops=peak)

    class Extras(actions.Action):  # lr and batch size of the step, for the steps the log records
        def due(self, step, last):
            return step == start + 1 or step % config.log_every == 0 or last

        def __call__(self, event):
            # SSP / ASP: the batch whose gradient the update applied (the contributing replicas' examples)
            batch = event.metrics.get("examples", size_at(event.step - 1))
            event.metrics.update(lr=float(host_lrs(event.step - 1)), batch_size=float(batch))

    def on_eval(step, results):
        logger.write({"step": step, **{"eval_" + k: v for k, v in results.items()}})
        say(f"held-out at step {step}: " + "  ".join(f"{k} {v:.4g}" for k, v in results.items()), flush=True)

    evaluation = actions.Evaluate(lambda tr, st: evaluate(tr, st, held_out, largest, config),
                                  every=config.eval_every, on_result=on_eval, at_end=bool(config.eval_batches))
    last = {}
    skips = config.max_skips if config.on_nonfinite == "skip" else None
    guard = actions.StopIfDiverged(divergence_hint(config, size_at), max_skips=skips, max_skips_name="--max-skips")
    guard.set_state(meta.get("guard", {}))  # skip counts and the first loss continue across a resume
    loop = [guard,
            Extras(), actions.OnStep(lambda step, metrics: last.update(metrics)), actions.Log(logger)]
    if config.check_every:
        loop.append(replica_check)
    if config.eval_batches:
        loop.append(evaluation)
    batches = data.prefetch_to_device(train_batches, trainer.shard_batch)
    if checkpoints is not None:
        record = config.to_record()
        saving = actions.Checkpoint(checkpoints, config.checkpoint_every,
                                    extra=lambda: {"batches": batches.get_state(), "config": record,
                                                  "guard": guard.get_state()})
        loop += [saving, actions.StopWhen(stop.at, saving)]
    elif stop is not None:  # several processes without checkpoints: a SIGTERM ends every process after one step
        loop.append(actions.StopWhen(stop.at, None))
    if start and jsonl is not None:  # one continuous file: the earlier run's records up to the resumed step
        for record in records_before(config.metrics, start):
            logger.write(record)
    logger.write({**config.to_record(), **({"resumed_from": start} if start else {})})
    try:
        started = time.perf_counter()
        state = trainer.fit(state, batches, config.steps - start, actions=loop)
        seconds = time.perf_counter() - started
    except BaseException as error:  # training started: keep what was logged, and say how it ended
        reason = (cli_message(error) if isinstance(error, JaxparError) else
                  f"preempted: checkpoint of step {error.step} saved" if isinstance(error, Preempted) else
                  "terminated" if isinstance(error, Terminated) else
                  "interrupted" if isinstance(error, KeyboardInterrupt) else f"{type(error).__name__}: {error}")
        try:
            logger.write({"stopped": reason})
            logger.close()
        except JaxparError:
            pass  # the metrics file failed too: the original error is the one to report
        raise
    logger.close()
    held = evaluation.history[-1][1] if evaluation.history else {}
    summary = {"final_" + k: v for k, v in last.items()}
    summary.update(steps=config.steps - start, seconds=seconds, steps_per_sec=(config.steps - start) / seconds)
    summary.update({"eval_" + k: v for k, v in held.items()})
    return summary


def evaluate(trainer: Trainer, state, source, batch_size: int, config: Config) -> dict[str, float]:
    """Mean eval-mode metrics on the held-out split, in a fixed order.

    Digits (an array source): the whole test split in one batch, cut to a multiple of the batch axes' size (300 ->
    296 on 8 devices). Text: the first `config.eval_batches` training-sized batches of validation windows (fewer
    if the split is smaller).
    """
    ways = trainer.batch_divisor
    if isinstance(source, data.ArraySource) or len(source) < batch_size:
        batch_size, count = len(source) // ways * ways, 1
    else:
        count = min(config.eval_batches, len(source) // batch_size)
    batches = data.Batches(source, batch_size, seed=0, name="held-out split", shuffle=False, rows=trainer.local_rows)
    totals: dict[str, float] = {}
    for _ in range(count):
        for k, v in jax.device_get(trainer.evaluate(state, next(batches))).items():
            totals[k] = totals.get(k, 0.0) + float(v) / count
    if config.model == "transformer" and "loss" in totals:
        totals["perplexity"] = math.exp(totals["loss"])
    return totals
