"""A text corpus on disk, read only where it is used: the bytes of a list of files, concatenated and cut at a length,
of which a process reads just the byte ranges its windows need.

The length and every file's place in the concatenation come from `os.stat` sizes, so the train / validation split
and the byte offsets of any window are known before a byte is read. `Corpus[positions]` reads the distinct
positions asked for, one positioned read (`os.pread`) per contiguous run (per file), and counts the bytes it read
(`bytes_read`). `CorpusPart` (`jaxpar.io.corpus_split`) is the training or the held-out part of a corpus under
`BlockSplit`, the one place that says which blocks are held out; `jaxpar.io.data.split_text` applies the same rule
to bytes in memory.

    corpus = open_corpus("books/", max_bytes=1 << 30)     # stats the files, reads nothing
    train, held_out = split_corpus(corpus, seq_len=128)
    windows = jaxpar.io.data.TextWindows(train, 128)     # windows[indices] reads those windows' bytes
"""

from __future__ import annotations

import codecs
import collections
import logging
import os
import stat
import sysconfig
from typing import NamedTuple

import numpy as np

from jaxpar.errors import DataError
# (re-exported: the split was defined here before it had its own module)
from jaxpar.io.corpus_split import (TEXT_BLOCK_BYTES, BlockSplit, CorpusPart, split_corpus,  # noqa: F401
                                    text_block_size)

DEFAULT_CORPUS_BYTES = 4 << 20  # enough text for thousands of steps of the default model
SAMPLE_BYTES = 64 << 10  # what the text check (binary_note) of a --data corpus reads: its first bytes
OPEN_FILES = 512  # file descriptors a corpus keeps open between reads (least recently used closed first)


# --- which files ---------------------------------------------------------------------------------------------------
def default_corpus_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "test", "tests"))
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files, key=lambda f: os.path.relpath(f, root))


