"""The order in which `Batches` visits a source's examples: an endless stream of example indices, epoch after epoch,
computed with numpy a whole array at a time.

Position p of the stream is example `order(p // n)[p % n]` of a source of n examples, where epoch e's order is a
permutation that is a pure function of (seed + e) mod 2**32 (or `arange(n)` without shuffling). The permutation is
the one grain's `MapDataset.range(n).shuffle(seed=seed).repeat(None)` gives at those positions, so a data position
saved by any jaxpar checkpoint means the same batch; `grain` computes it one index per Python call, this module for
a whole epoch (or a batch's positions) in one vectorized pass:

- a 4-round Feistel cipher of the Simon family on blocks of B bits (B: the bits of n - 1 rounded up to even, at
  least 16; each round x, y -> y ^ f(x) ^ k, with f(x) = (x <<< 1 & x <<< 8) ^ x <<< 2 on words of B/2 bits);
- the round keys: 4 words of C++'s `std::seed_seq{seed}.generate` (the algorithm the C++ standard specifies);
- cycle walking: a value encrypted to n or more is encrypted again until it falls in [0, n).

    stream = IndexStream(1497, seed=0)
    stream[np.arange(512, 1024)]    # the examples of the stream's positions 512..1023
"""

from __future__ import annotations

import math

import numpy as np

ROUNDS = 4  # grain's shuffle uses 4 rounds
MIN_BLOCK_BITS = 16
EPOCH_CACHE_EXAMPLES = 1 << 24  # up to this many examples an epoch's order is kept whole (int32/int64 per example)
_MASK32 = 0xFFFFFFFF


def round_keys(seed: int, count: int = ROUNDS) -> list[int]:
    """`count` 32-bit words of `std::seed_seq{seed}.generate(...)` ([rand.util.seedseq] of the C++ standard)."""
    n, entropy = count, [seed & _MASK32]
    out = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(len(entropy) + 1, n)

    def mix(x):
        return x ^ (x >> 27)

    for k in range(m):
        r1 = (1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n])) & _MASK32
        r2 = (r1 + (len(entropy) if k == 0 else k % n + entropy[k - 1] if k <= len(entropy) else k % n)) & _MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _MASK32)) & _MASK32
        r4 = (r3 - k % n) & _MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return out


def block_bits(max_index: int) -> int:
    bits = math.ceil(math.log2(float(max_index))) if max_index > 1 else 0
    return max(bits + bits % 2, MIN_BLOCK_BITS)


def _halves_dtype(word: int):
    return np.uint8 if word <= 8 else np.uint16 if word <= 16 else np.uint32


def _encrypt_halves(left: np.ndarray, right: np.ndarray, keys: list[int], word: int):
    """The cipher's rounds on the two halves of each block (unsigned arrays of at least `word` bits; bits shifted
    past the word are masked off), in place; returns (left, right)."""
    dtype = left.dtype.type
    mask = dtype((1 << word) - 1)

    def rotl(x, r):
        return ((x << dtype(r)) & mask) | (x >> dtype(word - r))

    def f(x):
        return (rotl(x, 1) & rotl(x, 8)) ^ rotl(x, 2)

    for k1, k2 in zip(keys[::2], keys[1::2]):
        left ^= f(right) ^ dtype(k1 & int(mask))
        right ^= f(left) ^ dtype(k2 & int(mask))
    return left, right


def _encrypt(values: np.ndarray, keys: list[int], word: int) -> np.ndarray:
    """The cipher on blocks of 2 * `word` bits (values uint64), each half in the smallest unsigned type that holds
    a word."""
    dtype, mask = _halves_dtype(word), np.uint64((1 << word) - 1)
    left, right = _encrypt_halves(((values >> np.uint64(word)) & mask).astype(dtype), (values & mask).astype(dtype),
                                  keys, word)
    return (left.astype(np.uint64) << np.uint64(word)) | right


