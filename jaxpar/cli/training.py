"""`train(config)`: the run behind `python run.py`: check and build everything, then open the outputs, start or resume
the train state, wire `fit` with its actions, and summarise."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import jax
import numpy as np

import models
from jaxpar.cli.build import Built, build
from jaxpar.cli.config import Config
from jaxpar.cli.evaluation import evaluate
from jaxpar.cli.explaining import explain_run
from jaxpar.cli.notes import built_notes, divergence_hint, planning_notes, run_notes
from jaxpar.strategies import BN_LOCAL, BN_SYNC
from jaxpar.cli.paths import profile_folder
from jaxpar.cli.processes import join_processes
from jaxpar.cli.runtimes import RAY
from jaxpar.cli.strategies import notes as strategy_notes
from jaxpar.cli.values import parse_profile
from jaxpar.cost.step_pricer import profile_of
from jaxpar.errors import CheckpointError, JaxparError, Preempted, Terminated, cli_message
from jaxpar.io import data
from jaxpar.io.metrics import EVAL_PREFIX, JsonlFile, RunLogger, records_before
from jaxpar.io.tensorboard import TensorBoardFile
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.runtime import distributed
from jaxpar.runtime.compile_cache import ensure_compile_cache, use_compile_cache
from jaxpar.runtime.preemption import StopRequest
from jaxpar.train import actions
from jaxpar.train.trainer import Trainer

log = logging.getLogger("jaxpar")


def train(config: Config) -> dict:
    """Trains `config.model` and returns a summary (final training metrics, held-out metrics, throughput).

    Every check (flags, files, batch sizes, data, the model on the mesh) passes before anything is written: a bad
    input fails with one line and leaves no metrics file, event file or checkpoint folder. `--explain` writes
    nothing. With several processes (see `join_processes`) every process calls this; only process 0 prints and
    writes, and every process returns the same summary."""
    config = config.validate().resolved()
    if config.runtime == RAY:  # each data-axis index a process: nothing below (one SPMD program) applies
        from jaxpar.cli.ray_run import train_on_ray

        return train_on_ray(config)
    if config.no_compile_cache:  # before anything compiles (the Trainer would turn the default on)
        use_compile_cache(None)
    else:
        ensure_compile_cache()
    if config.plan:  # before anything starts JAX: --devices decides how many CPU devices it creates
        from jaxpar.cli.planning import plan_run

        for line in planning_notes(config):
            log.warning(line)
        return plan_run(config)
    if join_processes(config) and not distributed.is_main():
        log.setLevel(logging.ERROR)  # process 0 reports the notes
    for line in run_notes(config):
        log.warning(line)
    built = build(config)
    for line in built_notes(config, built.trainer):
        log.warning(line)
    if config.explain:
        return explain_run(config, built)
    checkpoints, created = _open_checkpoints(config)
    # SIGTERM / Ctrl-C from here to the end of the last save: save a checkpoint and stop (see jaxpar.runtime.preemption)
    # (several processes: always, since SIGTERM belongs to JAX's preemption notifier there and must stop every process
    # after the same step, with or without a checkpoint)
    agreed = checkpoints is not None or jax.process_count() > 1
    with StopRequest() if agreed else contextlib.nullcontext() as stop:
        try:
            summary = _run(config, built, checkpoints, stop)
        except BaseException:
            if checkpoints is not None:
                checkpoints.close(quiet=True)  # durable if it can be; the error on its way out is the one to report
                if created and distributed.is_main() and not os.listdir(checkpoints.directory):
                    os.rmdir(checkpoints.directory)  # a run that saved nothing leaves no folder behind
            raise
        if checkpoints is not None:
            checkpoints.close()  # every save started is durable before the run reports success
        return summary


def _open_checkpoints(config: Config):
    """(Checkpointer or None, whether its folder was created now)."""
    if not config.checkpoint_dir:
        return None, False
    from jaxpar.io.checkpoint import Checkpointer  # orbax is imported only by runs that checkpoint

    created = not os.path.exists(config.checkpoint_dir)
    checkpoints = Checkpointer(config.checkpoint_dir, config.keep)
    existing = checkpoints.steps()
    if existing and not config.resume:
        checkpoints.close(quiet=True)
        raise CheckpointError(checkpoints.directory, f"already holds checkpoints of another run (steps "
                                                     f"{', '.join(map(str, existing))}); pass {{resume}} to "
                                                     f"continue it, or use an empty folder")
    return checkpoints, created


@contextlib.contextmanager
def _outputs(config: Config):
    """(JSONL metrics file or None, TensorBoard file or None) of process 0, opened once every check has passed.

    The metrics file is probed (a byte written and fsync'd) and renamed onto --metrics only once training has
    started (see jaxpar.io.metrics); it is discarded if the run fails before."""
    main = distributed.is_main()
    jsonl = JsonlFile(config.metrics) if config.metrics and main else None
    try:
        board = TensorBoardFile(config.tensorboard) if config.tensorboard and main else None
        try:
            yield jsonl, board
        finally:
            if board is not None:
                board.close()  # (the logger closes it first when training started)
    finally:
        if jsonl is not None:
            jsonl.discard()  # a no-op once committed


def _start(config: Config, trainer: Trainer, checkpoints, train_batches):
    """(train state, its step, checkpoint metadata): resumed from a checkpoint, or fresh."""
    state, start, meta = None, 0, {}
    if config.resume:
        from jaxpar.cli.resume import resume_run

        state, start, meta = resume_run(checkpoints, trainer, config, train_batches)
    if state is None:
        state = trainer.init(config.seed)
    return state, start, meta


def _headline(config: Config, trainer: Trainer, state, start: int, size_at) -> str:
    """The run's first line: model, parameters, mesh, batch, strategy, steps."""
    strategy, mesh, replicas = trainer.strategy, trainer.mesh, trainer.num_replicas
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    bn = ""
    if config.bn is not None:  # a model with BatchNorm; say why it is local when the strategy decides it
        why = " (each replica computes on its own slice under this strategy)" if strategy.local_statistics else ""
        local_bn = config.bn == BN_LOCAL or strategy.local_statistics
        bn = f"; BatchNorm {BN_LOCAL if local_bn else BN_SYNC}{why}"
    per_replica = f"{size_at(0) // replicas} per replica" + (" at first" if config.batch_ramp else "")
    count = jax.process_count()
    processes = f" in {count} processes, {len(mesh.local_devices)} each" if count > 1 else ""
    return (f"jaxpar: {config.model} ({n_params:,} parameters, {config.dtype}) on mesh {mesh_lib.shape_line(mesh)} "
            f"({mesh.size} {mesh.devices.flat[0].platform} devices{processes}); global batch "
            f"{config.batch_ramp or config.batch_size} ({per_replica}); strategy {config.strategy}{bn}; "
            f"{config.steps} steps" + (f", resumed at step {start}" if start else ""))


def _peak_flops(trainer: Trainer, say) -> float | None:
    """The peak FLOP/s flops_utilization is measured against (said as such), or None."""
    mesh, profile = trainer.mesh, profile_of(trainer)
    if profile is not None:
        say(f"jaxpar: sim_time is priced on {profile.describe()}: a projection from each compiled step's "
            f"FLOPs and collectives, not this machine's time; flops_utilization is against that profile's peak")
        return profile.flops * mesh.size
    if mesh.devices.flat[0].platform == "cpu":  # the utilisation's denominator: a measured peak, said as such
        from jaxpar.runtime.resources import measured_matmul_peak

        peak = measured_matmul_peak()
        say(f"jaxpar: flops_utilization in the metrics is the step's FLOPs (XLA cost analysis) per second against "
            f"a measured float32 matmul peak of this CPU, {peak / 1e9:.1f} GFLOP/s (all devices share its cores)")
        return peak
    return None


def _run(config: Config, built: Built, checkpoints, stop) -> dict:
    trainer, size_at, schedule = built.trainer, built.size_at, built.schedule
    state, start, meta = _start(config, trainer, checkpoints, built.train_batches)
    replica_check = actions.CheckReplicas(config.check_every)
    if config.check_every:
        replica_check.check(trainer, state, start)

    def say(line: str) -> None:  # process 0 reports
        if distributed.is_main():
            print(line, flush=True)

    say(_headline(config, trainer, state, start, size_at))
    for line in strategy_notes(trainer.strategy):
        say(f"jaxpar: note: {line}")
    peak = _peak_flops(trainer, say)
    with _outputs(config) as (jsonl, board):
        return _fit(config, built, state, start, meta, checkpoints, stop, replica_check, say, peak, jsonl, board)


def _fit(config, built, state, start, meta, checkpoints, stop, replica_check, say, peak, jsonl, board) -> dict:
    """`trainer.fit` with the run's actions (guard, log, evaluation, replica checks, checkpoints); the summary."""
    trainer, size_at, schedule = built.trainer, built.size_at, built.schedule
    text = models.spec(config.model).dataset == models.registry.TEXT
    # without a straggler profile sim_time is just the step count: kept in the JSONL, not printed
    logger = RunLogger(config.steps, size_at, config.log_every, jsonl,
                       stream=None if distributed.is_main() else open(os.devnull, "w"),
                       quiet=("skipped",) if config.stragglers or config.hardware else ("sim_time", "skipped"),
                       start_step=start, tokens_per_example=config.seq_len if text else None,
                       tensorboard=board, peak_flops=peak)

    class Extras(actions.Action):  # lr and batch size of the step, for the steps the log records
        def due(self, step, last):
            return step == start + 1 or step % config.log_every == 0 or last

        def __call__(self, event):
            # a strategy that applies part of the batch: the contributing replicas' examples
            batch = event.metrics.get("examples", size_at(event.step - 1))
            # the lr is evaluated on the host for logged steps only (no per-step table: --steps may be huge)
            event.metrics.update(lr=float(schedule(event.step - 1)), batch_size=float(batch))

    def on_eval(step, results):
        logger.write({"step": step, **{EVAL_PREFIX + k: v for k, v in results.items()}})
        say(f"held-out at step {step}: " + "  ".join(f"{k} {v:.4g}" for k, v in results.items()))

    evaluation = actions.Evaluate(lambda tr, st: evaluate(tr, st, built.held_out, built.largest, config),
                                  every=config.eval_every, on_result=on_eval, at_end=bool(config.eval_batches))
    last = {}
    skips = config.max_skips if config.on_nonfinite == "skip" else None
    guard = actions.StopIfDiverged(divergence_hint(config, size_at), max_skips=skips, max_skips_name="--max-skips")
    guard.set_state(meta.get("guard", {}))  # skip counts and the first loss continue across a resume
    loop = [guard, Extras(), actions.OnStep(lambda step, metrics: last.update(metrics)), actions.Log(logger)]
    if config.check_every:
        loop.append(replica_check)
    if config.eval_batches:
        loop.append(evaluation)
    batches = data.prefetch_to_device(built.train_batches, trainer.shard_batch)
    record = config.to_record()
    if config.profile and distributed.is_main():  # (process 0 traces, as it logs)
        first, until = parse_profile(config.profile)
        loop.append(actions.Trace(first, until, profile_folder(config)))
        say(f"jaxpar: tracing steps {first} to {until} with jax.profiler into "
            f"{os.path.join(profile_folder(config), 'plugins', 'profile')}")
    if checkpoints is not None:
        saving = actions.Checkpoint(checkpoints, config.checkpoint_every,
                                    extra=lambda: {"batches": batches.get_state(), "config": record,
                                                   "guard": guard.get_state()})
        loop += [saving, actions.StopWhen(stop.at, saving)]
    elif stop is not None:  # several processes without checkpoints: a SIGTERM ends every process after one step
        loop.append(actions.StopWhen(stop.at, None))
    if start and jsonl is not None:  # one continuous file: the earlier run's records up to the resumed step
        for earlier in records_before(config.metrics, start):
            logger.write(earlier)
    logger.write({**record, **({"resumed_from": start} if start else {})})
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
    finally:
        batches.close()  # the read-ahead thread ends with the run, however it ended
    logger.close()
    held = evaluation.history[-1][1] if evaluation.history else {}
    summary = {"final_" + k: v for k, v in last.items()}
    summary.update(steps=config.steps - start, seconds=seconds, steps_per_sec=(config.steps - start) / seconds)
    summary.update({EVAL_PREFIX + k: v for k, v in held.items()})
    return summary
