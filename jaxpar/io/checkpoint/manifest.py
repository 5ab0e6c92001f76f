"""The integrity manifest: size and CRC32 of every file of a checkpoint folder, written once the save is durable,
checked before a restore so a truncated or corrupted file is named instead of loaded."""

from __future__ import annotations

import json
import os
import tempfile
import zlib

FORMAT = 1
MANIFEST = "jaxpar_manifest.json"


def _files(folder: str) -> list[str]:
    out = []
    for root, _, files in os.walk(folder):
        # the manifest and its temporary files (another writer may be mid-way)
        out.extend(os.path.relpath(os.path.join(root, f), folder) for f in files
                   if f != MANIFEST and not f.startswith(f".{MANIFEST}."))
    return sorted(out)


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(folder: str) -> None:
    """Writes `folder`'s manifest atomically (a temporary file renamed into place)."""
    entries = {f: [os.path.getsize(os.path.join(folder, f)), _crc(os.path.join(folder, f))] for f in _files(folder)}
    fd, temporary = tempfile.mkstemp(prefix=f".{MANIFEST}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as handle:
        json.dump({"format": FORMAT, "files": entries}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, os.path.join(folder, MANIFEST))


def verify(folder: str) -> str | None:
    """None if every file the manifest lists is intact (or there is no manifest); else what is wrong, naming the
    file."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as handle:
            files = json.load(handle)["files"]
        entries = [(str(name), int(size), int(crc)) for name, (size, crc) in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"its manifest {path} is unreadable ({type(error).__name__})"
    for name, size, crc in entries:
        full = os.path.join(folder, name)
        if not os.path.isfile(full):
            return f"file {full} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"file {full} has {actual:,} bytes, {size:,} expected (truncated or overwritten)"
        if _crc(full) != crc:
            return f"file {full} is corrupted (its checksum differs from the one written with it)"
    return None
