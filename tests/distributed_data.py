"""Run by tests/io/test_data.py under `python -m jaxpar.runtime.launch --nproc N --devices-per-process 1`: each process
builds run.py's text datasets, loads its rows (`BatchPlacer.local_rows`, the rows `Trainer.local_rows` gives) of
the first global batches, resumes from the saved position in a fresh iterator, and saves what it drew and how many
corpus bytes it read.   ARGS: OUT_PREFIX (process k writes OUT_PREFIX<k>.npz)"""

import sys

import jaxpar

jaxpar.runtime.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.cli.build import datasets  # noqa: E402
from jaxpar.cli.config import Config  # noqa: E402
from jaxpar.io import data  # noqa: E402
from jaxpar.train.batches import BatchPlacer  # noqa: E402

BATCH, SEQ_LEN = 8, 16  # what tests/io/test_data.py draws in one process


def draw(batches, count):
    return np.stack([next(batches)["tokens"] for _ in range(count)])


config = Config(model="transformer", seq_len=SEQ_LEN, seed=3)
rows = BatchPlacer(jaxpar.make_mesh(f"data={jax.process_count()}")).local_rows
train, _ = datasets(config, lambda step: BATCH, BATCH)  # as run.py builds them: read ahead in a background thread
train.rows = rows
first = draw(train, 3)
state = train.get_state()
rest = draw(train, 2)
resumed, _ = datasets(config, lambda step: BATCH, BATCH)
resumed.rows = rows
resumed.set_state(state)
resumed_rows = draw(resumed, 2)
train.close(), resumed.close()
# the bytes a process reads for 7 batches and one held-out batch, counted without batches built ahead
counted, held_out = datasets(config, lambda step: BATCH, BATCH)
counted.rows, counted.read_ahead = rows, 0
draw(counted, 7)
evaluated = next(data.Batches(held_out, BATCH, seed=0, shuffle=False, rows=rows))["tokens"]
corpus = counted.source.tokens.corpus
np.savez(f"{sys.argv[1]}{jax.process_index()}.npz", first=first, rest=rest, resumed=resumed_rows,
         evaluated=evaluated, rows=rows(BATCH), corpus_bytes=len(corpus),
         bytes_read=corpus.bytes_read)  # (held_out shares `corpus`)
