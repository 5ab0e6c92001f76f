"""The ring's schedule over a causal mask, and the zig-zag layout that balances it.

Contiguous blocks: device i holds positions [i L/S, (i+1) L/S). Under a causal mask, at ring step t device i holds
the keys of device j = (i - t) mod S: earlier blocks (j < i) count whole, its own (j = i) half, later ones nothing
and are skipped, so device S-1 computes S - 1/2 blocks' worth and device 0 one half: the slowest sets the pace.

Zig-zag (Megatron's / torchtitan's head-tail): the sequence cut into 2S chunks, device i holds chunks i and 2S-1-i.
Then every step t > 0 is half a block on every device (keys of an earlier device: both query chunks see the keys'
first chunk; of a later device: only the query's second chunk sees them, both key chunks), and step 0 is the
diagonal, the same on every device: S - 1 halves plus one block each. `work` counts it.
The attention helper re-lays q, k and v from contiguous to zig-zag with two `ppermute`s (a chunk each) and the
output back, so everything outside attention (RoPE, dropout, the loss) keeps the contiguous layout.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

FULL, SKIP, KEYS_FIRST, QUERIES_SECOND = 0, 1, 2, 3  # the ring step's branches (KEYS_FIRST etc.: zig-zag halves)


def step_kind(mine, theirs, causal: bool, zigzag: bool):
    """Which branch device `mine` runs on the keys of device `theirs` (ints or traced)."""
    if not causal:
        return FULL if isinstance(mine, int) else jnp.int32(FULL)
    if isinstance(mine, int):
        if mine == theirs:
            return FULL
        if zigzag:
            return KEYS_FIRST if theirs < mine else QUERIES_SECOND
        return FULL if theirs < mine else SKIP
    later = QUERIES_SECOND if zigzag else SKIP
    earlier = KEYS_FIRST if zigzag else FULL
    return jnp.where(mine == theirs, FULL, jnp.where(theirs < mine, earlier, later)).astype(jnp.int32)


def work(ways: int, causal: bool = True, zigzag: bool = True) -> list[float]:
    """Query-key pairs each device scores (unmasked and computed), in units of (L / S)^2, over the S ring steps: the
    balance of the schedule `step_kind` gives. The diagonal step computes the whole block (its mask is applied,
    not skipped), so it counts 1."""
    out = []
    for i in range(ways):
        total = 0.0
        for t in range(ways):
            kind = step_kind(i, (i - t) % ways, causal, zigzag)
            total += {FULL: 1.0, SKIP: 0.0, KEYS_FIRST: 0.5, QUERIES_SECOND: 0.5}[kind]
        out.append(total)
    return out


def positions(index, ways: int, block: int, zigzag: bool):
    """The global positions of the `block` positions device `index` holds."""
    if not zigzag:
        return index * block + jnp.arange(block)
    chunk = block // 2
    return jnp.concatenate([index * chunk + jnp.arange(chunk), (2 * ways - 1 - index) * chunk + jnp.arange(chunk)])


def _home(chunk: int, ways: int) -> int:
    """The device that holds chunk `chunk` (of 2S) in the zig-zag layout."""
    return chunk if chunk < ways else 2 * ways - 1 - chunk


def _send(x, axis: str, pairs):
    """`ppermute` over `pairs`, or `x` itself when every device keeps its own (the first chunks on seq=2)."""
    return x if all(a == b for a, b in pairs) else lax.ppermute(x, axis, pairs)


def to_zigzag(x, axis: str, ways: int):
    """[B, 2c, ...] contiguous block (chunks 2i and 2i+1) -> this device's zig-zag block (chunks i and 2S-1-i)."""
    c = x.shape[1] // 2
    first = _send(x[:, :c], axis, [(i, _home(2 * i, ways)) for i in range(ways)])
    second = _send(x[:, c:], axis, [(i, _home(2 * i + 1, ways)) for i in range(ways)])
    even = lax.axis_index(axis) % 2 == 0  # chunk i came as someone's first chunk when i is even
    return jnp.where(even, jnp.concatenate([first, second], 1), jnp.concatenate([second, first], 1))


def from_zigzag(x, axis: str, ways: int):
    """The inverse of `to_zigzag`."""
    c = x.shape[1] // 2
    even = lax.axis_index(axis) % 2 == 0
    first_chunk = jnp.where(even, x[:, :c], x[:, c:])  # the chunk that travelled as a first chunk
    second_chunk = jnp.where(even, x[:, c:], x[:, :c])
    first = _send(first_chunk, axis, [(_home(2 * i, ways), i) for i in range(ways)])
    second = _send(second_chunk, axis, [(_home(2 * i + 1, ways), i) for i in range(ways)])
    return jnp.concatenate([first, second], 1)


def imbalance(ways: int, causal: bool = True, zigzag: bool = True) -> float:
    """(max - min) / max of `work` across devices."""
    w = np.asarray(work(ways, causal, zigzag))
    return float((w.max() - w.min()) / w.max())
