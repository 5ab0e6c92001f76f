"""Datasets that ship with the machine, and a deterministic, resumable, per-process global-batch pipeline.

Sources (random access by example index, never downloaded):
- digits: scikit-learn's 1,797 8x8 handwritten digits (bundled with the package), split 1,497 train / 300 test.
- text: bytes of a text file or a folder of text files (`--data`), or by default the Python standard library's
  `.py` files in sorted order; split train / validation by interleaved blocks (every 20th held out), each part cut
  into windows of seq_len + 1 bytes. A run keeps the corpus on disk (`jaxpar.io.corpus`): a window's bytes are read
  when its batch is drawn, so a process reads only the windows of its own rows.
- synthetic: seeded random images or tokens of any size, for benchmarks.

`Batches` draws example indices from grain's shuffled, endlessly repeated index stream (a new permutation every
epoch, a pure function of (seed, epoch)), so a batch is a pure function of its position in that stream: the
iterator state is two integers and restores exactly. Each process loads only its own rows of the global batch:
it computes the indices of those rows only, and asks the source for those examples only.
`prefetch_to_device` keeps the next batches' host-to-device copies in flight while the current step runs.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import numpy as np

from jaxpar.errors import DataError
from jaxpar.io.corpus import BlockSplit, open_corpus
from jaxpar.io.index_stream import IndexStream
from jaxpar.io.read_ahead import ReadAhead
# (re-exported: these were defined here before the corpus had its own module)
from jaxpar.io.corpus import (DEFAULT_CORPUS_BYTES, TEXT_BLOCK_BYTES, binary_note,  # noqa: F401
                              default_corpus_files, path_kind, split_corpus, text_block_size)

DIGITS_TEST_SIZE = 300


# --- sources -----------------------------------------------------------------------------------------------------
class ArraySource:
    """Examples are rows of equally long arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[indices] for k, v in self.arrays.items()}


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


class SyntheticSource:
    """Seeded random examples (`kind` "image": 8x8x1 images + 10 labels; "tokens": byte sequences)."""

    def __init__(self, kind: str = "image", size: int = 4096, seq_len: int = 128, seed: int = 0):
        rng = np.random.default_rng(seed)
        if kind == "image":
            self._source = ArraySource({"image": rng.random((size, 8, 8, 1), dtype=np.float32),
                                        "label": rng.integers(0, 10, size).astype(np.int32)})
        else:
            self._source = TextWindows(rng.integers(0, 256, size * seq_len + 1).astype(np.uint8), seq_len)

    def __len__(self):
        return len(self._source)

    def __getitem__(self, indices):
        return self._source[indices]


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


# --- batches -----------------------------------------------------------------------------------------------------
DEFAULT_READ_AHEAD = 2  # batches a training run builds ahead (run.py); the library's default builds none ahead


class _Draw:
    """cursor (position, step) -> (this process's rows of that global batch, the next cursor): a pure function, run
    in the read-ahead thread or inline. Holds no reference to its `Batches` (so a dropped one stops its thread)."""

    def __init__(self, source, stream: IndexStream, size_at, rows):
        self.source, self.stream, self.size_at, self.rows = source, stream, size_at, rows
        self._rows: dict[int, np.ndarray] = {}  # global size -> row positions (a pure function of the size)

    def __call__(self, cursor: tuple[int, int]):
        position, step = cursor
        size = self.size_at(step)
        if self.rows is None:
            indices = self.stream[np.arange(position, position + size)]
        else:
            rows = self._rows.get(size)
            if rows is None:
                rows = self._rows[size] = np.asarray(self.rows(size), np.int64)
            indices = self.stream[position + rows]
        return self.source[indices], (position + size, step + 1)


