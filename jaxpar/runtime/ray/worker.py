"""A replica group as a process: the Ray actor `ReplicaWorker` (one per index of the data axis).

Its loop: join the server (the current version and parameters, and the batch number to continue at), then compute
(a gradient, or H local steps and their change), sleep the straggler profile's extra time, push, and continue from
the parameters the push returns, until the server says stop. With server shards, each push goes as one part per
shard straight to the shard actors, and the parameters come back from them. Each push appends one JSONL record to
`worker-<i>.jsonl` in the run folder: wall time, version read, staleness at apply, compute, sleep and wait seconds.
A failure inside the worker (the user's model or loss) comes back as one line, not a Ray traceback.
"""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np

from jaxpar.errors import JaxparError


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(error, JaxparError) else f"{type(error).__name__}: {first}".rstrip(": ")


def _whole(ray, leaves, split):
    """The parameter leaves from the server's answer: as they are, or from one reference per shard."""
    if split is None or leaves is None:  # None: the run stopped (a shard died)
        return leaves
    out = [None] * sum(len(part) for part in split)
    for part, values in zip(split, ray.get(leaves)):
        for i, x in zip(part, values):
            out[i] = x
    return out


class ReplicaWorker:
    """A Ray actor: `run` trains until the server stops it; `pid` for an operator (or a test) to find it."""

    def __init__(self, spec, worker: int, server, run_dir: str | None = None):
        self.spec, self.worker, self.server, self.run_dir = spec, worker, server, run_dir
        self.compute = None

    def pid(self) -> int:
        return os.getpid()

    def prepare(self) -> dict:
        """Builds the worker's Trainer and compiles its step on batch 0 (so that the run's clock starts with every
        worker ready): {} or {"error": one line}."""
        return self._guarded(self._prepare)

    def run(self) -> dict:
        return self._guarded(self._run)

    def _guarded(self, fn) -> dict:
        import ray

        try:
            return fn()
        except ray.exceptions.RayActorError:  # the server died: the driver says so
            return {"worker": self.worker, "server_died": True}
        except Exception as error:  # noqa: BLE001  (one line back to the driver, whatever the user's code raised)
            return {"worker": self.worker, "error": one_line(error)}

    def _prepare(self) -> dict:
        from jaxpar.runtime.ray.compute import WorkerCompute, leaves_of

        spec = self.spec
        if self.compute is None:
            self.compute = WorkerCompute(spec, self.worker)
            leaves = leaves_of(self.compute.state.params)
            if spec.period == 1:
                self.compute.gradient(leaves, spec.batches(self.worker, spec.num_workers, 0), 0)
            else:  # one local step compiles them all (the state it leaves is thrown away: a fresh one)
                self.compute.local_steps(leaves, [spec.batches(self.worker, spec.num_workers, 0)])
                self.compute.state = self.compute.trainer.init(spec.seed)
        return {}

    def _run(self) -> dict:
        import ray

        spec, worker = self.spec, self.worker
        self._prepare()
        shards = ray.get(self.server.shards.remote())
        split = None
        if shards:
            from jaxpar.runtime.ray.compute import leaves_of
            from jaxpar.runtime.ray.shards import leaf_bytes, split_by_bytes

            split = split_by_bytes(leaf_bytes(leaves_of(self.compute.state.params)), len(shards))
        version, leaves, seq, stop = ray.get(self.server.join.remote(worker))
        leaves = _whole(ray, leaves, split)
        factor = float(spec.stragglers.factors(spec.num_workers)[worker])
        rng = np.random.default_rng([spec.stragglers.seed, worker, seq])
        log = open(os.path.join(self.run_dir, f"worker-{worker}.jsonl"), "a") if self.run_dir else None
        pushes = 0
        while not stop:
            started = time.time()
            if spec.period == 1:
                loss, out = self.compute.gradient(leaves, spec.batches(worker, spec.num_workers, seq), seq)
            else:
                batches = [spec.batches(worker, spec.num_workers, seq * spec.period + j) for j in range(spec.period)]
                loss, out = self.compute.local_steps(leaves, batches)
            compute = time.time() - started
            slow = factor * math.exp(spec.stragglers.jitter * rng.standard_normal()) if spec.stragglers.jitter \
                else factor
            sleep = max(0.0, (slow - 1.0) * compute)
            time.sleep(sleep)
            pushed = time.time()
            if split is None:
                sent, finite = out, True  # the server checks the sum itself
            else:  # each shard its part; the server hears (worker, seq)
                key = (worker, seq, os.getpid(), pushes)  # this attempt's own: a repeated push never meets it
                sent = (key, [shard.stage.remote(key, [out[i] for i in part]) for shard, part in zip(shards, split)])
                finite = bool(all(np.isfinite(x).all() for x in out))
            new_version, leaves, staleness, stop = ray.get(self.server.push.remote(worker, seq, version, sent, loss,
                                                                                   finite))
            leaves = _whole(ray, leaves, split)
            wait = time.time() - pushed
            if log is not None:
                log.write(json.dumps({"worker": worker, "seq": seq, "wall": pushed, "version_read": version,
                                      "staleness": staleness, "applied_as": new_version, "loss": loss,
                                      "compute_s": compute, "sleep_s": sleep, "wait_s": wait}) + "\n")
                log.flush()
            version, seq, pushes = new_version, seq + 1, pushes + 1
        if log is not None:
            log.close()
        return {"worker": worker, "pushes": pushes}
