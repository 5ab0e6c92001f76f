"""Use a Flax Linen module with jaxpar: `jaxpar.from_linen(module, *sample_inputs)` gives the NNX factory the
Trainer expects.

    factory = jaxpar.from_linen(MyLinenNet(), jnp.zeros((1, 64)))
    trainer = jaxpar.Trainer(model=factory, loss_fn=lambda m, b: ..., optimizer=..., mesh=mesh)

Linen parameters annotated with `nn.with_logical_partitioning(init, ("embed", "mlp"))` keep their logical names and
are sharded by the same rules as NNX ones. The wrapped model is called like the Linen module's `__call__`
(`model(x, train=True)`), with Linen collections such as `batch_stats` kept as non-parameter state. Dropout needs
`rngs=` at call time in Linen; pass a key derived from the batch, or use an NNX model for dropout.
"""

from __future__ import annotations

from flax import linen, nnx


def from_linen(module: linen.Module, *sample_args, **sample_kwargs):
    """A `rngs -> nnx.Module` factory that initialises `module` from the sample inputs (shapes matter only)."""

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        model = nnx.bridge.ToNNX(module, rngs=rngs)
        nnx.bridge.lazy_init(model, *sample_args, **sample_kwargs)
        return model

    return factory