class Batches(Iterator):
    """Endless global batches (this process's rows of them) from a source, in a seeded order.

    `source`: anything with `__len__` and `__getitem__(indices: int64 array) -> dict of arrays` (or a dict of equally
    long arrays). `batch_size` is an int or a function step -> int (a batch-size ramp). Every epoch is a fresh
    permutation (`jaxpar.io.index_stream`); a batch may straddle two epochs, so no example is dropped or repeated
    within an epoch. `rows`: global batch size -> the row positions this process loads (`Trainer.local_rows`); None
    loads every row (one process). `read_ahead`: how many batches a background thread builds ahead
    (`jaxpar.io.read_ahead`; 0 builds each in `next`). The state (`get_state`) is always that of the next batch
    `next` returns, whatever was built ahead; `close()` (or `with`) stops the thread.
    """

    def __init__(self, source, batch_size: int | Callable[[int], int], seed: int, name: str = "dataset",
                 shuffle: bool = True, largest_batch: int | None = None,
                 rows: Callable[[int], np.ndarray] | None = None, read_ahead: int = 0):
        source = ArraySource(source) if isinstance(source, dict) else source
        self.source, self.name, self.read_ahead = source, name, read_ahead
        self._size_at = batch_size if callable(batch_size) else (lambda step: batch_size)
        largest = largest_batch or self._size_at(0)
        if len(source) < largest:
            raise DataError(f"{name} has {len(source)} examples, fewer than one global batch of {largest}; "
                            f"use a global batch (--batch-size / --batch-ramp) of {len(source)} or less")
        self._stream = IndexStream(len(source), seed, shuffle)
        self._reader: ReadAhead | None = None
        self._draw = _Draw(source, self._stream, self._size_at, rows)
        self._cursor = (0, 0)

    @property
    def rows(self):
        return self._draw.rows

    @rows.setter
    def rows(self, rows) -> None:
        self.close()
        self._draw = _Draw(self.source, self._stream, self._size_at, rows)

    @property
    def position(self) -> int:
        return self._cursor[0]

    @property
    def step(self) -> int:
        return self._cursor[1]

    def get_state(self) -> dict:
        return {"position": self._cursor[0], "step": self._cursor[1]}

    def set_state(self, state: dict) -> None:
        self.close()
        self._cursor = (int(state["position"]), int(state["step"]))

    def __next__(self) -> dict[str, np.ndarray]:
        if self.read_ahead <= 0:
            batch, self._cursor = self._draw(self._cursor)
            return batch
        if self._reader is None:
            self._reader = ReadAhead(self._draw, self._cursor, self.read_ahead, name=f"jaxpar-read-ahead:{self.name}")
        batch, self._cursor = self._reader.next()
        return batch

    def close(self) -> None:
        """Stops the read-ahead thread (if any) and waits for it; `next` starts a new one at the same position."""
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


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


class prefetch_to_device(Iterator):
    """Keeps `size` batches already placed on the devices (`put` is e.g. `trainer.shard_batch`): transfers are
    asynchronous in JAX, so the next batches' copies overlap the running step. `get_state` is the state of the
    next batch to be consumed, not of the last one fetched. An error drawing a batch is raised by the `next` that
    would have returned that batch (the batches before it are still returned). `close()` closes `batches`."""

    def __init__(self, batches: Batches, put: Callable, size: int = 2):
        self.batches, self.put, self.size = batches, put, size
        self._queue = collections.deque()
        self._error: BaseException | None = None

    def _fill(self):
        while len(self._queue) < self.size and self._error is None:
            state = self.batches.get_state()
            try:
                batch = next(self.batches)
            except Exception as error:  # raised when its turn comes
                self._error = error
                break
            self._queue.append((state, self.put(batch)))

    def __next__(self):
        self._fill()
        if not self._queue:
            error, self._error = self._error, None
            raise error
        return self._queue.popleft()[1]

    def get_state(self) -> dict:
        return self._queue[0][0] if self._queue else self.batches.get_state()

    def set_state(self, state: dict) -> None:
        self._queue.clear()
        self._error = None
        self.batches.set_state(state)

    def close(self) -> None:
        self._queue.clear()
        getattr(self.batches, "close", lambda: None)()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
