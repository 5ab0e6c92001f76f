"""Error feedback: a codec's per-replica residual (what compression dropped, added to the next gradient), and the
float32 view the codecs compute in."""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_EF = "noef"  # suffix of a codec without error feedback (int8:noef, powersgd:R:noef), for convergence studies


def f32(x):
    return x.astype(jnp.float32)


def finite_or_zero(x):
    """A non-finite value never enters a residual: it is dropped (the step that met it is non-finite anyway)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def residuals(params, error_feedback: bool):
    """The per-replica state of an error-feedback codec: a float32 zero per leaf; without error feedback, none."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params) if error_feedback else ()


def with_residual(leaves, own):
    """v = gradient + residual (error feedback), or the gradient alone when the codec keeps no residual."""
    return [f32(g) + r for g, r in zip(leaves, own)] if own else [f32(g) for g in leaves]
