"""Datasets that ship with the machine, and deterministic global-batch iterators.

- digits: scikit-learn's 1,797 8x8 handwritten digits (bundled with the package), split 1,497 train / 300 test.
- text: bytes of a text file or a folder of text files (`--data`), or by default the Python standard library's
  `.py` files in sorted order: real text present on every machine, never downloaded.

Iterators yield global batches as numpy dicts; the trainer splits them over `data`. The order is a pure function of
(seed, epoch) or (seed, step), so a run is reproducible and independent of the mesh.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator

import numpy as np

from jaxpar.errors import DataError

DIGITS_TEST_SIZE = 300
DEFAULT_CORPUS_BYTES = 4 << 20  # enough text for thousands of steps of the default model


def load_digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test) dicts with "image" float32 [N, 8, 8, 1] in [0, 1] and "label" int32 [N]."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = (bunch.images.astype(np.float32) / 16.0)[..., None]
    labels = bunch.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))  # fixed split, whatever the run's seed
    test, train = order[:DIGITS_TEST_SIZE], order[DIGITS_TEST_SIZE:]
    return {"image": images[train], "label": labels[train]}, {"image": images[test], "label": labels[test]}


def default_corpus_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests"))
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda f: os.path.relpath(f, root))


def load_text(path: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The corpus as uint8 tokens (byte-level: vocabulary 256)."""
    if path is None:
        files = default_corpus_files()
        if not files:
            raise DataError("no default corpus: the Python standard library has no .py files here; pass --data PATH")
    elif os.path.isdir(path):
        files = sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
        if not files:
            raise DataError(f"--data {path!r}: the folder contains no files; pass a text file or a folder of them")
    elif os.path.isfile(path):
        files = [path]
    else:
        raise DataError(f"--data {path!r}: no such file or folder; pass a text file or a folder of text files")
    chunks, total = [], 0
    for name in files:
        with open(name, "rb") as handle:
            chunk = handle.read(max_bytes - total)
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    if tokens.size == 0:
        raise DataError(f"--data {path!r}: contains no text (0 bytes); pass a non-empty text file or folder")
    return tokens


def split_text(tokens: np.ndarray, validation_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    cut = int(len(tokens) * (1 - validation_fraction))
    return tokens[:cut], tokens[cut:]


def array_batches(arrays: dict[str, np.ndarray], global_batch: int, seed: int, name: str = "dataset"
                  ) -> Iterator[dict[str, np.ndarray]]:
    """Endless epochs of shuffled batches without replacement; the last partial batch of an epoch is dropped."""
    size = len(next(iter(arrays.values())))
    if size < global_batch:
        raise DataError(f"{name} has {size} examples, fewer than one global batch of {global_batch}; "
                        f"use --batch-size {size} or less")
    epoch = 0
    while True:
        order = np.random.default_rng((seed, epoch)).permutation(size)
        for start in range(0, size - global_batch + 1, global_batch):
            index = order[start:start + global_batch]
            yield {k: v[index] for k, v in arrays.items()}
        epoch += 1


def text_batches(tokens: np.ndarray, global_batch: int, seq_len: int, seed: int, name: str = "text"
                 ) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of random windows of seq_len + 1 bytes ({"tokens": int32 [B, seq_len + 1]})."""
    window = seq_len + 1
    if len(tokens) < window:
        raise DataError(f"{name} has {len(tokens)} bytes, fewer than one sequence of {window}; "
                        f"use --seq-len {max(len(tokens) - 1, 1)} or less, or more text")
    step = 0
    while True:
        starts = np.random.default_rng((seed, step)).integers(0, len(tokens) - window + 1, size=global_batch)
        yield {"tokens": np.stack([tokens[s:s + window] for s in starts]).astype(np.int32)}
        step += 1
