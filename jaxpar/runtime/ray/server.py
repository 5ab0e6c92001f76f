"""The parameter server: one Ray actor (`ParameterServer`) holding the global parameters and the server's optimizer.

The emulation's semantics (`jaxpar.strategies.simulation`), in real time: workers deliver into a pending set; the
server applies the set as one update unless that would push some in-flight gradient's staleness over the bound S
(0 = BSP, every worker every update; inf = ASP, each arrival at once). A version is the number of updates applied.
A delivering worker waits (its `push` does not return) until its delivery is applied, then starts again on the new
version: a worker S versions ahead of the slowest blocks. Every worker counts as computing on the first version
from the start, so a worker whose process is still starting bounds the others as a slow one does. Pushes carry
(worker, seq): a seq the server has already taken is ignored (counted in `duplicates`), and a worker that rejoins
continues at the seq after its last delivery. With server shards (`jaxpar.runtime.ray.shards`) this actor keeps
the versions and the bookkeeping, and the shards hold and update the parameters.
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

from jaxpar.errors import JaxparError
from jaxpar.runtime.ray.compute import build_trainer, leaves_of
from jaxpar.runtime.ray.schedule import Delivery
from jaxpar.runtime.ray.shards import ShardedParams, apply_update
from jaxpar.runtime.ray.worker import one_line


class ParameterServer:
    """A Ray actor (async): `ready`, `join`, `push`, `drop`, `progress`, `result`. With `spec.server_shards` > 1
    the parameters and the optimizer live in `ParameterServerShard` actors (`jaxpar.runtime.ray.shards`) and pushes
    and pulls carry one object reference per shard."""

    def __init__(self, spec, run_dir: str | None = None, checkpoint=None):
        self.spec, self.run_dir, self.checkpoint = spec, run_dir, checkpoint
        self.tx = tx = spec.optimizer if spec.period == 1 else (spec.outer or optax.sgd(1.0))
        trainer = build_trainer(spec, "data=1", tx)
        state = trainer.init(spec.seed)
        self.params, self.opt_state = state.params, state.opt_state
        self._treedef = jax.tree.structure(self.params)
        self._update = jax.jit(lambda p, o, g: apply_update(tx, p, o, g))
        self.version, self.started = 0, time.time()
        self.alive, self.computing, self.read_of = set(), set(), {}
        self.delivered: dict[int, int] = {}  # worker -> its last seq taken
        self.pending: list[tuple] = []  # (Delivery, leaves or per-shard references, loss, future, finite)
        self.schedule: list[list[Delivery]] = []
        self.records: list[dict] = []
        self.duplicates, self.stop = 0, spec.steps <= 0
        self.resumed_at = 0
        self.sharded, self.problem = None, None
        self._leaves = leaves_of(self.params)
        self._file = open(os.path.join(run_dir, "server.jsonl"), "a") if run_dir else None
        if run_dir:  # for an operator (and the tests): which process holds the parameters
            with open(os.path.join(run_dir, "server.pid"), "w") as handle:
                handle.write(str(os.getpid()))

    async def ready(self) -> JaxparError | None:
        """Starts the shards and restores a checkpoint: None, or the error that stops the run (the driver's call
        after the workers are built)."""
        try:
            if self.spec.server_shards > 1:
                from jaxpar.runtime.ray.connect import actor_env

                self.sharded = ShardedParams(self.tx, self._leaves, self.spec.server_shards, actor_env(1))
                await self.sharded.start()
            if self.checkpoint is not None:
                restored = self.checkpoint.restore(await self._tree())
                if restored is not None:
                    await self._restore(restored)
                    self.resumed_at = self.version
        except JaxparError as error:  # handed to the driver as it is (a CheckpointError names the flag)
            self.problem = str(error)
            return error
        except Exception as error:  # noqa: BLE001 - a shard actor that could not start
            self.problem = f"a parameter server shard could not start ({one_line(error)})"
            return JaxparError(self.problem)
        # every worker starts computing on this version: an update waits for one that has not joined yet as for one
        # that is slow (SSP(0) applies no update without every worker; a worker that dies before joining is dropped)
        self.computing = set(range(self.spec.num_workers))
        self.read_of = {w: self.version for w in self.computing}
        return None

    async def _tree(self) -> dict:
        """The checkpoint's tree of the current state."""
        if self.sharded is None:
            params, opt = self._leaves, leaves_of(self.opt_state)
        else:
            params, opt = await self.sharded.state(len(self._leaves))
        return self.checkpoint.tree(params, opt, self.version, self.delivered, self.spec.num_workers,
                                    self.spec.server_shards)

    async def _restore(self, saved: dict) -> None:
        if self.sharded is None:
            self.params = jax.tree.unflatten(self._treedef, saved["params"])
            self.opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_state), saved["opt_state"])
            self._leaves = leaves_of(self.params)
        else:
            await self.sharded.restore(list(saved["params"]), list(saved["opt_state"]))
        self.version = int(saved["version"])
        self.delivered = {w: int(seq) for w, seq in enumerate(saved["delivered"]) if seq >= 0}
        self.stop = self.version >= self.spec.steps

    async def _current(self) -> list:
        """The applied version's leaves (with shards: one reference per shard, every scheduled update applied)."""
        if self.sharded is None:
            return self._leaves
        while self.sharded.busy():
            await self.sharded.settled()
        return list(self.sharded.refs)

    # --- what workers call ---------------------------------------------------------------------------------------
    async def join(self, worker: int):
        """(version, parameter leaves, the seq to continue at, stop) for a worker that starts or rejoins."""
        leaves = await self._current()
        if not self.alive and not self.schedule:
            self.started = time.time()  # the clock starts when the first (compiled) worker joins
        self.alive.add(worker)
        self.computing.add(worker)
        self.read_of[worker] = self.version
        return self.version, leaves, self.delivered.get(worker, -1) + 1, self.stop

    async def push(self, worker: int, seq: int, read: int, leaves: list, loss: float, finite: bool = True):
        """Delivers (worker, seq)'s gradient computed on version `read` (its leaves; with shards, its stage key and
        the references of its parts' `stage` calls, one per shard; `finite`: whether every entry is); returns, once
        it is applied, (version, parameter leaves or references, its staleness, stop). A seq already taken returns
        at once with staleness -1."""
        if self.sharded is not None:  # `leaves`: (the push's stage key, its `stage` calls, one per shard)
            try:
                await asyncio.gather(*leaves[1])
            except Exception as error:  # noqa: BLE001 - a shard died: the run stops with one line
                self._broken(self.version, error)
                return self.version, None, -1, True
        if self.stop or seq <= self.delivered.get(worker, -1):
            self.duplicates += 0 if self.stop else 1
            if self.sharded is not None:
                await asyncio.gather(*[a.discard.remote(leaves[0]) for a in self.sharded.actors])
            current = await self._current()  # before reading the version: it may advance meanwhile
            return self.version, current, -1, self.stop
        self.delivered[worker] = seq
        self.computing.discard(worker)
        done = asyncio.get_running_loop().create_future()
        self.pending.append((Delivery(worker, seq, read), leaves if self.sharded is None else leaves[0], loss, done,
                             finite))
        self._maybe_apply()
        return await done

    async def drop(self, worker: int) -> None:
        """A worker whose process died leaves the staleness bound; what it delivered stays."""
        self.alive.discard(worker)
        self.computing.discard(worker)
        self._maybe_apply()

    async def pid(self) -> int:
        return os.getpid()

    async def shards(self) -> list | None:
        """The shard actors (None: one server), for the workers' pushes."""
        return None if self.sharded is None else list(self.sharded.actors)

    async def progress(self) -> dict:
        recent = self.records[-20:]
        return {"version": self.version, "wall": time.time() - self.started, "alive": sorted(self.alive),
                "staleness_mean": float(np.mean([r["staleness_mean"] for r in recent])) if recent else 0.0,
                "staleness_max": max((r["staleness_max"] for r in recent), default=0),
                "loss": recent[-1]["loss"] if recent else math.nan, "stopped": self.stop, "problem": self.problem}

    async def result(self) -> dict:
        """The final parameters (a nested dict of numpy arrays), the schedule and the server's records."""
        from flax import nnx

        if self._file is not None:
            self._file.flush()
        if self.problem is not None:
            return {"problem": self.problem}
        leaves = self._leaves
        if self.sharded is not None:
            await self._current()
            leaves = (await self.sharded.state(len(self._leaves)))[0]
        params = jax.tree.map(np.asarray, nnx.to_pure_dict(jax.tree.unflatten(self._treedef, leaves)))
        return {"params": params, "leaves": leaves, "version": self.version, "duplicates": self.duplicates,
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
        """Forms the next version from the pending pushes; applied here (one server) or by every shard in version
        order, after which the pushing workers get the new parameters."""
        began = time.time()
        pending, self.pending = self.pending, []
        count = len(pending) if self.spec.period == 1 else self.spec.num_workers  # a change counts 1/R
        losses = [p[2] for p in pending]
        if self.sharded is None:
            total = [sum(p[1][i] for p in pending) for i in range(len(self._leaves))]
            finite = all(np.isfinite(t).all() for t in total)
        else:  # each push's own check: its entries (a sum of finite pushes that overflows is not caught)
            finite = all(p[4] for p in pending)
        ok = not self.spec.skip_nonfinite or (all(map(math.isfinite, losses)) and finite)
        if ok and self.sharded is None:
            grads = jax.tree.unflatten(self._treedef, [np.asarray(t / count, dtype=t.dtype) for t in total])
            self.params, self.opt_state = self._update(self.params, self.opt_state, grads)
            self._leaves = leaves_of(self.params)
        deliveries = [p[0] for p in pending]
        stale = [self.version - d.read for d in deliveries]
        self.version += 1
        self.schedule.append(deliveries)
        self._record({"version": self.version, "wall": time.time() - self.started, "loss": float(np.mean(losses)),
                      "staleness_mean": float(np.mean(stale)), "staleness_max": int(max(stale)),
                      "contributors": len(pending), "skipped": float(not ok), "apply_s": time.time() - began,
                      "deliveries": [list(d) for d in deliveries]})
        self.stop = self.version >= self.spec.steps
        version, stop = self.version, self.stop
        save = self.checkpoint is not None and self.checkpoint.due(version, stop)
        for (delivery, *_), staleness in zip(pending, stale):
            if delivery.worker in self.alive and not stop:
                self.computing.add(delivery.worker)
                self.read_of[delivery.worker] = version

        def answer(leaves):
            for (_, _, _, done, _), staleness in zip(pending, stale):
                if not done.done():
                    done.set_result((version, leaves, staleness, stop))

        if self.sharded is None:
            if save:
                self.checkpoint.save(self.checkpoint.tree(self._leaves, leaves_of(self.opt_state), version,
                                                          self.delivered, self.spec.num_workers))
            answer(self._leaves)
            return
        delivered = dict(self.delivered)

        async def after():  # every shard has applied this version
            if save:
                params, opt = await self.sharded.state(len(self._leaves))
                self.checkpoint.save(self.checkpoint.tree(params, opt, version, delivered, self.spec.num_workers,
                                                          self.spec.server_shards))
            answer(list(self.sharded.refs))

        def failed(error):
            self._broken(version, error)
            for _, _, _, done, _ in pending:
                if not done.done():
                    done.set_result((version, None, -1, True))

        self.sharded.apply([p[1] for p in pending], count, ok, after, failed)

    def _broken(self, version: int, error: BaseException) -> None:
        """A shard died (or a save failed): the run stops with one line, the first failure's (the driver reads it
        from `progress` and `result`)."""
        if self.problem is None:
            self.problem = (f"a parameter server shard failed at version {version} ({type(error).__name__}); the "
                            f"run stops here; with a checkpoint_dir, resume continues at its last saved version")
        self.stop = True

    def _record(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

