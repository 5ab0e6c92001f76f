"""Gradient averaging over the replica axis, with the allreduce algorithm as a choice (a communicator object).

This is the only module that calls `lax.pmean` / `lax.ppermute` & co, so every byte the trainer sends between
replicas goes through here and can be compared with `theoretical_traffic` (see `jaxpar.cost.explain`). Why about
380 lines: that ownership is the point, so the four algorithms, their sums and gathers (which the compression codecs
in `compression.py` build on), the one-flat-buffer average across CPU processes and the `Communicator` object stay
together; the codecs themselves live in `compression.py`.

Algorithms (all return the same numbers as `lax.pmean`, up to float summation order):

- ``psum``: XLA's native all-reduce; the reference and the fastest on real hardware.
- ``ring``: reduce-scatter then all-gather around a ring of `lax.ppermute`s: 2(N-1) steps, each device sends
  2(N-1)/N of the buffer (bandwidth optimal, independent of N).
- ``torus2d``: Mikami et al. 2018: the axis as an X x Y grid (device i = y*X + x); ring reduce-scatter along X,
  ring allreduce along Y on the 1/X chunk, ring all-gather along X: the ring's bytes in 2(X-1)+2(Y-1) steps.
- ``ps``: parameter server: everyone sends to device 0, which averages and sends back: the central bottleneck.

The hand-written algorithms first fuse all leaves of one dtype into one flat buffer (Horovod tensor fusion), so
the step count does not grow with the number of parameters. Their result is *varying* over the axis as far as
`shard_map`'s type check knows (only a native collective can prove replication), so return it under an out_spec
that mentions the axis, or pass `check_vma=False` to `jax.shard_map`.

Example (8 CPU devices)::

    import jax, jax.numpy as jnp, jaxpar
    from jaxpar.parallel.collectives import allreduce_mean
    from jaxpar.parallel.mesh import REPLICA_AXIS
    from jaxpar.parallel.partitioning import PER_REPLICA  # one entry per device of the replica axis

    mesh = jaxpar.make_mesh("8")  # 8 replicas
    f = jax.jit(jax.shard_map(lambda g: allreduce_mean(g, REPLICA_AXIS, "ring"), mesh=mesh, in_specs=PER_REPLICA,
                              out_specs=PER_REPLICA))
    f(jnp.arange(8.0))  # every entry is 3.5

Strategies do not call these functions directly: they hold a `Communicator` (optax-like: `init` for any state it
keeps, which lives in `TrainState.comm_state`, and `mean` over a manual axis), chosen by name with
`communicator("ring")`. A stateful algorithm (compression with error feedback) is a new Communicator, not a change
to any strategy.
"""
from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.checks import is_int
from jaxpar.errors import OptionError

ALLREDUCE_ALGORITHMS = ("psum", "ring", "torus2d", "ps")


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise OptionError("allreduce", algorithm, f"is not one of: {', '.join(ALLREDUCE_ALGORITHMS)}")


def default_torus_x(n: int) -> int:
    """The divisor of `n` closest to sqrt(n) (the smaller on a tie): the squarest grid has the fewest steps.

    A prime `n` gives 1, i.e. torus2d degenerates to a plain ring over Y = n devices.
    """
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - math.sqrt(n)), d))


def torus_shape(n: int, torus_x: int | None) -> tuple[int, int]:
    """(X, Y) of the torus2d grid over `n` devices; a `torus_x` that does not divide `n` is a ConfigError."""
    x = default_torus_x(n) if torus_x is None else torus_x
    if not is_int(x) or x < 1 or n % x:
        divisors = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise OptionError("torus_x", torus_x, f"does not divide the data axis size {n}; use one of: {divisors}",
                          flag="--torus")
    return x, n // x


