"""Ring attention: each device keeps its query block and passes its key / value block around the seq axis with
`ppermute`, S steps, merging each arriving block into an online softmax (`blocks.merge`), so no device ever holds
more than two blocks of K/V (its own and the one in flight): memory O(L / S) where the all-gather needs O(L). Each
step is rematerialised in the backward pass, so only its inputs (the running state and the block) are kept.

Each step's permute is issued before the step's compute, so XLA may overlap the transfer of the next block with
the current one's scores. Under a causal mask, blocks wholly in a device's future are skipped (`lax.switch`) and
the zig-zag layout balances what is left (`zigzag`). Runs inside a map manual over the seq axis.
"""

from __future__ import annotations

import jax
from jax import lax

from jaxpar.parallel.context import blocks, zigzag


def ring_attention(q, k, v, axis: str, ways: int, causal: bool, scale: float, balanced: bool):
    """This device's output for its blocks q, k, v [B, L/S, H, K] (contiguous blocks in, contiguous out)."""
    if balanced:
        q, k, v = (zigzag.to_zigzag(x, axis, ways) for x in (q, k, v))
    me = lax.axis_index(axis)
    block = q.shape[1]
    q_pos = zigzag.positions(me, ways, block, balanced)
    half = block // 2

    def full(state, k, v, k_pos):
        return blocks.merge(state, q, k, v, q_pos, k_pos, causal, scale)

    def skip(state, k, v, k_pos):
        return state

    def keys_first(state, k, v, k_pos):  # zig-zag, keys of an earlier device: only their first chunk is visible
        return blocks.merge(state, q, k[:, :half], v[:, :half], q_pos, k_pos[:half], causal, scale)

    def queries_second(state, k, v, k_pos):  # zig-zag, keys of a later device: only the second query chunk sees them
        m, denom, out = state
        part = (m[:, :, half:], denom[:, :, half:], out[:, half:])
        m2, d2, o2 = blocks.merge(part, q[:, half:], k, v, q_pos[half:], k_pos, causal, scale)
        return (m.at[:, :, half:].set(m2), denom.at[:, :, half:].set(d2), out.at[:, half:].set(o2))

    branches = [None] * 4
    branches[zigzag.FULL], branches[zigzag.SKIP] = full, skip
    branches[zigzag.KEYS_FIRST], branches[zigzag.QUERIES_SECOND] = keys_first, queries_second
    # each step recomputed in the backward pass (flash attention's trade): without it autodiff of `lax.switch` keeps
    # every branch's residuals, the scores of a whole block per branch and step
    step = jax.checkpoint(lambda state, k, v, k_pos, kind: lax.switch(kind, branches, state, k, v, k_pos),
                          policy=jax.checkpoint_policies.nothing_saveable)
    shift = [(i, (i + 1) % ways) for i in range(ways)]
    state = blocks.empty(q)
    for t in range(ways):
        theirs = (me - t) % ways
        if t < ways - 1:  # the next block leaves before this one is used
            k_next, v_next = lax.ppermute(k, axis, shift), lax.ppermute(v, axis, shift)
        k_pos = zigzag.positions(theirs, ways, block, balanced)
        kind = zigzag.step_kind(me, theirs, causal, balanced)
        state = step(state, k, v, k_pos, kind)
        if t < ways - 1:
            k, v = k_next, v_next
    out = blocks.finish(state, v.dtype)
    return zigzag.from_zigzag(out, axis, ways) if balanced else out
