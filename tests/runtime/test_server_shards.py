"""The split of the server's parameters over shard actors (`jaxpar.runtime.ray.shards`), without Ray: by bytes,
deterministic, refused past the number of arrays; and the check that the optimizer updates each part alone."""

import numpy as np
import optax
import pytest

from jaxpar.errors import ConfigError
from jaxpar.runtime.ray.shards import check_separable, split_by_bytes


def test_the_split_balances_bytes_largest_first():
    assert split_by_bytes([400, 100, 300, 200], 2) == [[0, 1], [2, 3]]  # 500 and 500
    assert split_by_bytes([10, 10, 10], 3) == [[0], [1], [2]]
    assert split_by_bytes([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert split_by_bytes([7], 1) == [[0]]


def test_more_shards_than_arrays_is_one_line():
    with pytest.raises(ConfigError, match=r"^server_shards 3: the model has 2 parameter arrays, fewer than the shards "
                                          r"to split them over; use server_shards 2 or fewer$"):
        split_by_bytes([4, 4], 3)


@pytest.mark.parametrize("optimizer, separable", [
    (optax.sgd(0.1), True), (optax.sgd(0.1, momentum=0.9, nesterov=True), True), (optax.adam(1e-3), True),
    (optax.adamw(1e-3, weight_decay=0.1), True),
    (optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1)), False),
])
def test_the_optimizer_check(optimizer, separable):
    leaves = [np.ones((3, 4), np.float32), np.zeros(4, np.float32), np.full((4, 2), 0.5, np.float32)]
    problem = check_separable(optimizer, leaves, split_by_bytes([48, 16, 32], 2))
    assert (problem is None) == separable


def test_an_option_error_pickles_whole():
    """The server hands a CheckpointError to the driver through Ray (pickled): its flag form survives."""
    import pickle

    from jaxpar.errors import CheckpointError, cli_message

    error = pickle.loads(pickle.dumps(CheckpointError("ckpt", "holds another layout ({server_shards} 2)")))
    assert type(error) is CheckpointError and str(error) == "checkpoint_dir='ckpt': holds another layout (server_shards 2)"
    assert cli_message(error) == "--checkpoint-dir 'ckpt': holds another layout (--server-shards 2)"