def theoretical_traffic(algorithm: str, n: int, nbytes: int, torus_x: int | None = None) -> dict:
    """Textbook cost of averaging an `nbytes` buffer over `n` devices (no padding, no latency model).

    Returns dict(steps=sequential communication rounds, bytes_sent_per_device=bytes the busiest device sends,
    note=one line of context), the numbers `jaxpar.explain` compares the compiled HLO against.
    """
    _check_algorithm(algorithm)
    ring = dict(steps=2 * (n - 1), bytes_sent_per_device=2 * (n - 1) / n * nbytes)
    if algorithm == "psum":
        return dict(ring, note="native all-reduce; shown: what a bandwidth-optimal (ring) all-reduce achieves")
    if algorithm == "ring":
        return dict(ring, note="reduce-scatter + all-gather around one ring")
    if algorithm == "torus2d":
        x, y = torus_shape(n, torus_x)
        return dict(steps=2 * (x - 1) + 2 * (y - 1),
                    bytes_sent_per_device=2 * (x - 1) / x * nbytes + 2 * (y - 1) / (x * y) * nbytes,
                    note=f"{x}x{y} torus: reduce-scatter along X, allreduce along Y on 1/X, all-gather along X")
    return dict(steps=2 * (n - 1), bytes_sent_per_device=float((n - 1) * nbytes),
                note=f"root receives and sends {(n - 1) * nbytes} bytes, one worker at a time; workers send {nbytes}")


def _permute(x, axis_name, perm):
    """`lax.ppermute`, with a 16-bit float sent as its bits: XLA:CPU otherwise moves the permute of a bfloat16
    value that an add produced to float32 (measured: a bf16 ring sent as many bytes as float32)."""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), axis_name, perm)
        return lax.bitcast_convert_type(bits, x.dtype)
    return lax.ppermute(x, axis_name, perm)


# ---------------------------------------------------------------------------------------------------------------
# Rings built from ppermute. `chunks` is [G, C]; `pos` is this device's (traced) position in its ring of G
# devices; `perm` maps every device of the axis to its successor in its own ring, so several rings (the rows or
# columns of a torus) run in the same ppermute.


def _ring_reduce_scatter(chunks, axis_name, pos, perm):
    """After G-1 steps, device `pos` holds chunk (pos+1) % G summed over its ring; returns that chunk."""
    g = chunks.shape[0]
    for s in range(g - 1):
        received = _permute(lax.dynamic_index_in_dim(chunks, (pos - s) % g, keepdims=False), axis_name, perm)
        k = (pos - s - 1) % g
        chunks = lax.dynamic_update_index_in_dim(chunks, lax.dynamic_index_in_dim(chunks, k, 0, False) + received, k, 0)
    return lax.dynamic_index_in_dim(chunks, (pos + 1) % g, keepdims=False)


def _ring_all_gather(chunk, out, axis_name, pos, perm):
    """Inverse layout of `_ring_reduce_scatter`: every device ends with all G chunks (written into `out`)."""
    g = out.shape[0]
    out = lax.dynamic_update_index_in_dim(out, chunk, (pos + 1) % g, 0)
    for s in range(g - 1):
        chunk = _permute(chunk, axis_name, perm)  # the left neighbour's chunk from the previous step
        out = lax.dynamic_update_index_in_dim(out, chunk, (pos - s) % g, 0)
    return out


def _ring_allreduce_sum(chunks, axis_name, pos, perm):
    if chunks.shape[0] == 1:
        return chunks
    return _ring_all_gather(_ring_reduce_scatter(chunks, axis_name, pos, perm), chunks, axis_name, pos, perm)


def _torus_sum(flat, axis_name, n, x, y):
    """Sum of `flat` (length divisible by n = x*y) over the axis, on an x-by-y torus."""
    idx = lax.axis_index(axis_name)
    col, row = idx % x, idx // x
    row_perm = [(r * x + c, r * x + (c + 1) % x) for r in range(y) for c in range(x)]
    col_perm = [(r * x + c, ((r + 1) % y) * x + c) for r in range(y) for c in range(x)]
    row_chunks = flat.reshape(x, -1)
    part = _ring_reduce_scatter(row_chunks, axis_name, col, row_perm) if x > 1 else row_chunks[0]
    # Devices in one column all hold the same chunk index, so the Y-ring reduces like with like.
    part = _ring_allreduce_sum(part.reshape(y, -1), axis_name, row, col_perm).reshape(-1)
    if x == 1:
        return part
    return _ring_all_gather(part, row_chunks, axis_name, col, row_perm).reshape(-1)


