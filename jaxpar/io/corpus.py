"""A text corpus on disk, read only where it is used: the bytes of a list of files, concatenated and cut at a length,
of which a process reads just the byte ranges its windows need.

The length and every file's place in the concatenation come from `os.stat` sizes, so the train / validation split
and the byte offsets of any window are known before a byte is read. `Corpus[positions]` reads the distinct
positions asked for, one positioned read (`os.pread`) per contiguous run (per file), mapped over the runs with no
Python work per run, and counts the bytes it read (`bytes_read`). `CorpusPart` (`jaxpar.io.corpus_split`) is the
training or the held-out part of a corpus under `BlockSplit`, the one place that says which blocks are held out;
`jaxpar.io.data.split_text` applies the same rule to bytes in memory; `jaxpar.io.corpus_files` says which files.

    corpus = open_corpus("books/", max_bytes=1 << 30)     # stats the files, reads nothing
    train, held_out = split_corpus(corpus, seq_len=128)
    windows = jaxpar.io.data.TextWindows(train, 128)     # windows[indices] reads those windows' bytes
"""

from __future__ import annotations

import logging
import os
import resource
import threading

import numpy as np

from jaxpar.errors import DataError
from jaxpar.io.corpus_files import binary_note, corpus_files
# (re-exported: the split was defined here before it had its own module)
from jaxpar.io.corpus_split import (TEXT_BLOCK_BYTES, BlockSplit, CorpusPart, split_corpus,  # noqa: F401
                                    text_block_size)

DEFAULT_CORPUS_BYTES = 4 << 20  # enough text for thousands of steps of the default model
SAMPLE_BYTES = 64 << 10  # what the text check (binary_note) of a --data corpus reads: its first bytes
# file descriptors a corpus keeps open between reads (least recently used closed first): a quarter of the process's
# limit, so that reading does not reopen files batch after batch, and other open files keep their room
OPEN_FILES = min(max(resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4, 64), 4096)


