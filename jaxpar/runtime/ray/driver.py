"""`run`: the library's entry to the Ray runtime. Starts the server and one worker per index of the data axis,
watches them (a dead worker leaves the staleness bound and Ray restarts it up to `max_restarts` times; a dead
server ends the run with one line), reports progress, and returns the result."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable, NamedTuple

from jaxpar.errors import JaxparError
from jaxpar.runtime.ray import connect
from jaxpar.runtime.ray.checkpoint import ServerCheckpoint
from jaxpar.runtime.ray.schedule import Delivery
from jaxpar.runtime.ray.server import ParameterServer
from jaxpar.runtime.ray.spec import make_spec
from jaxpar.runtime.ray.worker import ReplicaWorker


class RayRun(NamedTuple):
    params: dict  # the server's final parameters: a nested dict of numpy arrays
    version: int  # updates applied
    schedule: list  # per update: the Deliveries (worker, seq, version read) it applied
    records: list  # the server's record of each update (version, wall, loss, staleness mean / max, contributors)
    seconds: float  # wall time from the first update to the last
    duplicates: int  # pushes the server refused as already taken
    restarts: dict  # worker -> times it was restarted
    run_dir: str  # server.jsonl and worker-<i>.jsonl
    resumed_at: int  # the version a resumed run started at (0: fresh)


def run(model: Callable, loss_fn: Callable, optimizer, mesh, strategy, batches: Callable, steps: int, *,
        seed: int = 0, grad_accum: int = 1, skip_nonfinite: bool = True, rules=None, ray_address: str | None = None,
        num_cpus: int | None = None, max_restarts: int = 0, run_dir: str | None = None,
        checkpoint_dir: str | None = None, checkpoint_every: int = 100, resume: bool = False,
        on_progress: Callable[[dict], Any] | None = None, progress_every: float = 1.0,
        asynchronous_local: bool = True, server_shards: int = 1) -> RayRun:
    """Trains on Ray: each index of `mesh`'s data axis is a worker process with its own Trainer on the other axes,
    and a parameter server applies their gradients by `strategy`'s rule (Sync: BSP; SSP(S); ASP; LocalSGD /
    DiLoCo: a change every H local steps, merged when it arrives). `batches(worker, num_workers, seq)` -> that
    worker's batch number `seq`; `steps` = server updates. Raises JaxparError for a bad argument, a worker whose
    model fails (its error as one line), or a server that dies. `checkpoint_dir`: the server's state saved with
    orbax every `checkpoint_every` versions; `resume` continues from the latest there. `asynchronous_local` False:
    local SGD / DiLoCo's changes meet as in the emulation (every worker in every update). `server_shards` > 1:
    the server's parameters and optimizer split over that many actors by bytes (`jaxpar.runtime.ray.shards`)."""
    spec = make_spec(model, loss_fn, optimizer, mesh, strategy, batches, steps, seed=seed, grad_accum=grad_accum,
                     skip_nonfinite=skip_nonfinite, rules=rules, asynchronous_local=asynchronous_local,
                     server_shards=server_shards)
    checkpoint = None
    if checkpoint_dir:
        checkpoint = ServerCheckpoint(checkpoint_dir, checkpoint_every, resume)
        checkpoint.check()
    created = run_dir is None or not os.path.exists(run_dir)
    run_dir = run_dir or tempfile.mkdtemp(prefix="jaxpar-ray-")
    os.makedirs(run_dir, exist_ok=True)
    try:
        out, restarts = _run(spec, run_dir, checkpoint, ray_address, num_cpus, max_restarts, on_progress,
                             progress_every)
    except BaseException as error:
        if created and not getattr(error, "trained", False):  # a run refused before training leaves nothing
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    records = out["records"]
    seconds = records[-1]["wall"] - records[0]["wall"] if len(records) > 1 else 0.0
    schedule = [[Delivery(*d) for d in update] for update in out["schedule"]]
    return RayRun(out["params"], out["version"], schedule, records, seconds, out["duplicates"], restarts, run_dir,
                  out["resumed_at"])


def _run(spec, run_dir, checkpoint, ray_address, num_cpus, max_restarts, on_progress, progress_every):
    """(the server's result, restarts per worker); an error raised once training started has `trained` set."""
    started = connect.start(ray_address, num_cpus)
    import ray

    actors = []
    try:
        server = ray.remote(ParameterServer).options(num_cpus=0, runtime_env=connect.actor_env(1)).remote(
            spec, run_dir, checkpoint)
        actors.append(server)
        options = dict(num_cpus=0, max_restarts=max_restarts, max_task_retries=0, scheduling_strategy="SPREAD",
                       runtime_env=connect.actor_env(spec.devices_per_worker))
        workers = [ray.remote(ReplicaWorker).options(**options).remote(spec, w, server, run_dir)
                   for w in range(spec.num_workers)]
        actors += workers
        _prepare(ray, workers)  # first: a model that fails is said as the worker's error, not the server's death
        problem = _call(ray, server.ready.remote(), "start")  # shards, a checkpoint to resume
        if problem is not None:
            raise problem
        try:
            restarts = _watch(ray, server, workers, max_restarts, on_progress, progress_every)
            out = _call(ray, server.result.remote(), "result")
            if "problem" in out:  # a shard failed after the last look at the progress
                raise JaxparError(out["problem"])
            return out, restarts
        except BaseException as error:
            error.trained = True  # its records stay
            raise
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if started:
            ray.shutdown()


def _call(ray, ref, what: str):
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        raise JaxparError(f"the parameter server died (noticed at: {what}); the run stops here; with a "
                          f"checkpoint_dir, resume continues at its last saved version") from None


def _prepare(ray, workers) -> None:
    """Every worker builds its Trainer and compiles before the first one joins; a failure is one line."""
    refs = [w.prepare.remote() for w in workers]
    for worker, ref in enumerate(refs):
        try:
            out = ray.get(ref)
        except ray.exceptions.RayActorError as error:  # e.g. out of memory, or an import that fails
            line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise JaxparError(f"worker {worker}: its process died while building its Trainer ({line})") from None
        if "error" in out:
            raise JaxparError(f"worker {worker}: {out['error']}")


def _watch(ray, server, workers, max_restarts: int, on_progress, every: float) -> dict:
    """Waits for every worker's `run`; a dead one is dropped from the bound and, while restarts remain, run again."""
    running = {workers[w].run.remote(): w for w in range(len(workers))}
    restarts = {w: 0 for w in range(len(workers))}
    last = time.time()
    while running:
        ready, _ = ray.wait(list(running), num_returns=1, timeout=every)
        for ref in ready:
            worker = running.pop(ref)
            try:
                out = ray.get(ref)
            except ray.exceptions.RayActorError:
                _call(ray, server.drop.remote(worker), "a worker died")
                if restarts[worker] < max_restarts:
                    restarts[worker] += 1
                    running[workers[worker].run.remote()] = worker
                elif not running and not _call(ray, server.progress.remote(), "progress")["stopped"]:
                    raise JaxparError(f"every worker has died (worker {worker} last, after {restarts[worker]} "
                                      f"restarts); raise max_restarts to let Ray restart them") from None
                continue
            if "server_died" in out:
                _call(ray, server.progress.remote(), "seen by a worker")
            if "error" in out:
                raise JaxparError(f"worker {worker}: {out['error']}")
        if time.time() - last >= every:  # asked even without a reader: a dead server is noticed here
            last = time.time()
            progress = _call(ray, server.progress.remote(), "progress")
            if progress.get("problem"):
                raise JaxparError(progress["problem"])
            if on_progress is not None:
                on_progress(progress)
    return restarts
