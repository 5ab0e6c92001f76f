"""Checkpoints with orbax-checkpoint: sharded, asynchronous, atomic, verified, restorable on another mesh.

A checkpoint of step N is the folder `DIR/N/` written by an orbax `CheckpointManager`:

- `state/`: every array of the `TrainState` (parameters, optimizer state, strategy state such as local SGD's
  replicas or SSP's version buffer, communicator state, the step and the run key as raw key data), a flat dict
  named by tree path (`params.layers.0.kernel`), written in orbax's OCDBT format: each process writes its own
  shards, nothing is gathered to one device.
- `meta/`: JSON: the format version, the strategy and replica count, each array's shape and dtype, and what the
  caller adds (the resolved config and the data iterator position for `run.py`).
- `jaxpar_manifest.json`: size and CRC32 of every file, written once the save is durable; `restore` checks it, so
  a truncated or corrupted file is named instead of loaded.

Saves are asynchronous (orbax copies the arrays to host memory, then writes in a background thread) and atomic
(orbax writes into a temporary folder and renames it when complete: an interrupted save is never listed). Nothing
is read with pickle: arrays are tensorstore files, metadata is JSON.

Restoring onto another mesh uses the new mesh's shardings. When the strategy state cannot carry over (a different
strategy, or a different replica count for local SGD / DiLoCo replicas or an ASP version buffer), restore reduces
the checkpoint to its strategy-free core, averaging per-replica parameters, optimizer and BatchNorm states as at a
meeting, and lets the new strategy build its state from that; it says so in `notes`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.errors import CheckpointError

FORMAT = 1
MANIFEST = "jaxpar_manifest.json"
SUPERSEDED = "superseded"  # where checkpoints newer than a resumed older one are moved (never deleted)


# --- flat, named trees -----------------------------------------------------------------------------------------
def _name(path) -> str:
    parts = []
    for entry in path:
        part = getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", entry)))
        parts.append(re.sub(r"[^A-Za-z0-9_-]", "_", str(part)))
    return ".".join(parts)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def flatten(tree) -> tuple[dict, list[str], object]:
    """(name -> leaf, names in tree order, treedef); typed PRNG keys stay typed here."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = []
    for path, _ in leaves:
        name, suffix = _name(path), 1
        while name in names:
            suffix += 1
            name = f"{_name(path)}_{suffix}"
        names.append(name)
    return dict(zip(names, (leaf for _, leaf in leaves))), names, treedef


def strategy_name(strategy) -> str:
    return getattr(strategy, "name", type(strategy).__name__)


