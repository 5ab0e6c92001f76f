"""Which files make a text corpus, in their concatenation order, and whether its bytes look like text: the default
corpus (this Python's standard library `.py` files), a `--data` file or folder, and the one-line error when the path
is none of these. `jaxpar.io.corpus` reads the bytes."""

from __future__ import annotations

import codecs
import os
import stat
import sysconfig

from jaxpar.errors import DataError


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
