"""The server's parameters split over several actors by bytes (`server_shards` > 1).

Each `ParameterServerShard` actor holds some of the parameter leaves and the server optimizer's state for them, and
applies the optimizer to its own leaves. The `ParameterServer` stays the one coordinator of versions, the staleness
rule and the bookkeeping: it decides which pushes form an update and tells every shard to apply them, in version
order. The bytes do not pass through it: a worker sends each shard its part of a push (`stage`, kept by the shard
until applied, so a worker that dies after pushing loses nothing) and tells the server only (worker, seq); each
shard's new leaves go back to the workers through Ray's object store, one reference per shard (`ShardedParams`).

An update on a part of the leaves equals the whole update restricted to that part for an optimizer that treats
each leaf alone (SGD, momentum, Adam, AdamW without a mask); the server checks this on its first two updates'
worth of random gradients before the run, and refuses an optimizer that couples leaves (global-norm clipping, a
mask by parameter path) with one line.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import optax

from jaxpar.errors import ConfigError


def split_by_bytes(sizes: list[int], shards: int) -> list[list[int]]:
    """The leaf indices each of `shards` actors holds: the largest leaf first, each to the shard with the fewest
    bytes so far (the lowest index on a tie); each shard's indices in leaf order. Deterministic, so the server and
    every worker compute the same split from the parameter shapes."""
    if shards > len(sizes):
        raise ConfigError(f"server_shards {shards}: the model has {len(sizes)} parameter arrays, fewer than the "
                          f"shards to split them over; use server_shards {len(sizes)} or fewer")
    held, parts = [0] * shards, [[] for _ in range(shards)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(shards), key=lambda s: (held[s], s))
        held[target] += sizes[index]
        parts[target].append(index)
    return [sorted(p) for p in parts]


def leaf_bytes(leaves) -> list[int]:
    return [int(np.asarray(x).size * np.asarray(x).dtype.itemsize) for x in leaves]


def apply_update(tx, params, opt_state, grads):
    """One optimizer step of `tx` on `params` (the server's, or a shard's part of them)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def check_separable(tx, leaves, split: list[list[int]]) -> str | None:
    """None when two updates of each part alone equal the whole's two updates (random gradients, float tolerance
    1e-6), else the problem in one line."""
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(np.shape(x)).astype(np.asarray(x).dtype) for x in leaves] for _ in range(2)]
    try:
        whole, state = list(leaves), tx.init(list(leaves))
        for g in grads:
            whole, state = apply_update(tx, whole, state, g)
        for part in split:
            mine = [leaves[i] for i in part]
            own = tx.init(mine)
            for g in grads:
                mine, own = apply_update(tx, mine, own, [g[i] for i in part])
            if not all(np.allclose(a, whole[i], rtol=1e-6, atol=1e-7) for a, i in zip(mine, part)):
                return "differs"
    except Exception as error:  # noqa: BLE001 - an optimizer that needs the whole tree's structure
        return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return None