def _ps_mean(flat, axis_name, n, average=True):
    """Device 0 gathers, averages (or sums) and sends back; a ppermute permutation is one-to-one, hence one per
    peer."""
    idx = lax.axis_index(axis_name)
    total = flat
    for sender in range(1, n):
        total = total + _permute(flat, axis_name, [(sender, 0)])  # zeros everywhere but on device 0
    mean = total / jnp.asarray(n, flat.dtype) if average else total
    received = jnp.zeros_like(mean)
    for receiver in range(1, n):
        received = received + _permute(mean, axis_name, [(0, receiver)])
    return jnp.where(idx == 0, mean, received)


def _one_buffer(leaves, dtype) -> jax.Array:
    """The leaves (of one dtype) raveled one after the other into one flat buffer.

    Written leaf by leaf (in-place updates), not with jnp.concatenate: XLA:CPU fuses the leaves' producers (e.g. a
    bias gradient's reduction) into the concatenation and evaluates them for every element of it
    (`python -m benchmarks.distributed flatten`: the MLP's gradients of one step, 14.74 ms concatenated, 4.64 ms
    written in place, 4.62 ms not flattened; docs/processes.md).
    """
    flat, offset = jnp.zeros((sum(leaf.size for leaf in leaves),), dtype), 0
    for leaf in leaves:
        flat = lax.dynamic_update_slice(flat, jnp.ravel(leaf), (offset,))
        offset += leaf.size
    return flat


def _per_flat_buffer(leaves, mean_of_flat):
    """Fuse leaves per dtype into one flat buffer each, average it with `mean_of_flat(flat, dtype)`, split back;
    returns the leaves in input order."""
    out = [None] * len(leaves)
    by_dtype: dict = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    for dtype, idxs in by_dtype.items():
        mean = mean_of_flat(_one_buffer([leaves[i] for i in idxs], dtype), dtype)
        offset = 0
        for i in idxs:
            out[i] = mean[offset:offset + leaves[i].size].reshape(leaves[i].shape)
            offset += leaves[i].size
    return out


def _fused_mean(leaves, axis_name, n, algorithm, torus, average=True):
    """A hand-written algorithm's mean (or sum) of every leaf, one flat buffer per dtype."""
    def mean_of_flat(flat, dtype):
        size = flat.shape[0]
        if size == 0:
            return flat
        if algorithm == "ps":
            return _ps_mean(flat, axis_name, n, average)
        flat = jnp.pad(flat, (0, -size % n))  # every device must own an equal 1/N slice
        x, y = torus if algorithm == "torus2d" else (1, n)
        total = _torus_sum(flat, axis_name, n, x, y)
        return (total / jnp.asarray(n, dtype) if average else total)[:size]

    return _per_flat_buffer(leaves, mean_of_flat)


def allreduce_in_one_buffer(tree, axis_name: str, reduce=lax.pmean):
    """`reduce(tree, axis_name)` (`lax.pmean` by default, or `lax.psum`), sent as one flat buffer per dtype: one
    all-reduce of one array each.

    XLA combines the all-reduces of several leaves into one all-reduce of several arrays; XLA:CPU runs that as one
    gloo all-reduce per array (a TCP round trip each), so across processes the flat buffer is several times faster
    (`jaxpar.runtime.distributed.one_buffer_gradients` decides when). Only for leaves whole on each device of the
    replica (flattening a sharded leaf would all-gather it first).
    """
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, _per_flat_buffer(leaves, lambda flat, dtype: reduce(flat, axis_name)))


