"""Rematerialization (activation checkpointing): which activations a step keeps for its backward pass.

    trainer = jaxpar.Trainer(..., remat="full")   # or "dots", "dots-no-batch", or a jax.checkpoint_policies callable

A policy decides, per intermediate value of the forward, whether it is saved for the backward or recomputed there
(`jax.checkpoint(f, policy=...)`). Named policies (`--remat NAME`):
- `none` (default): no remat, every residual the backward needs is saved;
- `full`: `jax.checkpoint_policies.nothing_saveable`, only the inputs of each rematerialised piece are saved;
- `dots`: `dots_saveable`, the results of matrix multiplications are saved, the rest (norms, activations,
  softmax) is recomputed;
- `dots-no-batch`: `dots_with_no_batch_dims_saveable`, as `dots` but not the matmuls with batch dimensions (the
  attention scores and their product with v), which grow with the sequence length squared.

Where it applies, decided when the trainer is built: per layer inside a `jaxpar.pipeline.Stack` (the built-in
transformer's blocks; the trainer binds the policy to the stack, and the scan over layers then keeps only what the
policy allows of each layer), and to a model without a Stack as a whole-forward policy (`whole_forward`: the loss's
forward under `jax.checkpoint`). The math is the same under every policy.
"""

from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.train.step import call_loss

Policy = Callable[..., bool]

_P = jax.checkpoint_policies
POLICIES: dict[str, Policy | None] = {  # name -> policy; the first is the default
    "none": None,
    "full": _P.nothing_saveable,
    "dots": _P.dots_saveable,
    "dots-no-batch": _P.dots_with_no_batch_dims_saveable,
}
REMATS = tuple(POLICIES)


def policy_of(remat, where: str = "remat") -> Policy | None:
    """The policy `remat` names (a name of `POLICIES`, None = "none", or a `jax.checkpoint_policies` callable);
    None means no remat. Anything else is one `ConfigError` naming `where`, the value and the choices."""
    if remat is None:
        return None
    if isinstance(remat, str):
        if remat in POLICIES:
            return POLICIES[remat]
    elif callable(remat):
        return remat
    raise ConfigError(f"{where} {remat!r}: choose one of {', '.join(REMATS)}, or pass a jax.checkpoint_policies "
                      f"callable (e.g. jax.checkpoint_policies.dots_saveable)")


def whole_forward(loss_fn: Callable, policy: Policy) -> Callable:
    """The three-argument `loss_fn` with its whole forward under `policy`: what the step differentiates for a model
    without a `jaxpar.pipeline.Stack` (a Stack applies the policy per layer instead, from its `LayerRun`)."""
    def loss(model, batch, rngs):
        return nnx.remat(lambda m, r: call_loss(loss_fn, m, batch, r), policy=policy)(model, rngs)

    return loss
