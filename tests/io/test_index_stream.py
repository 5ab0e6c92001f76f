"""The vectorized index stream is grain's shuffled, repeated order exactly, so a saved data position means the same
batch as it did when the order came from grain one index at a time."""

import os

import grain
import numpy as np
import pytest
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module

from jaxpar.io import data
from jaxpar.io.checkpoint import Checkpointer
from jaxpar.io.index_stream import IndexStream, permute, round_keys

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "checkpoint_v1")


def grain_order(n: int, seed: int, positions, shuffle: bool = True) -> np.ndarray:
    """What `Batches` drew before the index stream: grain's MapDataset, one index per call."""
    order = grain.MapDataset.range(n)
    order = (order.shuffle(seed=seed) if shuffle else order).repeat(None)
    return np.array([order[int(p)] for p in positions], np.int64)


def test_round_keys_are_std_seed_seq():
    # std::seed_seq{s}.generate of 4 words, as a C++ program built with g++ (libstdc++) printed them
    assert round_keys(0) == [2963817213, 69796629, 1973464570, 532167439]
    assert round_keys(1) == [1304574429, 1385991880, 1625791478, 1649374289]
    assert round_keys(2**32 - 1) == [3258260622, 2976084991, 227751652, 537413182]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 255, 256, 257, 1497, 16_385, 65536, 65537, 70_001, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1, 12345, 2**32 - 1])
@pytest.mark.slow
def test_permute_is_grains_index_shuffle(n, seed):
    """Up to n = 2**14 the whole epoch is computed (`whole_permutation`: pointer jumping), above it each value walked."""
    indices = np.arange(n) if n <= 4096 else np.random.default_rng(n).integers(0, n, 1500)
    expected = [index_shuffle_module.index_shuffle(int(i), max_index=n - 1, seed=seed, rounds=4) for i in indices]
    np.testing.assert_array_equal(permute(indices, n, seed), expected)


@pytest.mark.parametrize("n, seed", [(10, 0), (10, 3), (1497, 0), (1497, 7), (33_000, 1), (5, 2**32 - 2)])
@pytest.mark.slow
def test_stream_is_grains_order_across_epochs(n, seed):
    positions = np.concatenate([np.arange(0, min(3 * n, 3000)), np.arange(n - 100, n + 100) % (3 * n),
                                np.arange(7 * n - 50, 7 * n + 50)])
    np.testing.assert_array_equal(IndexStream(n, seed)[positions], grain_order(n, seed, positions))
    np.testing.assert_array_equal(IndexStream(n, seed, shuffle=False)[positions],
                                  grain_order(n, seed, positions, shuffle=False))


def test_every_epoch_is_a_permutation_and_huge_sources_compute_per_batch(monkeypatch):
    stream = IndexStream(1000, seed=4)
    for epoch in range(3):
        assert sorted(stream.epoch(epoch).tolist()) == list(range(1000))
    cached = stream[np.arange(900, 1400)]
    monkeypatch.setattr("jaxpar.io.index_stream.EPOCH_CACHE_EXAMPLES", 10)  # per batch, without a whole epoch
    np.testing.assert_array_equal(IndexStream(1000, seed=4)[np.arange(900, 1400)], cached)


@pytest.mark.parametrize("kind", ["sync", "local_sgd"])
def test_a_checkpoint_from_before_the_index_stream_resumes_at_the_same_batch(kind):
    meta = Checkpointer(os.path.join(DATA, kind)).meta(3)
    config = meta["config"]
    train, _ = data.load_digits()
    batches = data.array_batches(train, config["batch_size"], config["seed"])
    batches.set_state(meta["batches"])
    position = meta["batches"]["position"]
    expected = grain_order(len(train["label"]), config["seed"], range(position, position + config["batch_size"]))
    np.testing.assert_array_equal(next(batches)["label"], train["label"][expected])
    expected = grain_order(len(train["label"]), config["seed"], range(position + 16, position + 32))
    np.testing.assert_array_equal(next(batches)["image"], train["image"][expected])


def test_batches_draw_grains_rows_for_one_process_and_for_its_share():
    n, seed = 1497, 5
    indices = {"i": np.arange(n)}
    whole = data.Batches(indices, 512, seed=seed)
    share = data.Batches(indices, 512, seed=seed, rows=lambda size: np.arange(size // 4, size // 2))
    for step in range(5):  # 2560 positions: across the first epoch boundary
        expected = grain_order(n, seed, range(step * 512, step * 512 + 512))
        np.testing.assert_array_equal(next(whole)["i"], expected)
        np.testing.assert_array_equal(next(share)["i"], expected[128:256])


