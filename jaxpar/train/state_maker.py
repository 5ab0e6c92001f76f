"""How a Trainer's train state is made: from the model factory and a seed, first the strategy-free ("neutral") state
every strategy's state reduces to, then the strategy's own (`Strategy.init`); its shapes and bytes per device without
computing it; a fresh state, created already sharded inside `jax.jit(..., out_shardings=...)` once its bytes are
known to fit a device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar.checks import check_int
from jaxpar.errors import ResourceError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel import partitioning as shd
from jaxpar.runtime.resources import check_fits
from jaxpar.train.model_errors import call_factory
from jaxpar.train.step import TrainState, split_model


class StateMaker:
    """Makes the train states of one trainer (`factory`, optimizer `tx`, its StepContext, strategy and shardings)."""

    def __init__(self, factory, tx, ctx, strategy, mesh, neutral_shardings, state_shardings):
        self._factory, self._tx, self._ctx, self._strategy, self._mesh = factory, tx, ctx, strategy, mesh
        self._neutral_shardings, self._shardings = neutral_shardings, state_shardings
        # on an Explicit mesh every trace happens under jax.set_mesh (mesh_lib.tracing), outside jit
        self._init = mesh_lib.in_mesh(jax.jit(self.full, out_shardings=state_shardings), mesh)
        self._bytes: int | None = None

    def neutral(self, seed) -> TrainState:
        """The state before the strategy adds its own: what any strategy's state reduces to (`Strategy.reduce`; a
        restore goes through it)."""
        with nnx.use_eager_sharding(False):
            model = call_factory(self._factory, nnx.Rngs(jax.random.key(seed)))
        _, params, model_state = split_model(model)
        comm = self._ctx.communicator
        # the run key: a separate stream from initialisation's (same seed, another fold)
        return TrainState(jnp.zeros((), jnp.int32), params, model_state, self._tx.init(params), (),
                          jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
                          () if comm is None else comm.init_state(params, self._ctx.num_replicas))

    def expanded(self, neutral: TrainState) -> TrainState:
        return self._strategy.init(self._ctx, neutral)

    def full(self, seed) -> TrainState:
        return self.expanded(self.neutral(seed))

    def expand(self, neutral: TrainState) -> TrainState:
        """`Trainer.expand`: the strategy's state from a strategy-free one, jitted and placed."""
        return mesh_lib.in_mesh(jax.jit(self.expanded, out_shardings=self._shardings), self._mesh)(neutral)

    def abstract(self, neutral: bool = False) -> TrainState:
        """`Trainer.abstract_state`."""
        seed = jnp.asarray(0, jnp.uint32)
        with mesh_lib.tracing(self._mesh):
            if neutral:
                shapes, shardings = jax.eval_shape(self.neutral, seed), self._neutral_shardings
            else:  # the jitted init's own trace: `init` then reuses it
                shapes, shardings = self._init.eval_shape(seed), self._shardings
        leaves, treedef = jax.tree.flatten(shapes)
        placed = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
        return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                            for x, s in zip(leaves, placed, strict=True)])

    def bytes_per_device(self) -> int:
        """`Trainer.state_bytes_per_device`."""
        if self._bytes is None:
            with mesh_lib.tracing(self._mesh):
                abstract = self._init.eval_shape(jnp.asarray(0, jnp.uint32))  # traced once, with `init`
            self._bytes = shd.bytes_per_device(abstract, self._shardings)
        return self._bytes

    def init(self, seed: int) -> TrainState:
        """`Trainer.init`: refused before anything is allocated when it cannot fit in one device's memory."""
        check_int("seed", seed, 0, high=2**32)
        check_fits(self.bytes_per_device(), self._mesh, "the train state", "use a smaller model, or split "
                   "parameters and optimizer state over more devices (a larger fsdp or model axis)")
        state = self._init(jnp.asarray(seed, jnp.uint32))
        try:
            # A device error (e.g. out of memory) surfaces here at once; reading `state.step` first would wait
            # forever on XLA:CPU (the failed computation never marks that buffer ready).
            jax.block_until_ready((state.params, state.opt_state, state.strategy_state))
        except jax.errors.JaxRuntimeError as error:
            raise ResourceError(f"creating the train state failed on the device: {str(error).splitlines()[0]}; "
                                f"it needs {self.bytes_per_device():,} bytes per device: use a smaller model "
                                f"or split it over more devices (fsdp / model axes)") from None
        return state
