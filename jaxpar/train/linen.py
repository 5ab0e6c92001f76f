"""Use a Flax Linen module with jaxpar: `jaxpar.from_linen(module, *sample_inputs)` gives the NNX factory the
Trainer expects.

    factory = jaxpar.from_linen(MyLinenNet(), jnp.zeros((1, 64)),
                                train_kwargs={"train": True}, eval_kwargs={"train": False})
    trainer = jaxpar.Trainer(model=factory, loss_fn=lambda model, batch: ..., optimizer=..., mesh=mesh)

The wrapped model is called like the Linen module (`model(x)`), and knows train from eval mode:
- training (`trainer.step`): `train_kwargs` are added to the call, every non-parameter collection the module has
  (BatchNorm's `batch_stats`, ...) is mutable and updated in the model state, and dropout gets a `dropout` rng
  (the call-time `rngs=` of a three-argument loss, or a stream derived from the model's own rngs);
- evaluation (`trainer.evaluate`): `eval_kwargs` are added instead, nothing is mutable, no rng is passed, and
  `eval_module` (if given) is applied instead of `module`: for modules whose deterministic switch is part of their
  configuration (Flax's Linen lm1b: `config.deterministic`), pass `eval_module=module.clone(config=eval_config)`.

Linen parameters annotated with `nn.with_logical_partitioning(init, ("embed", "mlp"))` keep their logical names and
are sharded by the same rules as NNX ones.
"""

from __future__ import annotations

import jax
from flax import linen, nnx
from flax.nnx.bridge import variables as bridge_vars


class LinenModel(nnx.Module):
    """An NNX module around a Linen module (built by `from_linen`); `.eval()` / `.train()` switch its mode."""

    def __init__(self, module: linen.Module, sample_args, sample_kwargs, train_kwargs, eval_kwargs,
                 eval_module: linen.Module | None, rngs: nnx.Rngs):
        self.linen = nnx.bridge.ToNNX(module, rngs=rngs)
        nnx.bridge.lazy_init(self.linen, *sample_args, **{**train_kwargs, **sample_kwargs})
        self.train_kwargs, self.eval_kwargs = dict(train_kwargs), dict(eval_kwargs)
        self.eval_module = eval_module or module
        self.deterministic = False  # set by nnx's .eval() / .train()

    def _variables(self) -> dict:
        attrs = {k: v for k, v in vars(self.linen).items()
                 if not k.startswith("to_nnx__") and not k.startswith("_pytree__")}
        return bridge_vars.nnx_attrs_to_linen_vars(attrs)

    def __call__(self, *args, rngs: nnx.Rngs | None = None, **kwargs):
        variables = self._variables()
        if self.deterministic:
            return self.eval_module.apply(variables, *args, **{**self.eval_kwargs, **kwargs})
        streams = {name: stream() for name, stream in (rngs or self.linen.to_nnx__rngs).items()}
        base = streams.pop("default", None)
        if base is not None:
            streams.setdefault("params", base)
            streams.setdefault("dropout", jax.random.fold_in(base, 1))
        mutable = [name for name in variables if name != "params"]
        out = self.linen.to_nnx__module.apply(variables, *args, rngs=streams, mutable=mutable or False,
                                              **{**self.train_kwargs, **kwargs})
        if not mutable:
            return out
        out, updates = out
        for name, tree in bridge_vars.linen_vars_to_nnx_attrs(updates).items():
            # update the existing variables in place: new ones would carry other metadata (a recompilation)
            _assign(getattr(self.linen, name), tree)
        return out


def _assign(old, new) -> None:
    """Writes the values of `new` (a nested dict of Variables, a subset of `old`'s keys) into `old`'s variables."""
    if isinstance(new, nnx.Variable):
        old.set_value(new.get_value())
        return
    for key, value in new.items():
        _assign(old[key], value)


def from_linen(module: linen.Module, *sample_args, train_kwargs: dict | None = None, eval_kwargs: dict | None = None,
               eval_module: linen.Module | None = None, **sample_kwargs):
    """A `rngs -> nnx.Module` factory that initialises `module` from the sample inputs (shapes matter only).

    train_kwargs / eval_kwargs: keyword arguments added to every call in training / evaluation (e.g.
    `{"train": True}` / `{"train": False}`); eval_module: the module applied in evaluation (default `module`).
    """

    def factory(rngs: nnx.Rngs) -> nnx.Module:
        return LinenModel(module, sample_args, sample_kwargs, train_kwargs or {}, eval_kwargs or {}, eval_module,
                          rngs)

    return factory
