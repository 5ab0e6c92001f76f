"""PowerSGD:R (Vogels et al. 2019): error feedback; each gradient with ndim >= 2, viewed as a matrix
(prod(shape[:k]), prod(shape[k:])) = n x m (`matrix_split`: the k with the smallest factors) with (n + m) R < n m, sends P = M Q (n x R, averaged), then Q = M^T orth(P)
(m x R, averaged); the mean is orth(P) Q^T and Q is kept for the next step (warm start). Other leaves are averaged
uncompressed with the P round. `powersgd:R:noef`: without error feedback (no residual).

Warm-up (`powersgd:R:warmup=W`, torch's `start_powerSGD_iter`): the first W exchanges average every gradient
uncompressed (a float32 all-reduce, no residual, Q untouched); a counter in the shared state (replicated,
checkpointed) says when to switch. `powersgd:R` alone takes `DEFAULT_WARMUP`; `warmup=0` switches it off.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.parallel import partitioning as shd
from jaxpar.parallel.compression.error_feedback import NO_EF, finite_or_zero, residuals, with_residual


DEFAULT_WARMUP = 0  # the uncompressed exchanges `powersgd:R` starts with (docs/measurements.md: the warm-up table)
WARMUP_COUNT = "warmup_count"  # the shared state's exchange counter (only with a warm-up)


def matrix_split(shape) -> int:
    """Where PowerSGD cuts a parameter's dimensions into rows and columns: the k (1 <= k < ndim) that makes
    (product of shape[:k]) + (product of shape[k:]) smallest, so the rank-R factors are smallest (the first such k).
    A dense kernel (in, out): k = 1. Stacked layers (L, in, out): (L in, out), not (L, in out), which has only L
    rows. A convolution (kh, kw, cin, cout): (kh kw cin, cout). Attention (d, heads, head_dim): (d, heads head_dim)."""
    sizes = [math.prod(shape[:k]) + math.prod(shape[k:]) for k in range(1, len(shape))]
    return 1 + sizes.index(min(sizes))


def as_matrix_shape(shape) -> tuple[int, int]:
    """The matrix PowerSGD sees: (product of shape[:k], product of shape[k:]), k = `matrix_split(shape)`."""
    k = matrix_split(shape)
    return math.prod(shape[:k]), math.prod(shape[k:])


def orthogonalize(p):
    """Orthonormal columns spanning P's (reduced QR; the paper uses Gram-Schmidt, same span)."""
    q, _ = jnp.linalg.qr(p)
    return q


class PowerSGD:
    """Rank-R PowerSGD with error feedback (unless `error_feedback=False`) and warm start; runs on whole
    (auto-sharded) arrays."""

    elementwise = False

    def __init__(self, rank: int, error_feedback: bool = True, warmup: int = 0):
        self.rank, self.error_feedback, self.warmup = rank, error_feedback, warmup
        self.name = (f"powersgd:{rank}" + ("" if warmup == DEFAULT_WARMUP else f":warmup={warmup}") +
                     ("" if error_feedback else f":{NO_EF}"))

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
        if self.warmup:
            qs[WARMUP_COUNT] = jnp.zeros((), jnp.int32)
        return residuals(params, self.error_feedback), qs

    def mean(self, leaves, own, shared, exchange, n, axis_name):
        if not self.warmup:
            return self._compressed(leaves, own, shared, exchange)
        count = shared[WARMUP_COUNT]
        rest = {k: v for k, v in shared.items() if k != WARMUP_COUNT}

        def warm(_):  # uncompressed: the float32 mean of every leaf, each device its own shard where laid out
            means = exchange.mean([x.astype(jnp.float32) for x in leaves],
                                  exchange.layout([(i, None) for i in range(len(leaves))]))
            return [m.astype(g.dtype) for m, g in zip(means, leaves)], list(own), rest

        def cold(_):
            return self._compressed(leaves, own, rest, exchange)

        means, new_own, new_rest = lax.cond(count < self.warmup, warm, cold, None)
        return means, new_own, {**new_rest, WARMUP_COUNT: jnp.minimum(count + 1, self.warmup)}

    def _compressed(self, leaves, own, shared, exchange):
        v = with_residual(leaves, own)
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
            residual[i] = finite_or_zero(mats[i] - approx).reshape(v[i].shape)
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
                row_pieces, col_pieces = shd.factor_splits(cut, matrix_split(s))
                first += 4 * rows // row_pieces * self.rank
                second += 4 * cols // col_pieces * self.rank
            else:
                first += 4 * math.prod(s) // math.prod(cut)
        return {"all-reduce": first, "all-reduce (Q)": second} if second else {"all-reduce": first}
