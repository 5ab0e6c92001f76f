"""Datasets that ship with the machine, and a deterministic, resumable, per-process global-batch pipeline.

Sources (random access by example index, never downloaded):
- digits: scikit-learn's 1,797 8x8 handwritten digits (bundled with the package), split 1,497 train / 300 test.
- text: bytes of a text file or a folder of text files (`--data`), or by default the Python standard library's
  `.py` files in sorted order; split train / validation by interleaved blocks (every 20th held out), each part cut
  into windows of seq_len + 1 bytes. A run keeps the corpus on disk (`jaxpar.io.corpus`): a window's bytes are read
  when its batch is drawn, so a process reads only the windows of its own rows.

`Batches` (`jaxpar.io.batches`, re-exported here) draws example indices from a shuffled, endlessly repeated index
stream (`jaxpar.io.index_stream`: a new permutation every epoch, a pure function of (seed, epoch)), so a batch is a
pure function of its position in that stream: the iterator state is two integers and restores exactly. Each
process loads only its own rows of the global batch: it computes the indices of those rows only, and asks the
source for those examples only. Batches may be built ahead in a background thread (`read_ahead`);
`prefetch_to_device` keeps the next batches' host-to-device copies in flight while the current step runs.
"""

from __future__ import annotations

import numpy as np

# (re-exported: defined in jaxpar.io.batches, as they were here before the batches had their own module)
from jaxpar.io.batches import DEFAULT_READ_AHEAD, ArraySource, Batches, prefetch_to_device  # noqa: F401
from jaxpar.errors import DataError
from jaxpar.io.corpus import BlockSplit, open_corpus
# (re-exported: these were defined here before the corpus had its own module)
from jaxpar.io.corpus import DEFAULT_CORPUS_BYTES, TEXT_BLOCK_BYTES, split_corpus, text_block_size  # noqa: F401
from jaxpar.io.corpus_files import binary_note, default_corpus_files, path_kind  # noqa: F401

DIGITS_TEST_SIZE = 300


# --- sources -----------------------------------------------------------------------------------------------------
class TextWindows:
    """Example k is the window tokens[k*seq_len : k*seq_len + seq_len + 1] ({"tokens": int32 [seq_len + 1]}).
    `tokens`: uint8 bytes in memory, or a `jaxpar.io.corpus.CorpusPart` (only the windows asked for are read)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.seq_len, 0)

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        starts = np.asarray(indices, np.int64) * self.seq_len
        if hasattr(self.tokens, "runs"):  # a corpus part on disk: one read per window, no per-byte arithmetic
            return {"tokens": self.tokens.runs(starts, self.seq_len + 1).astype(np.int32)}
        return {"tokens": self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int32)}


def load_digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test) dicts with "image" float32 [N, 8, 8, 1] in [0, 1] and "label" int32 [N]."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = (bunch.images.astype(np.float32) / 16.0)[..., None]
    labels = bunch.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))  # a fixed split, whatever the run's seed
    test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    return {"image": images[train], "label": labels[train]}, {"image": images[test], "label": labels[test]}


def load_text(path: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The whole corpus in memory as uint8 tokens (byte-level: vocabulary 256). A run reads only its windows
    instead (`jaxpar.io.corpus.open_corpus` and `split_corpus`); this is for small corpora and benchmarks."""
    corpus = open_corpus(path, max_bytes)
    try:
        return np.frombuffer(corpus.read(0, len(corpus)), dtype=np.uint8)
    finally:
        corpus.close()


def split_text(tokens: np.ndarray, validation_fraction: float = 0.05,
               seq_len: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) tokens: the corpus cut into blocks of `text_block_size` bytes; with period =
    round(1 / validation_fraction), block k is held out when k % period == period // 2, the rest are training
    (`jaxpar.io.corpus.BlockSplit`; `split_corpus` is the same split of a corpus on disk, read lazily).

    Why interleaved blocks: the default corpus is the standard library in sorted path order, so its tail (the last
    files alphabetically) is different text from the rest; every 20th block samples the whole corpus evenly (about
    50 validation blocks of 4 KiB in the default 4 MiB), so held-out loss estimates the loss on the training
    distribution. Blocks, not whole files, because `--data` may be a single file, the realised fraction stays
    1 / period whatever the file sizes, and a 5 KiB corpus still gets a held-out block. The price: a validation
    block's neighbours (often the same source file) are training text, so held-out loss measures generalisation to
    unseen passages of seen files, not to unseen files.

    Each part is its blocks concatenated in order; no byte is in both and together they are the whole corpus.
    Blocks are multiples of seq_len, so with the run's seq_len each window `TextWindows` cuts from a part has its
    inputs inside one block and only its last target byte may come from the next block of the same part; whatever
    seq_len, no window mixes the parts. The split is a pure function of (len(tokens), validation_fraction, seq_len).
    """
    split = BlockSplit.of(len(tokens), validation_fraction, seq_len)
    held_out = split.held_out(np.arange(len(tokens)) // split.block)
    return tokens[~held_out], tokens[held_out]


def array_batches(arrays: dict[str, np.ndarray], global_batch, seed: int, name: str = "dataset",
                  largest_batch: int | None = None, read_ahead: int = 0) -> Batches:
    return Batches(ArraySource(arrays), global_batch, seed, name, largest_batch=largest_batch, read_ahead=read_ahead)


def text_batches(tokens: np.ndarray, global_batch, seq_len: int, seed: int, name: str = "text",
                 largest_batch: int | None = None, read_ahead: int = 0) -> Batches:
    if len(tokens) < seq_len + 1:
        raise DataError(f"{name} has {len(tokens)} bytes, fewer than one sequence of {seq_len + 1}; "
                        f"use --seq-len {max(len(tokens) - 1, 1)} or less, or more text")
    return Batches(TextWindows(tokens, seq_len), global_batch, seed, name, largest_batch=largest_batch,
                   read_ahead=read_ahead)