class ParameterServerShard:
    """A Ray actor (async): some of the server's parameter leaves and the optimizer's state for them."""

    def __init__(self, optimizer, leaves: list):
        import jax.numpy as jnp

        self.params = [jnp.asarray(x) for x in leaves]
        self.opt_state = optimizer.init(self.params)
        self._update = jax.jit(lambda p, o, g: apply_update(optimizer, p, o, g))
        self._opt_tree = jax.tree.structure(self.opt_state)
        self._ref = None
        self._staged: dict[tuple, list] = {}

    def _leaves_ref(self):
        import ray

        self._ref = ray.put([np.asarray(x) for x in jax.device_get(self.params)])
        return [self._ref]  # in a list, so that the caller receives the reference, not the arrays

    async def leaves(self) -> list:
        return self._leaves_ref() if self._ref is None else [self._ref]

    async def stage(self, key: tuple, part: list) -> None:
        """Keeps a push's part of a gradient until the update that applies it; `key` is that push attempt's own
        (worker, seq, process, attempt), so a repeated push never replaces or removes another's part."""
        self._staged[tuple(key)] = [np.array(x) for x in part]  # a copy: nothing pins the object store

    async def discard(self, key: tuple) -> None:
        self._staged.pop(tuple(key), None)

    async def apply(self, count: int, ok: bool, keys: list) -> list:
        """Applies the staged parts of `keys`, their sum divided by `count`, unless not `ok` (a skipped update);
        the new leaves' reference."""
        parts = [self._staged.pop(tuple(k)) for k in keys]
        if ok:
            total = [sum(p[i] for p in parts) for i in range(len(self.params))]
            grads = [np.asarray(t / count, dtype=t.dtype) for t in total]
            self.params, self.opt_state = self._update(self.params, self.opt_state, grads)
        return self._leaves_ref()

    async def state(self) -> tuple[list, list]:
        """(parameter leaves, optimizer state leaves) as numpy arrays."""
        return ([np.asarray(x) for x in jax.device_get(self.params)],
                [np.asarray(x) for x in jax.tree.leaves(jax.device_get(self.opt_state))])

    async def restore(self, params: list, opt_leaves: list) -> None:
        import jax.numpy as jnp

        self.params = [jnp.asarray(x) for x in params]
        self.opt_state = jax.tree.unflatten(self._opt_tree, [jnp.asarray(x) for x in opt_leaves])
        self._ref = None


class ShardedParams:
    """The coordinator's handle on its shard actors (created by it, so they end with it): updates applied in version
    order, the current leaves as one object reference per shard."""

    def __init__(self, optimizer, leaves: list, shards: int, runtime_env: dict):
        import ray

        self.split = split_by_bytes(leaf_bytes(leaves), shards)
        problem = check_separable(optimizer, leaves, self.split)
        if problem is not None:
            raise ConfigError(f"server_shards {shards}: the server's optimizer does not update each part of the "
                              f"parameters alone ({problem}; e.g. global-norm clipping or a mask by parameter "
                              f"path); use server_shards 1")
        actor = ray.remote(ParameterServerShard).options(num_cpus=0, runtime_env=runtime_env)
        self.actors = [actor.remote(optimizer, [leaves[i] for i in part]) for part in self.split]
        self._last: asyncio.Future | None = None
        self.refs: list | None = None  # the applied version's leaves, one reference per shard
        self.broken: Exception | None = None  # what stopped the updates

    async def start(self) -> None:
        self.refs = [(await a.leaves.remote())[0] for a in self.actors]

    def busy(self) -> bool:
        return self._last is not None and not self._last.done()

    def apply(self, keys: list, count: int, ok: bool, after, failed):
        """Schedules one update of the staged pushes `keys` (each push's own stage key) after the previous one;
        `after()` runs once every shard has applied it, `failed(error)` if one could not (its actor died, a save
        failed). Returns the future of that."""
        previous = self._last

        async def run():  # never raises: a failure goes to `failed`, and every later update fails with it
            if previous is not None:
                await previous
            if self.broken is not None:
                failed(self.broken)
                return
            try:
                out = await asyncio.gather(*[a.apply.remote(count, ok, keys) for a in self.actors])
                self.refs = [o[0] for o in out]
                await after()
            except Exception as error:  # noqa: BLE001 - a dead actor (or its node), a failed save: the run stops
                self.broken = error
                failed(error)

        self._last = asyncio.ensure_future(run())
        return self._last

    async def settled(self) -> None:
        """Waits until every scheduled update is applied."""
        if self._last is not None:
            await self._last

    async def state(self, num_leaves: int) -> tuple[list, list]:
        """(every parameter leaf in leaf order, the shards' optimizer state leaves one shard after another)."""
        params, opt = [None] * num_leaves, []
        for part, (mine, own) in zip(self.split, await asyncio.gather(*[a.state.remote() for a in self.actors])):
            for i, x in zip(part, mine):
                params[i] = x
            opt += own
        return params, opt

    async def restore(self, params: list, opt_leaves: list) -> None:
        counts = [len(own) for _, own in await asyncio.gather(*[a.state.remote() for a in self.actors])]
        start = 0
        for part, actor, count in zip(self.split, self.actors, counts):
            await actor.restore.remote([params[i] for i in part], opt_leaves[start:start + count])
            start += count
        await self.start()
