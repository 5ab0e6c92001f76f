"""The parameter server's state saved with orbax every `every` versions (and at the end): parameters, optimizer
state, version, and each worker's position in its data (its last delivered seq). `resume` restores the latest, so
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

    def _tree(self, server) -> dict:
        import jax

        delivered = np.full(server.spec.num_workers, -1, np.int64)
        for worker, seq in server.delivered.items():
            delivered[worker] = seq
        return {"params": [np.asarray(x) for x in jax.tree.leaves(jax.device_get(server.params))],
                "opt_state": [np.asarray(x) for x in jax.tree.leaves(jax.device_get(server.opt_state))],
                "version": np.asarray(server.version, np.int64), "delivered": delivered}

    def save(self, server) -> None:
        import orbax.checkpoint as ocp

        manager = self.manager()
        manager.save(server.version, args=ocp.args.StandardSave(self._tree(server)), force=True)
        manager.wait_until_finished()

    def restore(self, server) -> dict | None:
        """The latest saved state, or None (no checkpoint, or not resuming)."""
        if not self.resume or not os.path.isdir(self.directory):
            return None
        import orbax.checkpoint as ocp

        manager = self.manager()
        step = manager.latest_step()
        if step is None:
            return None
        return manager.restore(step, args=ocp.args.StandardRestore(self._tree(server)))