def path_kind(path: str) -> str:
    """What is at `path`, in words: 'a regular file', 'a folder', 'a character device', ... or 'nothing'."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"a dangling symbolic link (to {os.readlink(path)!r}, which does not exist)"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "nothing"
    for test, words in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return words
    return "not a regular file"


def corpus_files(path: str | None) -> list[str]:
    """The files of the corpus at `path` (None: the standard library's .py files), in their concatenation order."""
    if path is None:
        files = default_corpus_files()
        if not files:
            raise DataError("no default corpus: the Python standard library has no .py files here; pass --data PATH")
        return files
    if os.path.isdir(path):
        files = sorted(f for f in (os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
                       if os.path.isfile(f))  # regular files only: no FIFOs, sockets or dangling links
        if not files:
            raise DataError(f"--data {path!r}: the folder contains no files; pass a text file or a folder of them")
        return files
    if os.path.isfile(path):
        return [path]
    if path_kind(path) == "nothing":
        raise DataError(f"--data {path!r}: no such file or folder; pass a text file or a folder of text files")
    raise DataError(f"--data {path!r}: is {path_kind(path)}, not a file or folder; pass a text file or a folder "
                    f"of text files")


def binary_note(tokens: np.ndarray) -> str | None:
    """Why `tokens` do not look like text (invalid UTF-8 or NUL bytes), or None. A cut multi-byte character at the
    end (max_bytes, or the end of a sample) is not counted."""
    raw = tokens.tobytes()
    try:
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text (invalid byte at offset {error.start})"
    zero = raw.find(b"\0")
    return None if zero < 0 else f"is not text (a NUL byte at offset {zero})"


# --- the corpus ----------------------------------------------------------------------------------------------------
class Corpus:
    """The first `max_bytes` bytes of `files` concatenated (file sizes from os.stat), read on demand.

    `corpus[positions]` (an integer array of any shape) is the uint8 bytes at those positions; `read(start, stop)`
    a range. `bytes_read` counts every byte read from the files."""

    def __init__(self, files: list[str], max_bytes: int = DEFAULT_CORPUS_BYTES, label: str | None = None):
        self.label = label  # the --data value errors name (None: the default corpus)
        self._handles: collections.OrderedDict[int, int] = collections.OrderedDict()  # file index -> descriptor
        self.files, sizes, total = [], [], 0
        for name in files:
            if total >= max_bytes:
                break
            try:
                size = os.stat(name).st_size
            except OSError as error:
                raise self._unreadable(name, error) from error
            if not os.access(name, os.R_OK):
                raise self._unreadable(name, PermissionError(13, "Permission denied"))
            self.files.append(name)
            sizes.append(min(size, max_bytes - total))
            total += sizes[-1]
        self.ends = np.cumsum(np.asarray(sizes, np.int64))  # file i holds bytes [ends[i] - sizes[i], ends[i])
        self.sizes = np.asarray(sizes, np.int64)
        self._bounds = [(int(end - size), int(end)) for end, size in zip(self.ends, self.sizes)]  # per read: no numpy
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _unreadable(self, name: str, error: OSError) -> DataError:
        return DataError(f"--data {self.label!r}: cannot read {name!r} ({error.strerror})")

    def _descriptor(self, index: int) -> int:
        fd = self._handles.pop(index, None)
        if fd is None:
            if len(self._handles) >= OPEN_FILES:
                os.close(self._handles.popitem(last=False)[1])
            try:
                fd = os.open(self.files[index], os.O_RDONLY)
            except OSError as error:
                raise self._unreadable(self.files[index], error) from error
        self._handles[index] = fd
        return fd

    def read(self, start: int, stop: int, index: int | None = None) -> bytes:
        """Bytes [start, stop) of the corpus: one positioned read (pread) per file the range touches. `index`: the
        file holding `start` if the caller knows it."""
        chunks, position = [], start
        if index is None:
            index = int(np.searchsorted(self.ends, position, side="right"))
        while position < stop:
            file_start, file_end = self._bounds[index]
            take = min(stop, file_end) - position
            if take > 0:
                fd = self._descriptor(index)
                try:
                    chunk = os.pread(fd, take, position - file_start)
                except OSError as error:
                    raise self._unreadable(self.files[index], error) from error
                if len(chunk) != take:
                    raise DataError(f"--data {self.label!r}: {self.files[index]!r} has shrunk to "
                                    f"{os.fstat(fd).st_size} bytes since the run started (it had at least "
                                    f"{int(self.sizes[index])}); leave a run's data unchanged while it trains")
                chunks.append(chunk)
                self.bytes_read += take
                position += take
            index += 1
        return b"".join(chunks)

    def __getitem__(self, positions) -> np.ndarray:
        """The bytes at `positions` (uint8, the same shape). The positions are taken as runs of consecutive ones (a
        window is one run); overlapping runs are merged, so each distinct position is read once, by one read per
        merged run (per file)."""
        positions = np.asarray(positions, np.int64)
        flat = positions.ravel()
        if flat.size == 0:
            return np.zeros(positions.shape, np.uint8)
        if flat.min() < 0 or flat.max() >= len(self):
            raise IndexError(f"corpus positions must be in [0, {len(self)})")
        breaks = np.flatnonzero(np.diff(flat) != 1) + 1
        return self.runs(flat[np.r_[0, breaks]], np.diff(np.r_[0, breaks, flat.size])).reshape(positions.shape)

    def runs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The bytes [starts[i], starts[i] + lengths[i]) for every i, concatenated (uint8). Overlapping or touching
        runs are merged first (numpy), then each merged range is one positioned read (per file it touches)."""
        starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        order = np.argsort(starts, kind="stable")
        first, stop = starts[order], (starts + lengths)[order]
        opens = np.r_[True, first[1:] > np.maximum.accumulate(stop)[:-1]]  # begins a merged range
        heads = np.flatnonzero(opens)
        merged_starts, merged_stops = first[heads], np.maximum.reduceat(stop, heads)
        files = np.searchsorted(self.ends, merged_starts, side="right")
        inside = merged_stops <= self.ends[files]  # (a range that crosses into the next file: `read`)
        offsets = merged_starts - (self.ends - self.sizes)[files]
        chunks = []
        for index, a, b, offset, whole in zip(files.tolist(), merged_starts.tolist(), merged_stops.tolist(),
                                              offsets.tolist(), inside.tolist()):
            if not whole:
                chunks.append(self.read(a, b, index))
                continue
            try:
                chunk = os.pread(self._descriptor(index), b - a, offset)
            except OSError as error:
                raise self._unreadable(self.files[index], error) from error
            if len(chunk) != b - a:
                self.read(a, b, index)  # raises: the file has shrunk
            self.bytes_read += b - a
            chunks.append(chunk)
        buffer = np.frombuffer(b"".join(chunks), np.uint8)
        merged_offsets = np.cumsum(np.r_[0, merged_stops[:-1] - merged_starts[:-1]])  # each range's place in buffer
        home = np.empty_like(order)
        home[order] = np.cumsum(opens) - 1  # the merged range holding each run
        base = merged_offsets[home] + starts - merged_starts[home]  # where run i begins in buffer
        ramp = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return buffer[np.repeat(base, lengths) + ramp]

    def close(self) -> None:
        while self._handles:
            os.close(self._handles.popitem()[1])

    def __del__(self):
        self.close()


def open_corpus(path: str | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES) -> Corpus:
    """The corpus at `path` (a file or a folder; None: the standard library's .py files), up to `max_bytes`. Reads
    nothing from the default corpus; from a --data corpus only its first SAMPLE_BYTES, to say if it is not text."""
    corpus = Corpus(corpus_files(path), max_bytes, label=path)
    if len(corpus) == 0:
        raise DataError(f"--data {path!r}: contains no text (0 bytes); pass a non-empty text file or folder")
    if path is not None:
        why = binary_note(np.frombuffer(corpus.read(0, min(len(corpus), SAMPLE_BYTES)), np.uint8))
        if why:  # byte-level: any bytes train; say so in case it was a mistake
            logging.getLogger("jaxpar").warning(f"--data {path!r} {why}; training on its raw bytes anyway")
    return corpus
