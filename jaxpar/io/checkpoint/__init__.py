"""Checkpoints with orbax-checkpoint: sharded, asynchronous, atomic, verified, restorable on another mesh.

A checkpoint of step N is the folder `DIR/N/` written by an orbax `CheckpointManager`:

- `state/`: every array of the `TrainState` (parameters, optimizer state, strategy state such as local SGD's
  replicas or SSP's version buffer, communicator state, the step and the run key as raw key data), a flat dict
  named by tree path (`params.layers.0.kernel`, `jaxpar.names`), written in orbax's OCDBT format: each process
  writes its own shards, nothing is gathered to one device.
- `meta/`: JSON: the format version, the strategy and replica count, each array's shape and dtype, and what the
  caller adds (the resolved config and the data iterator position for `run.py`).
- `jaxpar_manifest.json`: size and CRC32 of every file, written once the save is durable; `restore` checks it, so
  a truncated or corrupted file is named instead of loaded.

Saves are asynchronous (orbax copies the arrays to host memory, then writes in a background thread) and atomic
(orbax writes into a temporary folder and renames it when complete: an interrupted save is never listed). Nothing
is read with pickle: arrays are tensorstore files, metadata is JSON.

Restoring onto another mesh uses the new mesh's shardings. When the strategy state cannot carry over (a different
strategy or replica count), the saved strategy reduces the checkpoint to its strategy-free state (its `reduce`)
and the trainer's strategy builds its own from that; `notes` says so.

Modules by concern: `naming` (a state as named arrays, their description), `manifest` (integrity),
`checkpointer` (save, list, wait, set aside), `restore` (direct, or through the strategy-free state).
"""

from jaxpar.io.checkpoint.checkpointer import Checkpointer
from jaxpar.io.checkpoint.manifest import MANIFEST, verify, write_manifest

__all__ = ["MANIFEST", "Checkpointer", "verify", "write_manifest"]
