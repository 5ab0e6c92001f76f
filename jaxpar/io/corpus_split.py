"""The training and held-out parts of a text corpus: interleaved blocks (`BlockSplit`, the one place that says which
blocks are held out), and a part of a corpus on disk read through it (`CorpusPart`), with no byte read until asked.
`jaxpar.io.data.split_text` applies the same rule to bytes in memory; `jaxpar.io.corpus` reads the bytes."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

TEXT_BLOCK_BYTES = 4096  # target size of the interleaved train / validation blocks


# --- the train / validation split ------------------------------------------------------------------------------------
def text_block_size(length: int, seq_len: int = 128, period: int = 20) -> int:
    """Bytes per block of the split: a multiple of seq_len, about TEXT_BLOCK_BYTES, never below two windows, and
    small enough that a corpus of `length` bytes has at least `period` blocks when it can."""
    windows = max(2, min(max(TEXT_BLOCK_BYTES // seq_len, 1), length // (period * seq_len)))
    return windows * seq_len


class BlockSplit(NamedTuple):
    """A corpus of `length` bytes cut into blocks of `block` bytes; block k is held out when
    k % period == period // 2 (see `jaxpar.io.data.split_text` for why). Each part is its blocks in corpus order."""

    length: int
    block: int
    period: int

    @classmethod
    def of(cls, length: int, validation_fraction: float = 0.05, seq_len: int = 128) -> BlockSplit:
        if not 0 < validation_fraction <= 0.5:
            raise ValueError(f"validation_fraction {validation_fraction}: must be in (0, 0.5]")
        period = round(1 / validation_fraction)
        return cls(length, text_block_size(length, seq_len, period), period)

    def held_out(self, block_index):
        return block_index % self.period == self.period // 2

    def part_length(self, held_out: bool) -> int:
        blocks = -(-self.length // self.block)
        first = self.period // 2  # the first held-out block
        held = max(0, -(-(blocks - first) // self.period)) * self.block
        if blocks and self.held_out(blocks - 1):  # the last block (maybe short) is held out
            held -= blocks * self.block - self.length
        return held if held_out else self.length - held

    def corpus_positions(self, positions: np.ndarray, held_out: bool) -> np.ndarray:
        """Corpus positions of the part's byte `positions` (pure arithmetic: only the last block can be short, and
        it is the last block of its part)."""
        block, within = np.divmod(np.asarray(positions, np.int64), self.block)
        if held_out:
            corpus_block = block * self.period + self.period // 2
        else:  # a period's training blocks: the period - 1 blocks other than its held-out one
            period_index, k = np.divmod(block, self.period - 1)
            corpus_block = period_index * self.period + k + (k >= self.period // 2)
        return corpus_block * self.block + within


class CorpusPart:
    """The training (held_out=False) or held-out part of a corpus: `part[positions]` reads the part's bytes."""

    def __init__(self, corpus, split: BlockSplit, held_out: bool):
        self.corpus, self.split, self.held_out = corpus, split, held_out
        self._length = split.part_length(held_out)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self._length):
            raise IndexError(f"positions must be in [0, {self._length})")
        return self.corpus[self.split.corpus_positions(positions, self.held_out)]

    def runs(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The part's bytes [start, start + length) for each of `starts`, as [len(starts), length] uint8: a run
        inside one block is one corpus run; one that crosses into the part's next block is two."""
        starts = np.asarray(starts, np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > self._length):
            raise IndexError(f"runs must lie in [0, {self._length})")
        block = self.split.block
        if length > block:
            return self[starts[:, None] + np.arange(length)]
        head = np.minimum(block - starts % block, length)  # bytes in the first block; the rest in the next one
        first = self.split.corpus_positions(starts, self.held_out)
        cross = np.flatnonzero(head < length)
        second = self.split.corpus_positions(starts[cross] + head[cross], self.held_out)
        apart = second != first[cross] + head[cross]  # the part's next block is not the corpus's next: two runs
        cross, second = cross[apart], second[apart]
        lengths = np.full(len(starts), length, np.int64)
        lengths[cross] = head[cross]
        rows = self.corpus.rows(np.concatenate((first, second)), np.concatenate((lengths, length - head[cross])),
                                width=length)
        out = rows[:len(starts)]
        if len(cross):  # the few windows in two runs: the second run's bytes follow the first's
            column = np.arange(length)
            tail = rows[len(starts) + np.arange(len(cross))[:, None], np.maximum(column - head[cross, None], 0)]
            out[cross] = np.where(column < head[cross, None], out[cross], tail)
        return out

def split_corpus(corpus, validation_fraction: float = 0.05, seq_len: int = 128) -> tuple[CorpusPart, CorpusPart]:
    """(training part, held-out part) of `corpus`, equal byte for byte to `split_text` of its bytes; reads nothing."""
    split = BlockSplit.of(len(corpus), validation_fraction, seq_len)
    return CorpusPart(corpus, split, False), CorpusPart(corpus, split, True)
