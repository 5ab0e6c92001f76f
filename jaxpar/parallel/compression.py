"""Gradient compression as stateful communicators: a codec wraps the replica-axis exchange of a `Communicator`.

A codec is optax-like: `init(params) -> (own, shared)` (its state: `own` is one replica's copy, e.g. an
error-feedback residual, stacked over the replicas in `TrainState.comm_state`; `shared` is the same on every
replica, e.g. PowerSGD's warm-start Q), `mean(leaves, own, shared, exchange) -> (means, own, shared)` (encode, the
exchange, decode), and `payload(shapes, n) -> {collective: bytes}`: the exact bytes it hands to each collective
per device, from which `CompressedCommunicator.wire_bytes` gives what the busiest device sends.

- ``bf16``: cast, summed over replicas in bfloat16 by the chosen algorithm, decoded and divided by N in float32.
- ``fp16``: as bf16 in float16, with a per-leaf power-of-two scale 2^floor(log2(65504 / (N * amax))) where amax is
  the leaf's largest |gradient| over every replica (one small pmax): every partial sum of N scaled values stays
  within float16's range, in any summation order; small gradients are scaled up, away from float16's subnormals.
- ``int8``: error feedback (v = gradient + residual), per-chunk (`INT8_CHUNK` elements of one leaf) scale
  absmax/127, codes round(v/scale); the codes and scales are ALL-GATHERED and every replica decodes and sums them
  in float32 in the same order (the exact mean of the quantized values, identical on every replica, no second
  quantization). Summing int32 codes instead (psum with a shared scale) puts 4 bytes per element on the wire,
  as many as float32. The all-gather sends (N-1) x (n + 4 n / chunk) bytes per device against float32's ring
  2(N-1)/N x 4n: N/8 of it (1/4 on 2 replicas, even at 8); see docs/compression.md. The chunks of a leaf are
  its own (each leaf zero-padded to whole chunks).
- ``powersgd:R`` (Vogels et al. 2019): error feedback; each gradient with ndim >= 2, viewed as a matrix
  (shape[0], prod(shape[1:])) = n x m with (n + m) R < n m, sends P = M Q (n x R, averaged), then
  Q = M^T orth(P) (m x R, averaged); the mean is orth(P) Q^T and Q is kept for the next step (warm start).
  Other leaves are averaged uncompressed with the P round.

Where: `Sync(allreduce=ALG, compress=CODEC)` (the gradient), `LocalSGD` / `DiLoCo(compress=CODEC)` (a meeting's
outer gradients); `compressed(communicator("ring"), "int8")` builds one directly.
`int8:noef` / `powersgd:R:noef`: the same codecs without error feedback (no residual), for convergence studies.

Why about 410 lines: a codec is one class holding its encode / decode, its wire payload and its FLOP count (what
`jaxpar.cost.codecs` prices), so a codec is defined in one place; the exchange and the communicator frame them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.errors import OptionError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.collectives import Communicator, allgather, allreduce_sum, theoretical_traffic

CODECS = ("none", "bf16", "fp16", "int8", "powersgd:R")
# What a codec's `flops(shapes, n)` counts: the arithmetic the codec adds to a step, per device, by kind
# ("elementwise", "matmul", "orthogonalise"); an estimate from the operations written here, not XLA's count (XLA
# counts 20-45 FLOPs per element for the elementwise codecs, its own way; it does not count the QR, a LAPACK call).
NO_EF = "noef"  # suffix of a codec without error feedback (int8:noef, powersgd:R:noef), for convergence studies
INT8_CHUNK = 256  # elements per int8 scale: the scales add 4/256 = 1.6% to the codes' bytes
FP16_MAX = 65504.0
OWN, SHARED = "own", "shared"  # the two parts of a compressed communicator's state (see partitioning)


def _f32(x):
    return x.astype(jnp.float32)


def _finite_or_zero(x):
    """A non-finite value never enters a residual: it is dropped (the step that met it is non-finite anyway)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


