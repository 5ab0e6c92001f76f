"""`jaxpar.pipeline.shard_keys`: a data shard's draws over its rows equal the whole array's draws at those rows
(bit for bit), through fold_in and split as well, so a pipeline manual over data keeps the masks of every mesh;
draws not over the rows are the whole array's; without partitionable threefry it is one error."""

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.pipeline.shard_keys import _offset_counts, shard_key

KEY = jax.random.fold_in(jax.random.key(3), 7)


@pytest.mark.parametrize("shape", [(8, 5, 3), (6,), (4, 1000)])
def test_each_shards_draws_are_its_rows_of_the_whole_draw(shape):
    rows = shape[0] // 2
    whole = {"bernoulli": jax.random.bernoulli(KEY, 0.7, shape), "uniform": jax.random.uniform(KEY, shape),
             "normal after fold_in": jax.random.normal(jax.random.fold_in(KEY, 5), shape),
             "after split": jax.random.uniform(jax.random.split(KEY)[1], shape)}
    for shard in range(2):
        key = shard_key(KEY, shard * rows, rows)
        local = {"bernoulli": jax.random.bernoulli(key, 0.7, (rows,) + shape[1:]),
                 "uniform": jax.random.uniform(key, (rows,) + shape[1:]),
                 "normal after fold_in": jax.random.normal(jax.random.fold_in(key, 5), (rows,) + shape[1:]),
                 "after split": jax.random.uniform(jax.random.split(key)[1], (rows,) + shape[1:])}
        for name, draw in local.items():
            np.testing.assert_array_equal(draw, whole[name][shard * rows:(shard + 1) * rows], err_msg=name)


def test_a_draw_not_over_the_rows_is_the_whole_arrays():
    np.testing.assert_array_equal(jax.random.bernoulli(shard_key(KEY, 4, 4), 0.5, (1, 16)),
                                  jax.random.bernoulli(KEY, 0.5, (1, 16)))


def test_the_flat_index_carries_into_the_high_word():
    first_row, per_row = 100_000, 70_000  # first_row * per_row = 7e9 > 2 ** 32
    high, low = jax.jit(lambda f: _offset_counts(f, per_row, (2, per_row)))(np.uint32(first_row))
    for (r, j) in [(0, 0), (1, per_row - 1)]:
        index = (first_row + r) * per_row + j
        assert (int(high[r, j]), int(low[r, j])) == (index >> 32, index & 0xFFFFFFFF)


def test_without_partitionable_threefry_it_is_one_error():
    with jax.threefry_partitionable(False):
        with pytest.raises(jaxpar.ModelError, match=r"^dropout in a pipeline stage with data > 1 needs "
                                                    r"jax_threefry_partitionable"):
            shard_key(KEY, 0, 4)