def allreduce_mean(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Mean of every leaf of `tree` over the manual mesh axis `axis_name`, by `algorithm`.

    Call inside a `jax.shard_map` body where `axis_name` is manual. Leaves must be floating point (gradients);
    sums accumulate in the leaf dtype, and the mean is sum / N, as `lax.pmean` does.
    """
    _check_algorithm(algorithm)
    leaves, treedef = jax.tree.flatten(tree)
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(f"allreduce_mean averages floating-point leaves, got a {leaf.dtype} leaf {leaf.shape}")
    n = lax.axis_size(axis_name)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    if algorithm == "psum":
        return lax.pmean(tree, axis_name)
    if n == 1 or not leaves:
        return tree
    return jax.tree.unflatten(treedef, _fused_mean(leaves, axis_name, n, algorithm, torus))


def allreduce_sum(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Like `allreduce_mean`, the sum (in the leaves' dtype): what a codec's wire format is summed with."""
    _check_algorithm(algorithm)
    leaves, treedef = jax.tree.flatten(tree)
    n = lax.axis_size(axis_name)
    if n == 1 or not leaves:
        return tree
    if algorithm == "psum" and all(jnp.dtype(x.dtype).itemsize == 2 for x in leaves):
        return jax.tree.unflatten(treedef, _native_sum_16(leaves, axis_name, n))
    if algorithm == "psum":
        return lax.psum(tree, axis_name)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    return jax.tree.unflatten(treedef, _fused_mean(leaves, axis_name, n, algorithm, torus, average=False))


def _native_sum_16(leaves, axis_name, n):
    """The sum of 16-bit float leaves with 16 bits on the wire, by XLA's own collectives.

    XLA:CPU promotes a 16-bit all-reduce or reduce-scatter to float32 (its AllReducePromotion pass: 4 bytes per
    element on the wire), so the reduce-scatter is an all-to-all of the (bitcast) 16-bit chunks, each device sums
    its chunk over the replicas in float32 and rounds it once to 16 bits, and an all-gather shares the chunks:
    2(N-1)/N x 2 bytes per element, like a ring all-reduce of the 16-bit buffer."""
    dtype = jnp.dtype(leaves[0].dtype)
    flat = jnp.concatenate([jnp.ravel(x.astype(dtype)) for x in leaves])
    size = flat.shape[0]
    chunks = jnp.pad(flat, (0, -size % n)).reshape(n, -1)
    bits = lax.all_to_all(lax.bitcast_convert_type(chunks, jnp.uint16), axis_name, 0, 0)  # row i: from device i
    own = jnp.sum(lax.bitcast_convert_type(bits, dtype).astype(jnp.float32), axis=0).astype(dtype)
    whole = lax.all_gather(lax.bitcast_convert_type(own, jnp.uint16), axis_name)
    flat = lax.bitcast_convert_type(whole, dtype).reshape(-1)[:size]
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset:offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return out


def _ring_gather(x, axis_name, pos, perm, g):
    """[G, ...]: every member of this device's ring of G (successor map `perm`) gets all G members' `x`."""
    out = lax.dynamic_update_index_in_dim(jnp.zeros((g,) + x.shape, x.dtype), x, pos, 0)
    for s in range(g - 1):
        x = _permute(x, axis_name, perm)  # from the predecessor: member pos - s - 1
        out = lax.dynamic_update_index_in_dim(out, x, (pos - s - 1) % g, 0)
    return out


def _gather_leaf(x, axis_name, n, algorithm, torus):
    idx = lax.axis_index(axis_name)
    if algorithm == "ps":  # everyone sends to device 0, which sends the whole stack to each worker
        out = lax.dynamic_update_index_in_dim(jnp.zeros((n,) + x.shape, x.dtype), x, 0, 0)
        for sender in range(1, n):
            out = lax.dynamic_update_index_in_dim(out, _permute(x, axis_name, [(sender, 0)]), sender, 0)
        received = jnp.zeros_like(out)
        for receiver in range(1, n):
            received = received + _permute(out, axis_name, [(0, receiver)])
        return jnp.where(idx == 0, out, received)
    x_size, y_size = torus if algorithm == "torus2d" else (n, 1)
    col, row = idx % x_size, idx // x_size
    row_perm = [(r * x_size + c, r * x_size + (c + 1) % x_size) for r in range(y_size) for c in range(x_size)]
    rows = _ring_gather(x, axis_name, col, row_perm, x_size) if x_size > 1 else x[None]
    if y_size == 1:
        return rows
    col_perm = [(r * x_size + c, ((r + 1) % y_size) * x_size + c) for r in range(y_size) for c in range(x_size)]
    return _ring_gather(rows, axis_name, row, col_perm, y_size).reshape((n,) + x.shape)  # device y*X + x


def allgather(tree, axis_name: str, algorithm: str = "psum", *, torus_x: int | None = None):
    """Every leaf stacked over the axis ([N, ...], entry i from device i): psum -> XLA's all-gather; ring -> N-1
    ppermute steps; torus2d -> gathered along X, then the X-stacks along Y; ps -> through device 0."""
    _check_algorithm(algorithm)
    n = lax.axis_size(axis_name)
    if algorithm == "psum":
        return lax.all_gather(tree, axis_name)
    if n == 1:
        return jax.tree.map(lambda x: x[None], tree)
    torus = torus_shape(n, torus_x) if algorithm == "torus2d" else None
    return jax.tree.map(lambda x: _gather_leaf(x, axis_name, n, algorithm, torus), tree)


class Communicator:
    """An averaging algorithm over a manual mesh axis, as an object (optax-like).

    - `init(params, num_replicas) -> state`: any state it keeps (this one keeps none: `()`); stored in
      `TrainState.comm_state` (a compressed one, `jaxpar.parallel.compression`, keeps per-replica parts);
    - `mean(tree, state, axis_name) -> (tree, state)`: the mean of every leaf over `axis_name`, inside a shard_map
      body where that axis is manual.
    """

    def __init__(self, algorithm: str = "psum", torus_x: int | None = None):
        _check_algorithm(algorithm)
        if torus_x is not None and algorithm != "torus2d":
            raise OptionError("torus_x", torus_x, "applies only with {allreduce} torus2d", flag="--torus")
        self.name, self.torus_x = algorithm, torus_x

    @property
    def native(self) -> bool:
        """XLA's own collective: works on global (auto-sharded) arrays without flattening them."""
        return self.name == "psum"

    def init(self, params, num_replicas: int = 1):
        return ()

    def init_state(self, params, num_replicas: int):
        """`init`, for communicators written before it took the replica count (`init(params)`) too."""
        try:
            parameters = inspect.signature(self.init).parameters
        except (TypeError, ValueError):
            parameters = {}
        if len(parameters) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters.values()):
            return self.init(params, num_replicas)
        return self.init(params)

    def mean(self, tree, state, axis_name: str):
        return allreduce_mean(tree, axis_name, self.name, torus_x=self.torus_x), state

    def check(self, n: int) -> None:
        """Refuses a configuration that cannot run over an axis of `n` devices (before anything compiles)."""
        if self.name == "torus2d":
            torus_shape(n, self.torus_x)


    def __repr__(self):
        return f"Communicator({self.name!r}" + (f", torus_x={self.torus_x})" if self.torus_x else ")")


def check_allreduce(allreduce: str | None, torus_x: int | None) -> None:
    """Refuses an unknown algorithm name, or a torus X without torus2d (None = the compiler's all-reduce): the
    rules a `Communicator` is built with."""
    if allreduce is not None or torus_x is not None:
        Communicator(allreduce or "psum", torus_x)


def communicator(name: "str | Communicator" = "psum", torus_x: int | None = None) -> Communicator:
    """The communicator called `name` (psum, ring, torus2d, ps); a Communicator is returned unchanged."""
    return name if isinstance(name, Communicator) else Communicator(name, torus_x)
