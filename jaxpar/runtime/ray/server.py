"""The parameter server: one Ray actor (`ParameterServer`) holding the global parameters and the server's optimizer.

The emulation's semantics (`jaxpar.strategies.simulation`), in real time: workers deliver into a pending set; the
server applies the set as one update unless that would push some in-flight gradient's staleness over the bound S
(0 = BSP, every worker every update; inf = ASP, each arrival at once). A version is the number of updates applied.
A delivering worker waits (its `push` does not return) until its delivery is applied, then starts again on the new
version: a worker S versions ahead of the slowest blocks. Every worker counts as computing on the first version
from the start, so a worker whose process is still starting bounds the others as a slow one does. Pushes carry (worker, seq): a seq the server has already
taken is ignored (counted in `duplicates`), and a worker that rejoins continues at the seq after its last delivery.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import jax
import numpy as np
import optax

from jaxpar.runtime.ray.compute import build_trainer, leaves_of
from jaxpar.runtime.ray.schedule import Delivery


class ParameterServer:
    """A Ray actor (async): `join`, `push`, `drop`, `progress`, `result`."""

    def __init__(self, spec, run_dir: str | None = None, checkpoint=None):
        self.spec, self.run_dir, self.checkpoint = spec, run_dir, checkpoint
        tx = spec.optimizer if spec.period == 1 else (spec.outer or optax.sgd(1.0))
        trainer = build_trainer(spec, "data=1", tx)
        state = trainer.init(spec.seed)
        self.params, self.opt_state = state.params, state.opt_state
        self._treedef = jax.tree.structure(self.params)
        self._update = jax.jit(lambda p, o, g: _apply(tx, p, o, g))
        self.version, self.started = 0, time.time()
        self.alive, self.computing, self.read_of = set(), set(), {}
        self.delivered: dict[int, int] = {}  # worker -> its last seq taken
        self.pending: list[tuple[Delivery, list, float, asyncio.Future]] = []
        self.schedule: list[list[Delivery]] = []
        self.records: list[dict] = []
        self.duplicates, self.stop = 0, spec.steps <= 0
        self.resumed_at = 0
        if checkpoint is not None:
            restored = checkpoint.restore(self)
            if restored is not None:
                self._restore(restored)
                self.resumed_at = self.version
        # every worker starts computing on this version: an update waits for one that has not joined yet as for one
        # that is slow (SSP(0) applies no update without every worker; a worker that dies before joining is dropped)
        self.computing = set(range(spec.num_workers))
        self.read_of = {w: self.version for w in self.computing}
        self._leaves = leaves_of(self.params)
        self._file = open(os.path.join(run_dir, "server.jsonl"), "a") if run_dir else None
        if run_dir:  # for an operator (and the tests): which process holds the parameters
            with open(os.path.join(run_dir, "server.pid"), "w") as handle:
                handle.write(str(os.getpid()))

    def _restore(self, saved: dict) -> None:
        self.params = jax.tree.unflatten(self._treedef, saved["params"])
        self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state), saved["opt_state"])
        self.version = int(saved["version"])
        self.delivered = {w: int(seq) for w, seq in enumerate(saved["delivered"]) if seq >= 0}
        self.stop = self.version >= self.spec.steps

    # --- what workers call ---------------------------------------------------------------------------------------
    async def join(self, worker: int):
        """(version, parameter leaves, the seq to continue at, stop) for a worker that starts or rejoins."""
        if not self.alive and not self.schedule:
            self.started = time.time()  # the clock starts when the first (compiled) worker joins
        self.alive.add(worker)
        self.computing.add(worker)
        self.read_of[worker] = self.version
        return self.version, self._leaves, self.delivered.get(worker, -1) + 1, self.stop

    async def push(self, worker: int, seq: int, read: int, leaves: list, loss: float):
        """Delivers (worker, seq)'s gradient computed on version `read`; returns, once it is applied, (version,
        parameter leaves, its staleness, stop). A seq already taken returns at once with staleness -1."""
        if self.stop or seq <= self.delivered.get(worker, -1):
            self.duplicates += 0 if self.stop else 1
            return self.version, self._leaves, -1, self.stop
        self.delivered[worker] = seq
        self.computing.discard(worker)
        done = asyncio.get_running_loop().create_future()
        self.pending.append((Delivery(worker, seq, read), leaves, loss, done))
        self._maybe_apply()
        return await done

    async def drop(self, worker: int) -> None:
        """A worker whose process died leaves the staleness bound; what it delivered stays."""
        self.alive.discard(worker)
        self.computing.discard(worker)
        self._maybe_apply()

    async def pid(self) -> int:
        return os.getpid()

    async def progress(self) -> dict:
        recent = self.records[-20:]
        return {"version": self.version, "wall": time.time() - self.started, "alive": sorted(self.alive),
                "staleness_mean": float(np.mean([r["staleness_mean"] for r in recent])) if recent else 0.0,
                "staleness_max": max((r["staleness_max"] for r in recent), default=0),
                "loss": recent[-1]["loss"] if recent else math.nan, "stopped": self.stop}

    async def result(self) -> dict:
        """The final parameters (a nested dict of numpy arrays), the schedule and the server's records."""
        from flax import nnx

        if self._file is not None:
            self._file.flush()
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(jax.device_get(self.params)))
        return {"params": params, "leaves": self._leaves, "version": self.version, "duplicates": self.duplicates,
                "schedule": [[tuple(d) for d in update] for update in self.schedule], "records": self.records,
                "delivered": dict(self.delivered), "resumed_at": self.resumed_at}

    # --- the update ----------------------------------------------------------------------------------------------
    def _maybe_apply(self) -> None:
        if not self.pending or self.stop:
            return
        reads = [self.read_of[w] for w in self.computing]
        if reads and self.version + 1 - min(reads) > self.spec.bound:
            return  # the slowest in-flight gradient would go over the bound: wait for it
        self._apply_pending()

    def _apply_pending(self) -> None:
        pending, self.pending = self.pending, []
        count = len(pending) if self.spec.period == 1 else self.spec.num_workers  # a change counts 1/R
        total = [sum(p[1][i] for p in pending) for i in range(len(self._leaves))]
        grads = jax.tree.unflatten(self._treedef, [np.asarray(t / count, dtype=t.dtype) for t in total])
        losses = [p[2] for p in pending]
        ok = not self.spec.skip_nonfinite or (all(map(math.isfinite, losses))
                                              and all(np.isfinite(t).all() for t in total))
        if ok:
            self.params, self.opt_state = self._update(self.params, self.opt_state, grads)
        deliveries = [p[0] for p in pending]
        stale = [self.version - d.read for d in deliveries]
        self.version += 1
        self._leaves = leaves_of(self.params)
        self.schedule.append(deliveries)
        self._record({"version": self.version, "wall": time.time() - self.started, "loss": float(np.mean(losses)),
                      "staleness_mean": float(np.mean(stale)), "staleness_max": int(max(stale)),
                      "contributors": len(pending), "skipped": float(not ok),
                      "deliveries": [list(d) for d in deliveries]})
        self.stop = self.version >= self.spec.steps
        if self.checkpoint is not None and self.checkpoint.due(self.version, self.stop):
            self.checkpoint.save(self)
        for (delivery, _, _, done), staleness in zip(pending, stale):
            if delivery.worker in self.alive and not self.stop:
                self.computing.add(delivery.worker)
                self.read_of[delivery.worker] = self.version
            if not done.done():
                done.set_result((self.version, self._leaves, staleness, self.stop))

    def _record(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")


def _apply(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