def _describe(flat: dict) -> dict:
    out = {}
    for name, x in flat.items():
        if _is_key(x):
            out[name] = {"shape": list(jax.eval_shape(jax.random.key_data, x).shape), "dtype": "uint32",
                         "key_impl": str(jax.random.key_impl(x)) if isinstance(x, jax.Array) else None}
        else:
            out[name] = {"shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
    return out


# --- integrity --------------------------------------------------------------------------------------------------
def _files(folder: str) -> list[str]:
    out = []
    for root, _, files in os.walk(folder):
        # the manifest and its temporary files (a writer may be mid-way: the background thread and `wait` both write)
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


# --- the checkpointer ---------------------------------------------------------------------------------------------
class Checkpointer:
    """Saves and restores `TrainState`s in `directory` (created if missing), keeping the latest `keep`.

        checkpoints = jaxpar.Checkpointer("ckpt", keep=3)
        state = trainer.fit(state, batches, 1000, actions=[jaxpar.train.actions.Checkpoint(checkpoints, every=100)])
        checkpoints.wait()
        state, meta, notes = checkpoints.restore(trainer)        # the latest, onto this trainer's mesh
    """

    def __init__(self, directory: str, keep: int = 3):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise CheckpointError(directory, f"keep {keep!r}: must be an integer >= 1 (checkpoints kept)")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise CheckpointError(directory, "is not a folder")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        except OSError as error:
            raise CheckpointError(directory, f"cannot be used ({error})") from None
        self._unverified: list[int] = []  # saved, manifest not yet written (the save may still be running)

    def folder(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first (interrupted saves are never listed)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state, strategy=None, num_replicas: int | None = None, **extra) -> None:
        """Starts saving `state` as step `step` and returns once the arrays are copied off the devices (the state
        may then be donated). `extra`: JSON-serialisable values stored with it (e.g. `data=`, `config=`)."""
        self.wait()
        flat, _, _ = flatten(state)
        meta = {"format": FORMAT, "step": int(step), "strategy": strategy_name(strategy) if strategy else None,
                "replicas": num_replicas, "leaves": _describe(flat), **extra}
        arrays = {name: jax.random.key_data(x) if _is_key(x) else x for name, x in flat.items()}
        self._manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                                              meta=ocp.args.JsonSave(meta)), force=True)
        self._unverified.append(int(step))
        if jax.process_index() != 0:
            return  # process 0 writes the manifest (of every process's files, once orbax has renamed the folder)
        # the manifest as soon as orbax has renamed the finished checkpoint into place (so the newest checkpoint
        # is verified too when the process is killed before the next save); `wait` writes it otherwise
        threading.Thread(target=self._manifest_when_final, args=(self.folder(int(step)),), daemon=True).start()

    @staticmethod
    def _manifest_when_final(folder: str, timeout: float = 3600.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.isdir(folder):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        try:
            write_manifest(folder)
        except OSError:
            pass  # deleted meanwhile (max_to_keep), or the disk failed: `wait` reports it

    def wait(self) -> None:
        """Blocks until every started save is durable, and writes their manifests."""
        try:
            self._manager.wait_until_finished()
            for step in self._unverified if jax.process_index() == 0 else ():
                if os.path.isdir(self.folder(step)):  # (kept by max_to_keep)
                    write_manifest(self.folder(step))
        except Exception as error:  # orbax's background write or the manifest: a full disk, a vanished folder
            step = self._unverified[-1] if self._unverified else "?"
            raise CheckpointError(self.directory, f"saving the checkpoint of step {step} failed "
                                                  f"({_first_line(error)}); free space or pass another folder") from None
        finally:
            self._unverified.clear()

    def close(self, quiet: bool = False) -> None:
        """Waits until every save is durable; `quiet`: a failure is swallowed (another error is being reported)."""
        try:
            self.wait()
            self._manager.close()
        except Exception:
            if not quiet:
                raise

    # --- restore ----------------------------------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def arrays(self, step: int) -> dict[str, np.ndarray]:
        """Every array of a checkpoint by name, as host numpy arrays (to inspect or compare checkpoints)."""
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        leaves = self.meta(step)["leaves"]
        arrays = self._read(step, {n: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]), sharding=device)
                                   for n, d in leaves.items()})
        return {n: np.asarray(a) for n, a in arrays.items()}

    def restore(self, trainer, step: int | None = None) -> tuple[object, dict, list[str]]:
        """(train state for `trainer`'s mesh and strategy, the checkpoint's metadata, notes) of `step` (default:
        the latest). Raises `CheckpointError` naming the step and file if it is missing, corrupt or of another
        model, and naming an older intact checkpoint if there is one. Nothing is deleted or overwritten."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(self.directory, "holds no checkpoint")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise CheckpointError(self.directory, f"has no checkpoint of step {step}; it has steps "
                                                  f"{', '.join(map(str, steps))}")
        problem = verify(self.folder(step))
        if problem is None:
            try:
                meta = self.meta(step)
            except Exception as error:  # orbax / tensorstore / JSON: any failure to read is the checkpoint's
                problem = f"its metadata cannot be read ({_first_line(error)})"
        if problem is None and meta.get("format") != FORMAT:
            problem = f"it has format {meta.get('format')!r}, this jaxpar reads format {FORMAT}"
        if problem is None:
            state, notes = self._restore_state(step, meta, trainer)
            return state, meta, notes
        raise CheckpointError(self.directory, f"the checkpoint of step {step} is unusable: {problem}; "
                                              + self._older_hint(step, steps) + " (nothing was deleted)")

    def _older_hint(self, step: int, steps: list[int]) -> str:
        for older in reversed([s for s in steps if s < step]):
            if verify(self.folder(older)) is None:
                return f"the checkpoint of step {older} is intact: resume from it with {{resume_step}} {older}"
        return "there is no older intact checkpoint: start a fresh run in another folder"

    def set_aside_newer(self, step: int) -> list[int]:
        """Moves checkpoints newer than `step` into `DIR/superseded/` (a run resumed from `step` would write those
        steps again); returns their steps."""
        newer = [s for s in self.steps() if s > step]
        several = jax.process_count() > 1
        if newer and several:  # every process has listed the folder before process 0 changes it
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxpar: checkpoints listed")
        try:
            if newer and jax.process_index() == 0:
                os.makedirs(os.path.join(self.directory, SUPERSEDED), exist_ok=True)
                for s in newer:
                    target = os.path.join(self.directory, SUPERSEDED, str(s))
                    if os.path.exists(target):
                        shutil.rmtree(target)
                    os.replace(self.folder(s), target)
                self._manager.reload()
        except OSError as error:
            raise CheckpointError(self.directory, f"cannot move the checkpoints newer than step {step} aside "
                                                  f"({error.strerror}); move or delete them yourself") from None
        if newer and several:  # the others wait until process 0 has moved them
            multihost_utils.sync_global_devices("jaxpar: checkpoints set aside")
            self._manager.reload()
        return newer

    def _read(self, step: int, abstract: dict) -> dict:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))[
                "state"]
        except Exception as error:
            steps = self.steps()
            raise CheckpointError(self.directory, f"the checkpoint of step {step} is unusable: its arrays cannot "
                                                  f"be read ({_first_line(error)}); {self._older_hint(step, steps)} "
                                                  f"(nothing was deleted)") from None

    def _restore_state(self, step: int, meta: dict, trainer):
        saved = meta["leaves"]
        target = trainer.abstract_state()
        flat, names, treedef = flatten(target)
        wanted = _describe(flat)
        same_strategy = meta.get("strategy") == strategy_name(trainer.strategy)
        if same_strategy and _shapes(saved) == _shapes(wanted):
            arrays = self._read(step, {n: _stored(x) for n, x in flat.items()})
            leaves = [_wrap(arrays[n], flat[n], saved[n]) for n in names]
            return jax.tree_util.tree_unflatten(treedef, leaves), []
        return self._restore_reduced(step, meta, trainer, same_strategy)

    def _restore_reduced(self, step: int, meta: dict, trainer, same_strategy: bool):
        """Through the strategy-free state: per-replica arrays averaged, stale versions dropped."""
        saved = meta["leaves"]
        neutral = trainer.abstract_state(neutral=True)
        flat, names, treedef = flatten(neutral)
        wanted = _describe(flat)
        raw = self._read(step, {n: jax.ShapeDtypeStruct(tuple(d["shape"]), jnp.dtype(d["dtype"]),
                                                        sharding=_placement(n, d, flat, wanted, trainer.mesh))
                                for n, d in saved.items()})
        per_replica = any(n.startswith("strategy_state.params.") for n in saved)
        values, problems = {}, []
        for name in names:
            source = name
            own = "strategy_state." + name
            if per_replica and own in saved and name.split(".")[0] in ("params", "opt_state", "model_state"):
                source = own
            if source not in saved:
                problems.append(f"{name} is not in the checkpoint")
                continue
            value = raw[source]
            if source == own:  # [replicas, ...]: average floats as at a meeting; integers (counts, keys) agree
                anchor = raw.get(name) if name.startswith("model_state.") else None  # RNG keys: the anchor's
                if jnp.issubdtype(value.dtype, jnp.floating):
                    value = jnp.mean(value, axis=0, dtype=jnp.float32).astype(value.dtype)
                else:  # counts agree across replicas
                    value = anchor if anchor is not None and anchor.shape == value.shape[1:] else value[0]
            if list(value.shape) != wanted[name]["shape"] or str(np.dtype(value.dtype)) != wanted[name]["dtype"]:
                problems.append(f"{name}: checkpoint {str(np.dtype(value.dtype))}{list(value.shape)}, this model "
                                f"{wanted[name]['dtype']}{wanted[name]['shape']}")
                continue
            values[name] = value
        extra = sorted(n for n in saved if not n.startswith("strategy_state.")
                       and not _covered(n, names))
        problems += [f"{n} is in the checkpoint but not in this model" for n in extra[:3]]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise CheckpointError(self.directory, f"the checkpoint of step {step} is of another model or "
                                                  f"optimizer ({shown}); restore it with the model, optimizer and "
                                                  f"config that wrote it, or use another folder")
        leaves = [jax.device_put(_wrap(values[n], flat[n], saved.get(n, {})), flat[n].sharding) for n in names]
        expand = jax.jit(trainer._expand, out_shardings=trainer.state_shardings)
        state = expand(jax.tree_util.tree_unflatten(treedef, leaves))
        if same_strategy:  # e.g. DiLoCo's outer optimizer state: replica-count independent, carried over
            state = _carry_opt_state(state, raw, saved)
        return state, [_reduction_note(step, meta, trainer, per_replica, same_strategy)]


def _placement(name: str, described: dict, flat: dict, wanted: dict, mesh) -> NamedSharding:
    """Where to read a saved array on the new mesh: sharded like the strategy-free array it is (or stacks, with a
    leading replica / version dimension), so no device holds more than it will; whole only if nothing matches."""
    shape = described["shape"]
    candidates = [(name, False)]
    for prefix, base in (("strategy_state.versions.", "params."), ("strategy_state.", "")):
        if name.startswith(prefix):
            candidates.append((base + name[len(prefix):], True))
            break
    for base, stacked in candidates:
        if base in flat:
            if not stacked and shape == wanted[base]["shape"]:
                return flat[base].sharding
            if stacked and shape[1:] == wanted[base]["shape"]:
                return NamedSharding(mesh, P(None, *flat[base].sharding.spec))
    return NamedSharding(mesh, P())


def _covered(name: str, names: list[str]) -> bool:
    return name in names or name.startswith("opt_state.")  # a strategy's own optimizer state (DiLoCo's outer)


def _carry_opt_state(state, raw: dict, saved: dict):
    flat, names, treedef = flatten(state.opt_state)
    if not names:
        return state
    prefixed = {n: "opt_state." + n for n in names}
    if not all(p in saved and saved[p]["shape"] == list(flat[n].shape) for n, p in prefixed.items()):
        return state
    leaves = [jax.device_put(raw[prefixed[n]], flat[n].sharding) for n in names]
    return state._replace(opt_state=jax.tree_util.tree_unflatten(treedef, leaves))


def _reduction_note(step, meta, trainer, per_replica, same_strategy) -> str:
    before = f"{meta.get('strategy')} on {meta.get('replicas')} replicas"
    now = f"{strategy_name(trainer.strategy)} on {trainer.num_replicas} replicas"
    if per_replica:
        how = (f"the {meta.get('replicas')} replicas' parameters, optimizer and BatchNorm states were averaged, as "
               f"at a meeting")
    elif any(n.startswith("strategy_state.versions.") for n in meta["leaves"]):
        how = "its stale parameter versions were dropped: every replica restarts from the current parameters"
    else:
        how = "its parameters and optimizer state carry over unchanged"
    outer = "" if same_strategy else "; strategy state of the new strategy starts fresh"
    return f"checkpoint step {step} was written by {before}; this run is {now}: {how}{outer}"


def _shapes(described: dict) -> dict:
    return {n: (tuple(d["shape"]), d["dtype"]) for n, d in described.items()}


def _stored(x):
    """The abstract array orbax restores for target leaf `x` (typed keys are stored as their key data)."""
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, x)
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=x.sharding)
    return x


def _wrap(value, target, described: dict):
    if _is_key(target):
        impl = described.get("key_impl") or str(jax.random.key_impl(jax.random.key(0)))
        return jax.random.wrap_key_data(value, impl=impl)
    return value


def _first_line(error: BaseException) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text[:240]}"
