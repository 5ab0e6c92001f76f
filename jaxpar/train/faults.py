"""Numerical faults and silent corruption: skip a non-finite step, and check that replicated copies agree.

- `guarded_update(ctx, state, grads, model_state, metrics)`: the optimizer step of Sync() and SSP / ASP, guarded. Skip
  (default): the loss, the gradients and the new model state are checked BEFORE the optimizer runs, and a `lax.cond`
  runs it only if they are finite (no select over the state, no second pass over it). An optimizer that turns finite
  gradients into a non-finite update (lr = inf) is not skipped: its parameters make the next step's loss non-finite,
  which is skipped, and `StopIfDiverged(max_skips)` ends the run. Flag (`skip_nonfinite=False`, `--on-nonfinite
  abort`): the loss, the new parameters (a non-finite gradient or update reaches them; checked on the parameters,
  not on the updates, so the check's sum fuses into the update's own pass: 188,472 bytes accessed per device
  against 253,056, `python -m benchmarks.overhead --model mlp --mesh 2x4 --hlo --no-skip`) and the new model state,
  so such an update is flagged at its own step and the run stops before it is checkpointed (an optimizer state that
  alone overflows, with finite updates, is not looked at). The checked values are the same on every replica (gradients are
  averaged first), so the data axis is never asked: the flag needs a collective only over the axes the parameters are
  split over (fsdp, model), one 4-byte all-reduce, which no formulation avoids (`benchmarks/guard_collectives.py`:
  after the last collective over those axes each device still computes gradient blocks no other device sees).
- `keep_if_finite(old, new, metrics)`: the older check of the whole updated state, for variants that update inside
  a replica-manual `shard_map` (local SGD's synchronous step): keeps `old` (bit-identical) when the loss or any
  floating-point leaf of the updated state is not finite; the step counter and run key still advance (the batch is
  consumed). Adds the metric `skipped` (1.0 or 0.0).
- `ReplicaCheck`: one compiled function that fingerprints every device's local copy of every parameter; copies of
  the same block (devices that differ only along mesh axes the parameter is not split over) must have equal
  fingerprints. Under sync SGD every replica must hold identical parameters; under local SGD and DiLoCo the anchor
  (`state.params`) is replicated too, and the replicas' own drift is reported as `replica_divergence` at meetings.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxpar.errors import ReplicaMismatch
from jaxpar.names import named_leaves
from jaxpar.parallel import partitioning as shd


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_float(x) -> bool:
    """A floating-point leaf (PRNG keys are not)."""
    return not _is_key(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def finite_within(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite, reduced by the compiler over the axes its leaves are
    split over: inside a replica-manual `shard_map`, within the replica only."""
    return jnp.isfinite(sum((jnp.sum(x, dtype=jnp.float32) for x in jax.tree.leaves(tree) if _is_float(x)),
                            jnp.float32(0)))


def select_tree(ok, new, old):
    """`new` where `ok`, else `old`, leaf by leaf (PRNG keys included)."""
    return jax.tree.map(lambda n, o: _select(ok, n, o), new, old)