# --- the corpus ----------------------------------------------------------------------------------------------------
class Corpus:
    """The first `max_bytes` bytes of `files` concatenated (file sizes from os.stat), read on demand.

    `corpus[positions]` (an integer array of any shape) is the uint8 bytes at those positions; `read(start, stop)`
    a range; `runs(starts, lengths)` many ranges at once. `bytes_read` counts every byte read from the files. Reads
    are vectorized: the ranges are cut at file ends with numpy and read with one `os.pread` each, mapped over the
    pieces with no Python work per piece (about 0.5 us each), so a batch of windows costs its syscalls. Safe to use
    from several threads (one read at a time)."""

    def __init__(self, files: list[str], max_bytes: int = DEFAULT_CORPUS_BYTES, label: str | None = None):
        self.label = label  # the --data value errors name (None: the default corpus)
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
        self._fds = np.full(len(self.files), -1, np.int64)  # open descriptors (-1: closed)
        self._used = np.zeros(len(self.files), np.int64)  # the read that last used each file
        self._reads, self._lock = 0, threading.Lock()
        self.bytes_read = 0

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _unreadable(self, name: str, error: OSError) -> DataError:
        return DataError(f"--data {self.label!r}: cannot read {name!r} ({error.strerror})")

    def _descriptors(self, files: np.ndarray) -> np.ndarray:
        """Descriptors for `files` (at most OPEN_FILES // 2 distinct), opening the closed ones; when more than
        OPEN_FILES would be open, the least recently used half of the others is closed first."""
        self._reads += 1
        distinct = files[_begins(files[1:] != files[:-1])]  # (pieces come in file order: sorted)
        self._used[distinct] = self._reads
        closed = distinct[self._fds[distinct] < 0]
        open_now = np.flatnonzero(self._fds >= 0) if len(closed) else np.zeros(0, np.int64)
        if len(open_now) + len(closed) > OPEN_FILES:
            others = open_now[self._used[open_now] < self._reads]
            for index in others[np.argsort(self._used[others], kind="stable")][:max(len(others) // 2, 1)].tolist():
                os.close(int(self._fds[index]))
                self._fds[index] = -1
        for index in closed.tolist():
            try:
                self._fds[index] = os.open(self.files[index], os.O_RDONLY)
            except OSError as error:
                raise self._unreadable(self.files[index], error) from error
        return self._fds[files]

    def _pieces(self, starts: np.ndarray, stops: np.ndarray):
        """Ranges [starts, stops) of the corpus (sorted, disjoint) cut at file ends: each piece's (file, offset in
        the file, length), in order; empty pieces (empty files) left out."""
        first = np.searchsorted(self.ends, starts, side="right")
        count = np.maximum(np.searchsorted(self.ends, stops - 1, side="right") - first + 1, 0)  # (empty: none)
        if (count == 1).all():  # no range crosses a file end (the usual case)
            file_starts = self.ends[first] - self.sizes[first]
            return first, starts - file_starts, stops - starts
        owner = np.repeat(np.arange(len(starts)), count)
        files = np.repeat(first, count) + _ramps(count)
        file_starts = self.ends[files] - self.sizes[files]
        low, high = np.maximum(starts[owner], file_starts), np.minimum(stops[owner], self.ends[files])
        keep = high > low
        return files[keep], (low - file_starts)[keep], (high - low)[keep]

    def _read_ranges(self, starts: np.ndarray, stops: np.ndarray, pad: int = 0) -> bytes:
        """The bytes of the ranges [starts, stops) (sorted, disjoint, inside the corpus), concatenated, then `pad`
        zero bytes."""
        files, offsets, lengths = self._pieces(starts, stops)
        if not len(files):
            return bytes(pad)
        group = (np.cumsum(_begins(files[1:] != files[:-1])) - 1) // (OPEN_FILES // 2)  # pieces in file order
        cuts = [0, len(files)] if group[-1] == 0 else \
            [0, *(np.flatnonzero(np.diff(group)) + 1).tolist(), len(files)]
        chunks = []
        with self._lock:
            for a, b in zip(cuts[:-1], cuts[1:]):
                fds = self._descriptors(files[a:b])
                try:
                    chunks += map(os.pread, fds.tolist(), lengths[a:b].tolist(), offsets[a:b].tolist())
                except OSError:
                    self._name_failure(files[a:b], fds, offsets[a:b], lengths[a:b])
                    raise
        if pad:
            chunks.append(bytes(pad))
        joined = b"".join(chunks)
        if len(joined) != int(lengths.sum()) + pad:  # a read returns at most what it asks for: one came up short
            got = np.fromiter(map(len, chunks[:len(lengths)]), np.int64, len(lengths))
            index = int(files[np.argmax(got != lengths)])
            raise DataError(f"--data {self.label!r}: {self.files[index]!r} has shrunk to "
                            f"{os.stat(self.files[index]).st_size} bytes since the run started (it had at least "
                            f"{int(self.sizes[index])}); leave a run's data unchanged while it trains")
        self.bytes_read += int(lengths.sum())
        return joined

    def _name_failure(self, files, fds, offsets, lengths) -> None:
        """Re-reads piece by piece to raise the one-line error that names the file a read failed on."""
        for index, fd, offset, length in zip(files.tolist(), fds.tolist(), offsets.tolist(), lengths.tolist()):
            try:
                os.pread(fd, length, offset)
            except OSError as error:
                raise self._unreadable(self.files[index], error) from error

    def read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the corpus: one positioned read (pread) per file the range touches."""
        if stop <= start:
            return b""
        return self._read_ranges(np.array([start], np.int64), np.array([stop], np.int64))

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
        starts, lengths = np.asarray(starts, np.int64), np.broadcast_to(np.asarray(lengths, np.int64), np.shape(starts))
        if starts.size == 0:
            return np.zeros(0, np.uint8)
        longest = int(lengths.max())
        if longest * len(lengths) <= 2 * int(lengths.sum()) + longest:  # runs of about one length (windows):
            rows = self.rows(starts, lengths).ravel()  # one strided gather,
            short = np.flatnonzero(lengths < longest)  # then the few shorter runs' extra bytes are cut out
            if not len(short):
                return rows
            extra = longest - lengths[short]
            return np.delete(rows, np.repeat(short * longest + lengths[short], extra) + _ramps(extra))
        buffer, base = self._merged(starts, lengths, pad=0)
        return buffer[np.repeat(base, lengths) + _ramps(lengths)]

    def rows(self, starts: np.ndarray, lengths: np.ndarray, width: int = 0) -> np.ndarray:
        """[len(starts), max(lengths, width)] uint8: row i begins with the bytes [starts[i], starts[i] + lengths[i]);
        what follows them in a shorter run's row is unspecified. Read as `runs` reads, cut with one strided gather."""
        starts, lengths = np.asarray(starts, np.int64), np.broadcast_to(np.asarray(lengths, np.int64), np.shape(starts))
        longest = max(int(lengths.max()) if starts.size else 0, width)
        if starts.size == 0 or longest == 0:
            return np.zeros((starts.size, longest), np.uint8)
        buffer, base = self._merged(starts, lengths, pad=longest)
        windows = np.lib.stride_tricks.as_strided(buffer, (len(buffer) - longest + 1, longest), (1, 1), writeable=False)
        return windows[base]

    def _merged(self, starts: np.ndarray, lengths: np.ndarray, pad: int) -> tuple[np.ndarray, np.ndarray]:
        """(buffer, base): the runs' bytes read as merged ranges (overlapping or touching runs merged) into one
        buffer followed by `pad` zero bytes, and where run i begins in it."""
        order = np.argsort(starts)  # (ties: any order merges the same)
        first, stop = starts[order], (starts + lengths)[order]
        opens = _begins(first[1:] > np.maximum.accumulate(stop)[:-1])  # begins a merged range
        heads = np.flatnonzero(opens)
        merged_starts, merged_stops = first[heads], np.maximum.reduceat(stop, heads)
        buffer = np.frombuffer(self._read_ranges(merged_starts, merged_stops, pad=pad), np.uint8)
        merged_lengths = merged_stops - merged_starts
        merged_offsets = np.cumsum(merged_lengths) - merged_lengths  # each range's place in buffer
        home = np.empty_like(order)
        home[order] = np.cumsum(opens) - 1  # the merged range holding each run
        return buffer, merged_offsets[home] + starts - merged_starts[home]

    def close(self) -> None:
        for fd in self._fds[self._fds >= 0].tolist():
            os.close(fd)
        self._fds[:] = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # (at interpreter exit os may be gone; the descriptors close with the process)
            pass


def _begins(after_first: np.ndarray) -> np.ndarray:
    """A boolean mask: True, then `after_first` (where each later element begins something new)."""
    mask = np.empty(len(after_first) + 1, bool)
    mask[0], mask[1:] = True, after_first
    return mask


def _ramps(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., counts[0] - 1, then 0, 1, ..., counts[1] - 1, ... (one ramp per count, concatenated)."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


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