def whole_permutation(n: int, seed: int) -> np.ndarray:
    """`permute(arange(n), n, seed)`, faster: the cipher once over its whole domain [0, 2**B), then cycle walking
    by pointer jumping: F sends a value below n to itself and any other value to its cipher image; squaring F
    (F = F[F], one gather over the domain) until most walks have ended, then stepping the few left, takes a few
    gathers rather than one pass per step of the longest walk."""
    if n <= 1:
        return np.zeros(n, np.int64)
    bits = block_bits(n - 1)
    if n > 2**bits or 2**bits < 4 * n:  # walking each value is as quick when the domain is not much above n
        return permute(np.arange(n), n, seed)  # (n > 2**bits: n - 1 a power of two of 16 bits or more)
    word = bits // 2  # the whole domain's halves are every (high, low) pair: built directly in their small type
    halves = np.arange(2**word, dtype=_halves_dtype(word))
    left, right = _encrypt_halves(np.repeat(halves, 2**word), np.tile(halves, 2**word), round_keys(seed % 2**32), word)
    target = left.astype(np.intp) << word | right  # (gathers by native indices: `take` converts nothing)
    jump = target.copy()
    jump[:n] = np.arange(n)  # F: every value below n is a fixed point, any other goes to its cipher image
    ends = target[:n].copy()  # each walk: its first cipher image, then F applied 1, 2, 4, ... times more
    while True:  # (values in cycles with no value below n never end: no walk reaches them)
        ends = jump.take(ends)
        pending = np.flatnonzero(ends >= n)
        if not pending.size:
            return ends.astype(np.int64)
        if 2 * pending.size < n:  # most walks have ended: step the rest alone rather than square F again
            break
        jump = jump.take(jump)
    while pending.size:
        ends[pending] = jump.take(ends[pending])
        pending = pending[ends[pending] >= n]
    return ends.astype(np.int64)


def permute(indices, n: int, seed: int) -> np.ndarray:
    """Where the permutation of range(n) for `seed` (32 bits) sends each of `indices` (int64, the same shape)."""
    indices = np.asarray(indices, np.int64)
    if n <= 1:
        return np.zeros_like(indices)
    if 4 * n <= 2**block_bits(n - 1) <= 2**MIN_BLOCK_BITS:  # a tiny source: each walk is ~2**16 / n steps long
        return whole_permutation(n, seed)[indices]
    keys, word = round_keys(seed % 2**32), block_bits(n - 1) // 2
    values = indices.ravel().astype(np.uint64)
    todo = np.arange(values.size)
    limit = np.uint64(n - 1)
    while todo.size:  # cycle walking: encrypt at least once, again while outside [0, n)
        values[todo] = _encrypt(values[todo], keys, word)
        todo = todo[values[todo] > limit]
    return values.astype(np.int64).reshape(indices.shape)


class IndexStream:
    """The examples at positions of the endless stream over a source of `n` examples (see the module docstring).
    `stream[positions]`: int64 example indices of the same shape. Epoch orders are computed whole (one array, kept
    for the two most recent epochs) while n <= EPOCH_CACHE_EXAMPLES, else per call for the positions asked."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        if shuffle and not 0 <= seed < 2**32:
            raise ValueError(f"seed {seed}: must be in [0, 2**32) to shuffle")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epochs: dict[int, np.ndarray] = {}

    def epoch(self, epoch: int) -> np.ndarray:
        """The whole order of `epoch` (example indices, a permutation of range(n))."""
        order = self._epochs.get(epoch)
        if order is None:
            dtype = np.int32 if self.n < 2**31 else np.int64
            order = (whole_permutation(self.n, self.seed + epoch) if self.shuffle
                     else np.arange(self.n)).astype(dtype)
            self._epochs = {e: o for e, o in self._epochs.items() if e == epoch - 1}  # the previous one stays
            self._epochs[epoch] = order
        return order

    def __getitem__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        epochs, within = np.divmod(positions, self.n)
        if not self.shuffle:
            return within
        first, last = (int(epochs.min()), int(epochs.max())) if positions.size else (0, -1)
        out = np.empty_like(within)
        for e in range(first, last + 1):  # a batch of at most n examples spans at most two epochs
            mask = None if first == last else epochs == e
            part = within if mask is None else within[mask]
            if self.n <= EPOCH_CACHE_EXAMPLES:
                got = self.epoch(e)[part]
            else:
                got = permute(part, self.n, self.seed + e)
            if mask is None:
                out[...] = got
            else:
                out[mask] = got
        return out