def _all_finite(tree, shardings, mesh, every_axis: bool = False) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite. Each device sums its own shards (a NaN or infinity
    makes a sum non-finite; so would finite values summing past float32's range, beyond 1e38, a fault anyway) and
    one all-reduce combines the devices: a global reduction per leaf would cost one collective per leaf. It runs
    only over the axes some leaf is split over: along the others every device holds the same blocks (sync SGD's
    state is replicated over data, so its check never crosses the data axis; `ReplicaCheck` tests that claim)."""
    leaves = jax.tree.leaves(tree)
    chosen = [(x, spec) for x, spec in zip(leaves, shd.specs_of(shardings), strict=True) if _is_float(x)]
    if not chosen:
        return jnp.bool_(True)

    split = set().union(*(shd.split_axes(spec) for _, spec in chosen))
    axes = tuple(a for a in mesh.axis_names if a in split or every_axis)

    def local(*blocks):
        total = sum(jnp.sum(b, dtype=jnp.float32) for b in blocks)
        return jnp.isfinite(lax.psum(total, axes) if axes else total)

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec for _, spec in chosen), out_specs=shd.REPLICATED,
                         check_vma=False)(*(x for x, _ in chosen))


class Update(NamedTuple):
    """A guarded optimizer step: the new fields (the old ones where `ok` is false, under skip), the verdict and the
    metrics with `skipped` (skip) or `nonfinite` (flag only) added."""

    params: Any
    opt_state: Any
    model_state: Any
    ok: jax.Array  # bool scalar, the same on every device
    metrics: dict


def guarded_update(ctx, state, grads, model_state, metrics: dict) -> Update:
    """`ctx.tx` applied to `state.params` with `grads` (already averaged over the replicas), guarded (see the
    module docstring). `model_state`: the step's new non-parameter model state; `ctx`: the strategy's
    `StepContext` (its shardings, mesh and `skip_nonfinite`). Outside any `shard_map`.

    Skip: the loss, the gradients and the new model state are checked BEFORE the optimizer runs, and a
    `lax.cond` runs the optimizer only when they are finite (the skipped branch returns the old state as it is:
    no select over the state, no second pass over it). Flag (abort): the loss, the new parameters and the new
    model state, so that an optimizer turning finite gradients into a non-finite update is flagged too."""
    loss_ok = jnp.isfinite(metrics["loss"]).all()
    if ctx.skip_nonfinite:
        ok = loss_ok & _all_finite((grads, model_state), (ctx.param_shardings, ctx.model_state_shardings), ctx.mesh)

        def apply(params, opt_state, new_model_state, old_model_state):
            updates, opt_state = ctx.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, new_model_state

        def keep(params, opt_state, new_model_state, old_model_state):
            return params, opt_state, old_model_state

        kept = lax.cond(ok, apply, keep, state.params, state.opt_state, model_state, state.model_state)
        return Update(*kept, ok, {**metrics, "skipped": (~ok).astype(jnp.float32)})
    updates, opt_state = ctx.tx.update(grads, state.opt_state, state.params)
    # the optimizer's output (non-finite gradients reach it), as the new parameters: nothing is gated on the flag
    params = optax.apply_updates(state.params, updates)
    ok = loss_ok & _all_finite((params, model_state), (ctx.param_shardings, ctx.model_state_shardings), ctx.mesh)
    return Update(params, opt_state, model_state, ok,
                  {**metrics, "nonfinite": (~ok).astype(jnp.float32)})


def keep_unless(ctx, ok, new, old):
    """`new` where `ok` (or whenever `ctx.skip_nonfinite` is off), else `old`: the rest of a guarded step's state."""
    return select_tree(ok, new, old) if ctx.skip_nonfinite else new


def _select(ok, new, old):
    if _is_key(new):
        return jax.random.wrap_key_data(jnp.where(ok, jax.random.key_data(new), jax.random.key_data(old)),
                                        impl=jax.random.key_impl(new))
    return jnp.where(ok, new, old)


def step_is_finite(new, metrics: dict, shardings, mesh) -> jax.Array:
    """Whether a step's loss and every floating-point leaf of its updated state are finite (a bool scalar).
    `shardings`: the train state's (a `TrainState` of `NamedSharding`s) on `mesh`."""
    fields = ("params", "opt_state", "model_state", "strategy_state", "comm_state")
    # a communicator's state (e.g. error-feedback residuals) is declared replicated but may differ per replica:
    # then every axis is asked, so that all replicas agree on skipping
    own_state = any(_is_float(x) for x in jax.tree.leaves(new.comm_state))
    return jnp.isfinite(metrics["loss"]).all() & _all_finite(
        tuple(getattr(new, f) for f in fields), tuple(getattr(shardings, f) for f in fields), mesh, own_state)


def flag_if_not_finite(new, metrics: dict, shardings, mesh):
    """`new` unchanged, with the metric `nonfinite` (1.0 when the loss or the updated state is not finite): without
    skipping, this lets the loop stop before such a state is evaluated or checkpointed."""
    ok = step_is_finite(new, metrics, shardings, mesh)
    return new, {**metrics, "nonfinite": (~ok).astype(jnp.float32)}


def keep_if_finite(old, new, metrics: dict, shardings, mesh):
    """`new` if its loss and every floating-point leaf are finite, else `old` with the step counter advanced."""
    ok = step_is_finite(new, metrics, shardings, mesh)
    kept = select_tree(ok, new._replace(step=old.step, key=old.key), old)
    return kept._replace(step=new.step, key=new.key), {**metrics, "skipped": (~ok).astype(jnp.float32)}


# --- replica consistency --------------------------------------------------------------------------------------------
def _fingerprint(x) -> jax.Array:
    """A uint32 hash of a block's bits (position-weighted sum, wrapping): any changed bit changes it."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    bits = bits.ravel()
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


class ReplicaCheck:
    """Compares every device's copy of each parameter block; `check(params, step)` raises `ReplicaMismatch`."""

    def __init__(self, param_shardings, mesh):
        self.mesh = mesh
        self.specs = shd.specs_of(param_shardings)
        axes = tuple(mesh.axis_names)

        def local(*blocks):
            prints = jnp.stack([_fingerprint(b) for b in blocks]) if blocks else jnp.zeros((0,), jnp.uint32)
            return prints.reshape((1,) * len(axes) + prints.shape)

        self._fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=tuple(self.specs), out_specs=shd.device_grid_spec(mesh),
                                         check_vma=False))

    def fingerprints(self, params) -> np.ndarray:
        """[*mesh.shape, parameters]: each device's fingerprint of its copy of each parameter block."""
        from jaxpar.runtime.distributed import to_host

        return np.asarray(to_host(self._fn(*jax.tree.leaves(params))))

    def mismatches(self, params) -> list[str]:
        prints = self.fingerprints(params)
        axes = list(self.mesh.axis_names)
        problems = []
        names = [name for name, _ in named_leaves(params)]  # e.g. hidden.kernel.value, as checkpoints name it
        for index, (name, spec) in enumerate(zip(names, self.specs, strict=True)):
            split = shd.split_axes(spec)
            groups: dict[tuple, list[tuple]] = {}
            for position in np.ndindex(*self.mesh.devices.shape):
                block = tuple(position[axes.index(a)] for a in sorted(split))
                groups.setdefault(block, []).append(position)
            for positions in groups.values():
                values = [int(prints[position + (index,)]) for position in positions]
                if len(set(values)) == 1:
                    continue
                common, count = Counter(values).most_common(1)[0]
                odd = [p for p, v in zip(positions, values) if v != common] if count > 1 else positions[1:]
                where = ", ".join(f"{self.mesh.devices[p]} ({self._coords(p)})" for p in odd)
                problems.append(f"parameter {name}: the copy on {where} differs from the copy on "
                                f"{self.mesh.devices[positions[values.index(common)]]}")
        return problems

    def _coords(self, position) -> str:
        return ",".join(f"{a}={i}" for a, i in zip(self.mesh.axis_names, position) if self.mesh.shape[a] > 1)

    def check(self, params, step: int) -> None:
        problems = self.mismatches(params)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ReplicaMismatch(f"replica check at step {step}: {problems[0]}{more}; the replicated parameters have "
                                  f"diverged (a non-deterministic op, a bad device or memory): stopped so nothing "
                                  f"corrupt is saved; resume from the last checkpoint")