class Cast:
    """bf16 / fp16 on the wire, the mean in float32. No state."""

    elementwise = True

    def __init__(self, name: str):
        self.name, self.dtype = name, {"bf16": jnp.bfloat16, "fp16": jnp.float16}[name]

    def init(self, params):
        return (), ()

    def scales(self, leaves, n, axis_name):
        """fp16: per leaf 2^floor(log2(65504 / (N amax))), amax over every replica; bf16: 1."""
        if self.name == "bf16" or not leaves:
            return [jnp.float32(1.0)] * len(leaves)
        amax = lax.pmax(jnp.stack([jnp.max(jnp.abs(_f32(x))) for x in leaves]), axis_name)
        scale = jnp.exp2(jnp.floor(jnp.log2(FP16_MAX / (n * amax))))
        return list(jnp.where(amax > 0, jnp.clip(scale, 2.0 ** -40, 2.0 ** 40), 1.0))

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        scales = self.scales(leaves, n, axis_name)
        wire = [(_f32(x) * s).astype(self.dtype) for x, s in zip(leaves, scales)]
        summed = exchange.sum(wire)
        return [(_f32(t) / (s * n)).astype(x.dtype) for t, s, x in zip(summed, scales, leaves)], own, shared

    def flops(self, shapes, n) -> dict:
        """The codec's own arithmetic per device per step (see `CODEC_FLOPS_NOTE`): cast, decode and divide, and the
        sum's add; fp16 also |x|, its max and the scaling."""
        return {"elementwise": (4 if self.name == "bf16" else 7) * sum(math.prod(s) for s in shapes)}

    def payload(self, shapes, n) -> dict:
        size = sum(math.prod(s) for s in shapes)
        out = {"all-reduce": 2 * size}
        if self.name == "fp16" and shapes:
            out["scales (pmax)"] = 4 * len(shapes)
        return out


def int8_encode(flat):
    """(codes int8 [K, C], scales float32 [K]) of a float32 vector (zero-padded to K x INT8_CHUNK)."""
    chunks = jnp.pad(flat, (0, -flat.shape[0] % INT8_CHUNK)).reshape(-1, INT8_CHUNK)
    amax = jnp.max(jnp.abs(chunks), axis=1)
    # an all-zero chunk: scale 1; a non-finite amax (NaN too, which `amax > 0` would have taken for 0): a
    # non-finite scale, so the mean is too and the trainer's guard sees it
    scales = jnp.where(amax == 0, 1.0, amax / 127.0)
    codes = jnp.clip(jnp.round(chunks / scales[:, None]), -127, 127)
    return jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.int8), scales


def int8_decode(codes, scales, size: int):
    return (codes.astype(jnp.float32) * scales[..., None]).reshape(*codes.shape[:-2], -1)[..., :size]


