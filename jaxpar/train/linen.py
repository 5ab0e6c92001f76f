"""Use a Flax Linen module with jaxpar: `jaxpar.from_linen(module, *sample_inputs)` gives the NNX factory the
Trainer expects.

    factory = jaxpar.from_linen(MyLinenNet(), jnp.zeros((1, 64)))
    trainer = jaxpar.Trainer(model=factory, loss_fn=lambda model, batch: ..., optimizer=..., mesh=mesh)

The wrapped model is called like the Linen module (`model(x)`), and knows train from eval mode:
- training (`trainer.step`): `train_kwargs` are added to the call, every non-parameter collection the module has
  (BatchNorm's `batch_stats`, ...) is mutable and updated in the model state, and dropout gets a `dropout` rng
  (the call-time `rngs=` of a three-argument loss, or a stream derived from the model's own rngs);
- evaluation (`trainer.evaluate`): `eval_kwargs` are added instead, nothing is mutable, no rng is passed, and
  `eval_module` (if given) is applied instead of `module`: for modules whose deterministic switch is part of their
  configuration (Flax's Linen lm1b: `config.deterministic`), pass `eval_module=module.clone(config=eval_config)`.

A module whose `__call__` has a `train` (or `deterministic`) argument gets `train=True` in training and
`train=False` in evaluation (`deterministic=False` / `True`) unless `train_kwargs` / `eval_kwargs` are given; the
factory's `notes` say so (the Trainer logs them at start-up). A required argument nothing supplies is a `ModelError`
naming it. `batch_axis_names=("batch",)` binds the axis names of pmap-era collectives (`nn.BatchNorm(axis_name=
"batch")`) around every call (`jaxpar.train.axes`).

Linen parameters annotated with `nn.with_logical_partitioning(init, ("embed", "mlp"))` keep their logical names and
are sharded by the same rules as NNX ones.
"""

from __future__ import annotations

import inspect

import jax
from flax import linen, nnx
from flax.nnx.bridge import variables as bridge_vars

from jaxpar.errors import ModelError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.train.axes import bind, check_axis_names

# `__call__` arguments that switch a module between training and evaluation: name -> (training, evaluation) value
MODE_ARGUMENTS = {"train": (True, False), "deterministic": (False, True)}


class LinenModel(nnx.Module):
    """An NNX module around a Linen module (built by `from_linen`); `.eval()` / `.train()` switch its mode."""

    def __init__(self, module: linen.Module, sample_args, sample_kwargs, train_kwargs, eval_kwargs,
                 eval_module: linen.Module | None, rngs: nnx.Rngs, batch_axis_names: tuple[str, ...] = ()):
        init_kwargs = {**train_kwargs, **sample_kwargs}
        check_call(module, sample_args, init_kwargs, "the initialisation", "train_kwargs", "the sample inputs")
        self.linen = nnx.bridge.ToNNX(module, rngs=rngs)
        nnx.bridge.lazy_init(self.linen, *sample_args, **init_kwargs)
        self.train_kwargs, self.eval_kwargs = dict(train_kwargs), dict(eval_kwargs)
        self.eval_module = eval_module or module
        self.batch_axis_names = batch_axis_names
        self.deterministic = False  # set by nnx's .eval() / .train()

    def _variables(self) -> dict:
        attrs = {k: v for k, v in vars(self.linen).items()
                 if not k.startswith("to_nnx__") and not k.startswith("_pytree__")}
        return bridge_vars.nnx_attrs_to_linen_vars(attrs)

    def __call__(self, *args, rngs: nnx.Rngs | None = None, **kwargs):
        variables = self._variables()
        if self.deterministic:
            kwargs = merged(self.eval_module, args, self.eval_kwargs, kwargs)
            check_call(self.eval_module, args, kwargs, "the call in evaluation", "eval_kwargs")
            return bind(lambda: self.eval_module.apply(variables, *args, **kwargs), self.batch_axis_names)()
        streams = {name: stream() for name, stream in (rngs or self.linen.to_nnx__rngs).items()}
        base = streams.pop("default", None)
        if base is not None:
            streams.setdefault("params", base)
            streams.setdefault("dropout", jax.random.fold_in(base, 1))
        mutable = [name for name in variables if name != "params"]
        module = self.linen.to_nnx__module
        kwargs = merged(module, args, self.train_kwargs, kwargs)
        check_call(module, args, kwargs, "the call in training", "train_kwargs")
        out = bind(lambda: module.apply(variables, *args, rngs=streams, mutable=mutable or False, **kwargs),
                   self.batch_axis_names)()
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


def _call_parameters(module: linen.Module) -> dict:
    try:
        return dict(inspect.signature(module.__call__).parameters)
    except (TypeError, ValueError):  # no signature to read: nothing is inferred or checked
        return {}


