"""A Trainer's step variants and evaluation, jitted, and the bookkeeping of their compilations.

Per (variant, batch shape signature): the compilation counted (one per shape is expected; a later one for a new
batch shape is logged once to the `jaxpar` logger at WARNING), the first compilation's per-device memory checked
against a device before the step runs (that compilation is the one the step then uses: jit caches it), its FLOPs
read from XLA's cost analysis, and the watchers told (`watchers`: e.g. the pricer of `Trainer(hardware=...)`). The
latest batch's shapes are kept, so that a variant can be compiled ahead of time (`compiled`, `lowered`), also under
another remat policy (inspected only, never run).
"""

from __future__ import annotations

import logging
from typing import Callable

import jax

from jaxpar.errors import ConfigError, StateError
from jaxpar.parallel import context
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.runtime.resources import bytes_accessed, check_step_memory, cost_analysis, device_error, step_flops
from jaxpar.train.batch_cache import shape_signature
from jaxpar.train.remat import policy_of
from jaxpar.train.step import guarded_step

log = logging.getLogger("jaxpar")

OWN = object()  # `remat` not given: the trainer's own policy


class StepCompiler:
    """The jitted steps of `trainer`'s strategy variants (`steps`) and evaluation (`evaluate`), and what is known of
    their compilations."""

    def __init__(self, trainer):
        self._trainer = trainer
        # a variant whose metrics are one value per replica ([R]) leaves them where they are: gathering them would
        # be a collective over the replica axis; the host takes their mean when they are read (`loop.host_metrics`)
        self.steps = {name: self.jit(variant) for name, variant in trainer.variants.items()}
        self.evaluate = mesh_lib.in_mesh(jax.jit(context.traced(trainer.evaluate_step, trainer.context_parallel),
                                                 in_shardings=(
            trainer.state_shardings, trainer.batch_sharding), out_shardings=shd.replicated(trainer.mesh)), trainer.mesh)
        self.trace_counts: dict[str, int] = {}  # compilations per step variant (one per batch shape it ran on)
        self.flops: dict = {}  # (variant, batch signature) -> FLOPs of one step on all devices (cost analysis)
        self.watchers: list[Callable] = []  # watcher(variant, compiled) after a variant's first compile on a shape
        self.abstract_batch = None  # the latest batch's shapes: what a step variant compiles for ahead of time
        self._compiled: set = set()  # (variant, batch signature) compiled so far
        self._memory_checked: set = set()  # (variant, batch signature) whose compiled step fits a device
        self._other_remat: dict = {}  # (variant, policy) -> the step jitted under another remat policy

    def jit(self, variant):
        """The jitted step of a strategy `variant` (built from the trainer's StepContext or another one)."""
        t = self._trainer
        return mesh_lib.in_mesh(jax.jit(
            context.traced(guarded_step(variant, t.state_shardings, t.mesh, t.skip_nonfinite), t.context_parallel),
            in_shardings=(t.state_shardings, t.batch_sharding, None),
            out_shardings=(t.state_shardings, None if variant.per_replica_metrics else shd.replicated(t.mesh)),
            donate_argnums=0), t.mesh)

    def is_compiled(self, signature: tuple) -> bool:
        """Whether (variant, batch shape) `signature` was compiled already (else the next step compiles it)."""
        return signature in self._compiled

    def check_memory(self, signature: tuple, plan, state, placed, rows: int, step_number: int) -> None:
        """Before a step variant first runs on a batch shape: its compiled per-device bytes must fit a device; the
        compilation is counted, its FLOPs read and the watchers told."""
        if signature in self._memory_checked:
            return
        t = self._trainer
        self.abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
                               for k, v in placed.items()}
        try:
            compiled = self.steps[plan.variant].lower(state, placed, plan.inputs).compile()
        except jax.errors.JaxRuntimeError as error:
            raise device_error(error, step_number) from None
        self.count(signature)
        for watch in self.watchers:
            watch(plan.variant, compiled)
        analysis = cost_analysis(compiled)  # read once: the FLOPs, and the bound that can spare the memory analysis
        check_step_memory(compiled, t.mesh, plan.variant, rows, t.batch_divisor, t.state_bytes_per_device(),
                          bytes_accessed(analysis))
        flops = step_flops(compiled, analysis)
        if flops is not None:
            self.flops[signature] = flops * t.mesh.size  # every device runs the same partitioned program
        self._memory_checked.add(signature)

    def count(self, signature: tuple) -> None:
        """Counted on the host, outside the traced step: each (variant, batch shape) compiles once (jit caches it;
        an ahead-of-time compilation of the same signature is the one a later call uses)."""
        if signature in self._compiled:
            return
        self._compiled.add(signature)
        variant, shapes = signature
        count = self.trace_counts[variant] = self.trace_counts.get(variant, 0) + 1
        if count > 1:  # the first compilation is expected; later ones mean a new batch shape
            shapes = ", ".join(f"{k}: {dtype}{list(shape)}" for k, shape, dtype in shapes)
            log.warning(f"step variant {variant!r} compiles again (compilation {count}) for a new batch shape "
                        f"{{{shapes}}}: each new batch shape compiles the step anew (expected once per size of a "
                        f"deliberate batch-size ramp; otherwise keep batch shapes fixed, e.g. drop or pad the last "
                        f"batch)")

    def compiled(self, variant: str, batch=None, inputs=None, remat=OWN):
        """`Trainer.compiled_step`."""
        t = self._trainer
        if batch is None:
            batch = self.abstract_batch
        if batch is None:
            raise StateError("no batch yet: pass one (its shapes are enough) to compile a step variant for it")
        if variant not in self.steps:
            raise ConfigError(f"step variant {variant!r}: the strategy {t.strategy.name!r} has "
                              f"{', '.join(sorted(self.steps))}")
        abstract = t.batches.abstract(batch)
        if remat is not OWN:
            policy = policy_of(remat)
            if (variant, policy) not in self._other_remat:
                self._other_remat[variant, policy] = self.jit(t.strategy.steps(t.layout.under(policy))[variant])
            return self._other_remat[variant, policy].lower(t.abstract_state(), abstract, inputs or {}).compile()
        compiled = self.lowered(variant, batch, inputs).compile()
        self.count((variant, shape_signature(abstract)))
        return compiled

    def lowered(self, variant: str, batch, inputs=None):
        """`Trainer.lowered_step`."""
        t = self._trainer
        return self.steps[variant].lower(t.abstract_state(), t.batches.abstract(batch), inputs or {})