def _residuals(params, error_feedback: bool):
    """The per-replica state of an error-feedback codec: a float32 zero per leaf; without error feedback, none."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if error_feedback else ()


def _with_residual(leaves, own):
    """v = gradient + residual (error feedback), or the gradient alone when the codec keeps no residual."""
    return [_f32(g) + r for g, r in zip(leaves, own)] if own else [_f32(g) for g in leaves]


class Int8:
    """int8 codes with per-chunk scales, error feedback (unless `error_feedback=False`: the quantisation error is
    dropped every step), all-gathered and summed in float32."""

    elementwise = True

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = error_feedback
        self.name = "int8" if error_feedback else f"int8:{NO_EF}"

    def init(self, params):
        return _residuals(params, self.error_feedback), ()

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        if not leaves:
            return leaves, own, shared
        v = _with_residual(leaves, own)
        # chunks never straddle two leaves: a leaf replicated over a within-replica axis then gets the same codes
        # on each of its devices, whatever the sharded leaves next to it hold
        encoded = [int8_encode(x.ravel()) for x in v]
        codes = jnp.concatenate([c for c, _ in encoded])
        scales = jnp.concatenate([s for _, s in encoded])
        all_codes, all_scales = exchange.gather((codes, scales))
        mean = jnp.sum(_f32(all_codes) * all_scales[..., None], axis=0) / n  # [K, C]
        out, residual, offset = [], [], 0
        for g, x, (c, s) in zip(leaves, v, encoded):
            k = c.shape[0]
            out.append(mean[offset:offset + k].reshape(-1)[:x.size].reshape(x.shape).astype(g.dtype))
            residual.append(_finite_or_zero(x - int8_decode(c, s, x.size).reshape(x.shape)))
            offset += k
        return out, residual if self.error_feedback else own, shared

    def flops(self, shapes, n) -> dict:
        """Per element: + residual, |x|, max, divide, round, clip (2), cast, own decode and the new residual (10),
        then decoding and summing all N replicas' codes (3 N)."""
        size = sum(-(-math.prod(s) // INT8_CHUNK) * INT8_CHUNK for s in shapes)
        return {"elementwise": (10 + 3 * n) * size}

    def payload(self, shapes, n) -> dict:
        chunks = sum(-(-math.prod(s) // INT8_CHUNK) for s in shapes)
        return {"all-gather": chunks * INT8_CHUNK + 4 * chunks} if chunks else {}


def as_matrix_shape(shape) -> tuple[int, int]:
    """The matrix PowerSGD sees: (shape[0], product of the other dimensions)."""
    return shape[0], math.prod(shape[1:])


def orthogonalize(p):
    """Orthonormal columns spanning P's (reduced QR; the paper uses Gram-Schmidt, same span)."""
    q, _ = jnp.linalg.qr(p)
    return q


def powersgd_round(m, q, mean_fn):
    """One PowerSGD power iteration on this replica's matrix `m` (n x m) with warm start `q` (m x R); `mean_fn`
    averages over replicas. Returns (the averaged approximation orth(P) Q^T, the new Q)."""
    p = orthogonalize(mean_fn(m @ q))
    q = mean_fn(m.T @ p)
    return p @ q.T, q


class PowerSGD:
    """Rank-R PowerSGD with error feedback (unless `error_feedback=False`) and warm start; runs on whole
    (auto-sharded) arrays."""

    elementwise = False

    def __init__(self, rank: int, error_feedback: bool = True):
        self.rank, self.error_feedback = rank, error_feedback
        self.name = f"powersgd:{rank}" + ("" if error_feedback else f":{NO_EF}")

    def compresses(self, shape) -> bool:
        """ndim >= 2 and the factors are smaller than the matrix: (n + m) R < n m."""
        if len(shape) < 2:
            return False
        n, m = as_matrix_shape(shape)
        return (n + m) * self.rank < n * m

    def init(self, params):
        leaves = jax.tree.leaves(params)
        qs = {str(i): jax.random.normal(jax.random.fold_in(jax.random.key(0), i),
                                        (as_matrix_shape(p.shape)[1], self.rank), jnp.float32)
              for i, p in enumerate(leaves) if self.compresses(p.shape)}
        return _residuals(params, self.error_feedback), qs

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        v = _with_residual(leaves, own)
        chosen = [i for i, x in enumerate(v) if str(i) in shared]
        mats = {i: v[i].reshape(as_matrix_shape(v[i].shape)) for i in chosen}
        plain = [i for i in range(len(v)) if i not in mats]
        # round 1: every P and the uncompressed leaves in one exchange; each device sends its rows of P (cut like
        # the matrix's rows) and its shard of a plain leaf, where the exchange knows the leaves' layout
        first = exchange.mean([mats[i] @ shared[str(i)] for i in chosen] + [v[i] for i in plain],
                              exchange.layout([(i, 0) for i in chosen] + [(i, None) for i in plain]))
        ps = {i: orthogonalize(p) for i, p in zip(chosen, first)}
        qs = dict(zip(chosen, exchange.mean([mats[i].T @ ps[i] for i in chosen],
                                            exchange.layout([(i, 1) for i in chosen])) if chosen else []))
        out, residual = list(first[len(chosen):]), [None] * len(v)
        means = [None] * len(v)
        for i, x in zip(plain, out):
            means[i], residual[i] = x, jnp.zeros_like(v[i])
        new_shared = dict(shared)
        for i in chosen:
            approx = ps[i] @ qs[i].T
            means[i] = approx.reshape(v[i].shape)
            residual[i] = _finite_or_zero(mats[i] - approx).reshape(v[i].shape)
            new_shared[str(i)] = qs[i]
        return ([m.astype(g.dtype) for m, g in zip(means, leaves)], residual if self.error_feedback else own,
                new_shared)

    def flops(self, shapes, n) -> dict:
        """Per compressed n x m matrix: M Q and M^T P (4 n m R) and the decoded P Q^T (2 n m R), a reduced QR of
        P (about 4 n R^2: Householder factorisation and forming Q), and the residual's add and subtract (2 n m)."""
        out = {"elementwise": 0, "matmul": 0, "orthogonalise": 0}
        for s in shapes:
            if self.compresses(s):
                rows, cols = as_matrix_shape(s)
                out["matmul"] += 6 * rows * cols * self.rank
                out["orthogonalise"] += 4 * rows * self.rank ** 2
                out["elementwise"] += 2 * rows * cols
        return out

    def payload(self, shapes, n, splits=None) -> dict:
        """Two all-reduces: the P factors with the uncompressed leaves, then the Q factors. `shapes` are whole
        arrays; `splits` (per leaf, the pieces each dimension is cut into inside a replica,
        `partitioning.within_replica_splits`; None: not cut) gives each device's part: its rows of each factor
        (`partitioning.factor_splits`) and its shard of a plain leaf."""
        first = second = 0
        for k, s in enumerate(shapes):
            cut = splits[k] if splits is not None else (1,) * len(s)
            if self.compresses(s):
                rows, cols = as_matrix_shape(s)
                row_pieces, col_pieces = shd.factor_splits(cut)
                first += 4 * rows // row_pieces * self.rank
                second += 4 * cols // col_pieces * self.rank
            else:
                first += 4 * math.prod(s) // math.prod(cut)
        return {"all-reduce": first, "all-reduce (Q)": second} if second else {"all-reduce": first}


def parse_codec(value):
    """The codec called `value` (None / 'none': no compression, returns None); a bad name is an OptionError.
    int8 and powersgd:R take a ':noef' suffix: the same codec without error feedback (int8:noef, powersgd:4:noef)."""
    if value is None or value == "none":
        return None
    if not isinstance(value, str):
        raise OptionError("compress", value, f"must be one of: {', '.join(CODECS)}")
    base, colon, suffix = value.rpartition(":")
    error_feedback = not (colon and suffix == NO_EF)
    if not error_feedback:
        if base in ("bf16", "fp16"):
            raise OptionError("compress", value, f"{base} keeps no residual, so it has no :{NO_EF} variant; use "
                                                 f"{base}, int8:{NO_EF} or powersgd:R:{NO_EF}")
        value = base
    if value in ("bf16", "fp16"):
        return Cast(value)
    if value == "int8":
        return Int8(error_feedback)
    name, _, rank = value.partition(":")
    if name == "powersgd":
        if not rank.isdigit() or int(rank) < 1:
            example = "powersgd:4" if error_feedback else f"powersgd:4:{NO_EF}"
            raise OptionError("compress", value if error_feedback else f"{value}:{NO_EF}",
                              f"powersgd needs a rank R >= 1 after the colon, e.g. {example}")
        return PowerSGD(int(rank), error_feedback)
    raise OptionError("compress", value if error_feedback else f"{value}:{NO_EF}",
                      f"is not one of: {', '.join(CODECS)} (int8 and powersgd:R also as int8:{NO_EF}, "
                      f"powersgd:R:{NO_EF}: without error feedback)")


class _Exchange:
    """The collectives a codec may use, bound to an axis and an algorithm. `shardings` (a whole-array codec's
    leaves' NamedShardings, in leaf order; None for codecs that run per shard or on a replica of one device) lets
    `mean` send each device's own part of what it averages."""

    def __init__(self, axis_name, algorithm, torus_x, shardings=None):
        self.axis_name, self.algorithm, self.torus_x = axis_name, algorithm, torus_x
        self.shardings = shardings

    def sum(self, leaves):
        return allreduce_sum(leaves, self.axis_name, self.algorithm, torus_x=self.torus_x)

    def mean(self, leaves, specs=None):
        """The mean over replicas; with `specs` (each value's within-replica PartitionSpec, `layout`), inside a
        shard_map manual over the within-replica axes, so each device sends only its part: without it a hand-written
        algorithm fuses whole (gathered) arrays and the compiler lays the native one out as it likes."""
        if specs is None:
            return self._mean(leaves)
        # no `mesh=`: inside the replica-manual shard_map the context mesh is the one to use
        return jax.shard_map(self._mean, in_specs=(specs,), out_specs=specs,
                             axis_names=set(mesh_lib.WITHIN_REPLICA_AXES), check_vma=False)(leaves)

    def _mean(self, leaves):
        n = lax.axis_size(self.axis_name)
        return [(x / n).astype(x.dtype) for x in self.sum(leaves)]

    def layout(self, parts):
        """The within-replica specs of the values named by `parts`, (leaf index, 0: its P factor / 1: its Q
        factor / None: the leaf itself), or None when the leaves' layout is not known."""
        if self.shardings is None:
            return None
        out = []
        for i, factor in parts:
            sharding, ndim = self.shardings[i]
            out.append(shd.within_replica_specs(sharding) if factor is None else
                       shd.factor_specs(sharding, ndim)[factor])
        return out

    def gather(self, tree):
        return allgather(tree, self.axis_name, self.algorithm, torus_x=self.torus_x)


class CompressedCommunicator(Communicator):
    """A communicator whose exchange is wrapped by a codec. Its state is {own: per-replica part (a leading replica
    dimension), shared: the same on every replica}."""

    def __init__(self, base: Communicator, codec):
        super().__init__(base.name, base.torus_x)
        self.base, self.codec = base, codec  # (base: the uncompressed exchange, e.g. post-local SGD's warm-up)

    @property
    def native(self) -> bool:
        return False

    @property
    def per_shard(self) -> bool:
        """Elementwise codecs run on each device's shard (nested shard_map); PowerSGD on whole arrays."""
        return self.codec.elementwise

    def init(self, params, num_replicas: int = 1):
        own, shared = self.codec.init(params)
        own = jax.tree.map(lambda x: jnp.broadcast_to(x, (num_replicas,) + x.shape), own)
        return {OWN: own, SHARED: shared}

    def mean(self, tree, state, axis_name: str, shardings=None):
        """`shardings`: the params-shaped NamedShardings of `tree` inside a replica, for a whole-array codec
        (PowerSGD) on a replica of several devices: each device then sends its own part of the factors."""
        leaves, treedef = jax.tree.flatten(tree)
        own = jax.tree.leaves(state[OWN])
        own = [x[0] for x in own] if own else own
        n = lax.axis_size(axis_name)
        layout = None if shardings is None else [
            (s, x.ndim) for s, x in zip(jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "spec")), leaves)]
        exchange = _Exchange(axis_name, self.name, self.torus_x, layout)
        means, own, shared = self.codec.mean(leaves, own, state[SHARED], exchange, n, axis_name)
        new_own = jax.tree.unflatten(jax.tree.structure(state[OWN]), [x[None] for x in own]) if own else state[OWN]
        return jax.tree.unflatten(treedef, means), {OWN: new_own, SHARED: shared}

    def traffic(self, shard_shapes, n: int, splits=None) -> list[dict]:
        """Per collective of the codec's exchange: {"collective", "bytes_sent_per_device" (the busiest device's),
        "steps"}, for gradients whose per-device shapes are `shard_shapes` over `n` replicas (a whole-array codec:
        the whole shapes, and `splits`, how each is cut inside a replica; `jaxpar.cost.codecs.gradient_splits`).
        All-reduces as `theoretical_traffic` of this algorithm; all-gathers: (N-1) x payload in N-1 steps on a ring
        or torus2d, (N-1) x N x payload at the ps root; psum's all-gather like a ring."""
        shapes = [tuple(s) for s in shard_shapes]
        payload = self.codec.payload(shapes, n) if splits is None else self.codec.payload(shapes, n, splits)
        out = []
        for kind, nbytes in payload.items():
            if kind == "all-gather":
                out.append({"collective": kind, "bytes_sent_per_device": (n - 1) * nbytes * (n if self.name == "ps"
                                                                                              else 1),
                            "steps": n - 1})
            else:
                t = theoretical_traffic("psum" if kind.startswith("scales") else self.name, n, nbytes, self.torus_x)
                out.append({"collective": kind, "bytes_sent_per_device": t["bytes_sent_per_device"],
                            "steps": t["steps"]})
        return out

    def wire_bytes(self, shard_shapes, n: int, splits=None) -> float:
        """Bytes the busiest device sends per exchange (the sum of `traffic`)."""
        return sum(t["bytes_sent_per_device"] for t in self.traffic(shard_shapes, n, splits))

    def __repr__(self):
        return f"compressed({Communicator.__repr__(self)}, {self.codec.name!r})"


def compressed(base: "str | Communicator", codec) -> Communicator:
    """`base` (a communicator or an algorithm name) with its exchange wrapped by `codec` (a name: 'none', 'bf16',
    'fp16', 'int8', 'powersgd:R'); 'none' returns `base` itself."""
    from jaxpar.parallel.collectives import communicator
    base = communicator(base)
    codec = parse_codec(codec) if codec is None or isinstance(codec, str) else codec
    return base if codec is None else CompressedCommunicator(base, codec)
