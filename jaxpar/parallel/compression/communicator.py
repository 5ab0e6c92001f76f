"""The compressed communicator: a `Communicator` whose replica-axis exchange is wrapped by a codec, its state
(per-replica and shared parts) and the bytes its exchange sends."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.parallel.collectives.algorithms import theoretical_traffic
from jaxpar.parallel.collectives.communicators import Communicator, communicator
from jaxpar.parallel.compression.codec_names import parse_codec
from jaxpar.parallel.compression.exchange import Exchange

OWN, SHARED = "own", "shared"  # the two parts of a compressed communicator's state (see partitioning)


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

    def mean(self, tree, state, axis_name: str, shardings=None, groups=None):
        """`shardings`: the params-shaped NamedShardings of `tree` inside a replica, for a whole-array codec
        (PowerSGD) on a replica of several devices: each device then sends its own part of the factors. `groups`:
        per leaf, the within-replica axes it is split over (`Exchange`; None: unknown)."""
        leaves, treedef = jax.tree.flatten(tree)
        own = jax.tree.leaves(state[OWN])
        own = [x[0] for x in own] if own else own
        n = lax.axis_size(axis_name)
        layout = None if shardings is None else [
            (s, x.shape) for s, x in zip(jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "spec")), leaves)]
        exchange = Exchange(axis_name, self.name, self.torus_x, layout, groups)
        means, own, shared = self.codec.mean(leaves, own, state[SHARED], exchange, n, axis_name)
        new_own = jax.tree.unflatten(jax.tree.structure(state[OWN]), [x[None] for x in own]) if own else state[OWN]
        return jax.tree.unflatten(treedef, means), {OWN: new_own, SHARED: shared}

    def traffic(self, shard_shapes, n: int, splits=None) -> list[dict]:
        """Per collective of the codec's exchange: {"collective", "bytes_sent_per_device" (the busiest device's),
        "steps"}, for gradients whose per-device shapes are `shard_shapes` over `n` replicas (a whole-array codec:
        the whole shapes, and `splits`, how each is cut inside a replica; `jaxpar.cost.codecs.gradient_splits`).
        All-reduces as `theoretical_traffic` of this algorithm; an all-to-all: (N-1)/N x payload in N-1 steps;
        all-gathers: (N-1) x payload in N-1 steps on a ring or torus2d, (N-1) x N x payload at the ps root; psum's
        all-gather like a ring. A two-shot codec (an all-to-all) on ps: a push and a pull of the whole payload, the
        root sending (N-1) x it."""
        shapes = [tuple(s) for s in shard_shapes]
        if splits is not None:
            payload = self.codec.payload(shapes, n, splits)
        else:
            payload = self.codec.payload(shapes, n)
            if self.name == "ps" and "all-to-all" in payload:
                whole = self.codec.payload(shapes, 1)["all-gather"]
                return [{"collective": "push + pull", "bytes_sent_per_device": (n - 1) * whole, "steps": 2 * (n - 1)}]
        out = []
        for kind, nbytes in payload.items():
            if kind == "all-to-all":
                out.append({"collective": kind, "bytes_sent_per_device": (n - 1) * nbytes / n, "steps": n - 1})
            elif kind == "all-gather":
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
    base = communicator(base)
    codec = parse_codec(codec) if codec is None or isinstance(codec, str) else codec
    return base if codec is None else CompressedCommunicator(base, codec)