def merged(module: linen.Module, args, mode_kwargs: dict, kwargs: dict) -> dict:
    """The keyword arguments of a call: the mode's (`train_kwargs` / `eval_kwargs`) under the call's own, leaving
    out those the call gives by position (`model(x, False)` wins over an inferred `train=True`)."""
    by_position = list(_call_parameters(module))[:len(args)]
    return {**{k: v for k, v in mode_kwargs.items() if k not in by_position}, **kwargs}


def check_call(module: linen.Module, args, kwargs, when: str, argument: str,
               elsewhere: str = "the call in the loss") -> None:
    """Refuses a call of `module` that leaves a required `__call__` argument out, naming it, `argument` (the
    from_linen argument that would give it) and where else it could be given."""
    parameters = _call_parameters(module)
    try:
        given = inspect.Signature(list(parameters.values())).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return  # too many or unknown arguments: Linen's own error says which
    missing = [name for name, p in parameters.items() if p.default is p.empty and name not in given
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        name = missing[0]
        raise ModelError(f"from_linen: {type(module).__name__}.__call__ needs the argument {name!r}, which "
                         f"{when} does not give: pass {argument}={{{name!r}: ...}} to jaxpar.from_linen, or give "
                         f"it in {elsewhere}")


def infer_mode_kwargs(module: linen.Module, sample_args, given: dict | None, mode: int) -> dict:
    """The `MODE_ARGUMENTS` `module.__call__` takes by keyword (and the sample inputs do not give by position), with
    their values for `mode` (0: training, 1: evaluation); {} when the user gave the kwargs (`given`)."""
    if given is not None:
        return {}
    parameters = _call_parameters(module)
    by_position = list(parameters)[:len(sample_args)]
    return {name: values[mode] for name, values in MODE_ARGUMENTS.items()
            if name in parameters and name not in by_position
            and parameters[name].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


class LinenFactory:
    """What `from_linen` returns: `factory(rngs) -> LinenModel`; `notes`: what it inferred, for the trainer to log."""

    def __init__(self, module, sample_args, sample_kwargs, train_kwargs, eval_kwargs, eval_module,
                 batch_axis_names):
        self.module, self.sample_args, self.sample_kwargs = module, sample_args, sample_kwargs
        self.eval_module, self.batch_axis_names = eval_module, batch_axis_names
        inferred_train = infer_mode_kwargs(module, sample_args, train_kwargs, 0)
        inferred_eval = infer_mode_kwargs(eval_module or module, (), eval_kwargs, 1)
        self.train_kwargs = {**inferred_train, **(train_kwargs or {})}
        self.eval_kwargs = {**inferred_eval, **(eval_kwargs or {})}
        self.notes = []
        if inferred_train or inferred_eval:
            said = [f"{', '.join(f'{k}={v}' for k, v in kwargs.items())} in {mode}"
                    for kwargs, mode in ((inferred_train, "training"), (inferred_eval, "evaluation")) if kwargs]
            self.notes.append(f"from_linen: {type(module).__name__}.__call__ takes "
                              f"{' / '.join(sorted({*inferred_train, *inferred_eval}))}: it is called with "
                              f"{' and '.join(said)} (pass train_kwargs / eval_kwargs to choose otherwise)")

    def __call__(self, rngs: nnx.Rngs) -> LinenModel:
        return LinenModel(self.module, self.sample_args, self.sample_kwargs, self.train_kwargs, self.eval_kwargs,
                          self.eval_module, rngs, self.batch_axis_names)


def factory_notes(factory) -> list[str]:
    """The start-up notes of a model factory (`from_linen`'s inferences); none for any other factory."""
    return list(factory.notes) if isinstance(factory, LinenFactory) else []


def from_linen(module: linen.Module, *sample_args, train_kwargs: dict | None = None, eval_kwargs: dict | None = None,
               eval_module: linen.Module | None = None, batch_axis_names=(), **sample_kwargs) -> LinenFactory:
    """A `rngs -> nnx.Module` factory that initialises `module` from the sample inputs (shapes matter only).

    train_kwargs / eval_kwargs: keyword arguments added to every call in training / evaluation. Default: when
    `module.__call__` takes `train`, `{"train": True}` / `{"train": False}`; when it takes `deterministic`,
    `{"deterministic": False}` / `{"deterministic": True}` (said in the factory's `notes`, which the Trainer logs);
    otherwise none. eval_module: the module applied in evaluation (default `module`). batch_axis_names: axis names
    the module's own collectives use (`nn.BatchNorm(axis_name="batch")` written for pmap), bound with size 1 around
    every call, so they reduce over the whole batch the call sees (`jaxpar.train.axes`). A required `__call__`
    argument that neither the call nor these supply raises `ModelError` naming it.

        factory = jaxpar.from_linen(ResNet(), jnp.zeros((1, 32, 32, 3)), batch_axis_names=("batch",))
    """
    names = check_axis_names(batch_axis_names, mesh_lib.AXES)
    return LinenFactory(module, sample_args, sample_kwargs, train_kwargs, eval_kwargs, eval_module, names)
