"""The parameter server's state saved with orbax every `every` versions (and at the end): parameters, optimizer
state, version, and each worker's position in its data (its last delivered seq); with server shards, each shard's
optimizer state and their count. `resume` restores the latest, so
a run whose server died continues at the saved version; its workers continue at the batch after their last
delivery that the checkpoint holds."""

from __future__ import annotations

import os

import numpy as np

from jaxpar.errors import CheckpointError


class ServerCheckpoint:
    """Where and how often the server saves; built on the driver, used inside the server process."""

    def __init__(self, directory: str, every: int = 100, resume: bool = False, keep: int = 3):
        self.directory, self.every, self.resume, self.keep = os.path.abspath(directory), every, resume, keep
        self._manager = None

    def check(self) -> None:
        """On the driver: a folder that holds checkpoints needs `resume` (refused before anything starts)."""
        if not self.resume and os.path.isdir(self.directory) and any(
                name.isdigit() for name in os.listdir(self.directory)):
            raise CheckpointError(self.directory, "already holds a server checkpoint of another run; pass "
                                                  "{resume} to continue it, or use an empty folder")

    def __getstate__(self):
        return {**self.__dict__, "_manager": None}

    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=self.keep, create=True))
        return self._manager

    def due(self, version: int, last: bool) -> bool:
        return last or version % self.every == 0

    @staticmethod
    def tree(params: list, opt_leaves: list, version: int, delivered: dict, num_workers: int,
             shards: int = 1) -> dict:
        """What is saved: parameter and optimizer-state leaves (with server shards, the shards' optimizer states one
        after another, and their count), the version and each worker's last delivered seq (-1: none)."""
        positions = np.full(num_workers, -1, np.int64)
        for worker, seq in delivered.items():
            positions[worker] = seq
        out = {"params": [np.asarray(x) for x in params], "opt_state": [np.asarray(x) for x in opt_leaves],
               "version": np.asarray(version, np.int64), "delivered": positions}
        if shards > 1:
            out["shards"] = np.asarray(shards, np.int64)
        return out

    def save(self, tree: dict) -> None:
        import orbax.checkpoint as ocp

        manager = self.manager()
        manager.save(int(tree["version"]), args=ocp.args.StandardSave(tree), force=True)
        manager.wait_until_finished()

    def restore(self, template: dict) -> dict | None:
        """The latest saved state shaped like `template` (a `tree`), or None (no checkpoint, or not resuming); a
        checkpoint of another layout (another number of server shards) is a CheckpointError."""
        if not self.resume or not os.path.isdir(self.directory):
            return None
        import orbax.checkpoint as ocp

        manager = self.manager()
        step = manager.latest_step()
        if step is None:
            return None
        shards = int(template.get("shards", 1))
        wrong = CheckpointError(self.directory, f"holds a server checkpoint of another layout than this run's "
                                                f"({{server_shards}} {shards}, or another model or optimizer), or "
                                                f"one that cannot be read; resume with the run's own settings")
        try:
            restored = manager.restore(step, args=ocp.args.StandardRestore(template))
        except Exception:  # noqa: BLE001 - orbax's own error names trees, not the cause
            raise wrong from None
        same = int(np.asarray(restored.get("shards", 1))) == shards and all(
            np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
            for a, b in zip(restored["params"] + restored["opt_state"], template["params"] + template["opt_state"]))
        if not same:
            raise wrong
        return restored
