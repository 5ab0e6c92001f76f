"""Batches built ahead in a background thread: the same batches, the consumer's exact state, a data error raised at
the batch it belongs to, no thread left behind (close, garbage collection, SIGTERM / SIGINT), a user's own source."""

import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import jaxpar
from jaxpar.io import data
from tests.helpers import trainer_for

MESSAGE = "--data 'x.txt': 'x.txt' has shrunk to 50 bytes since the run started (it had at least 100); leave a run's " \
          "data unchanged while it trains"


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jaxpar-read-ahead")]


class Indices:
    """A user's own source: `__len__` and `__getitem__(indices)`; raises MESSAGE (a DataError) from the draw of
    example `fail_at`'s batch on, and counts the calls."""

    def __init__(self, n=1000, fail_at=None):
        self.n, self.fail_at, self.calls = n, fail_at, 0

    def __len__(self):
        return self.n

    def __getitem__(self, indices):
        self.calls += 1
        if self.fail_at is not None and self.calls > self.fail_at:
            raise jaxpar.DataError(MESSAGE)
        return {"i": np.asarray(indices) * 2, "x": np.asarray(indices, np.float32)[:, None] / 7}


class Images(Indices):
    """The same, as the MLP's examples."""

    def __getitem__(self, indices):
        i = super().__getitem__(indices)["i"]
        return {"image": np.broadcast_to((i % 7 / 7).astype(np.float32)[:, None, None, None], (len(i), 8, 8, 1)),
                "label": (i % 10).astype(np.int32)}


def draw(batches, count):
    return [next(batches) for _ in range(count)]


def test_a_users_source_read_ahead_gives_the_inline_batches_and_the_consumers_state():
    inline = data.Batches(Indices(), lambda step: 48 + 16 * (step % 3), seed=9, largest_batch=80)
    ahead = data.Batches(Indices(), lambda step: 48 + 16 * (step % 3), seed=9, largest_batch=80, read_ahead=3)
    with ahead:
        for step in range(40):  # 40 batches of 48..80 rows: three epochs of 1000
            a, b = next(inline), next(ahead)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
            deadline = time.monotonic() + 10
            while ahead.source.calls < step + 1 + 3 and time.monotonic() < deadline:
                time.sleep(0.001)  # the thread has built 3 batches ahead of the consumer
            assert ahead.source.calls == step + 1 + 3
            assert ahead.get_state() == inline.get_state()  # the next batch `next` returns, not the thread's
    assert not readers()


def test_saved_mid_run_with_read_ahead_and_device_prefetch_resumes_bit_identically():
    def pipeline():
        return data.prefetch_to_device(data.Batches(Indices(), 64, seed=3, read_ahead=2), lambda b: dict(b), size=2)

    with pipeline() as run:
        draw(run, 5)
        state = run.get_state()
        assert state == {"position": 5 * 64, "step": 5}
        expected = draw(run, 30)
    with pipeline() as resumed:
        resumed.set_state(state)
        got = draw(resumed, 30)
    for a, b in zip(expected, got):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not readers()


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_a_data_error_is_raised_by_the_next_of_the_batch_it_belongs_to(read_ahead):
    batches = data.prefetch_to_device(data.Batches(Indices(fail_at=4), 10, seed=0, read_ahead=read_ahead),
                                      lambda b: b, size=2)
    draw(batches, 4)  # batches 0..3 come, though batch 4 failed while they were being read ahead
    assert batches.get_state() == {"position": 40, "step": 4}
    with pytest.raises(jaxpar.DataError) as raised:
        next(batches)
    assert str(raised.value) == MESSAGE
    batches.close()
    assert not readers()


def test_a_corpus_file_that_shrinks_under_read_ahead_is_the_same_one_line(tmp_path):
    name = tmp_path / "f.txt"
    name.write_bytes(b"abcdefghij" * 100)
    tokens, _ = data.split_corpus(data.open_corpus(str(name)), seq_len=8)
    batches = data.text_batches(tokens, 4, 8, seed=0, read_ahead=2)
    name.write_bytes(b"x" * 50)
    with pytest.raises(jaxpar.DataError, match=rf"^--data '{name}': '{name}' has shrunk to 50 bytes since the run "
                                               r"started \(it had at least 1000\); leave a run's data unchanged while "
                                               r"it trains$"):
        next(batches)
    assert not readers()


def test_fit_meets_the_data_error_at_the_step_of_its_batch():
    trainer = trainer_for("mlp", "8")

    class Counted:
        def __init__(self, batches):
            self.batches, self.taken = batches, 0

        def __iter__(self):
            return self

        def __next__(self):
            batch = next(self.batches)
            self.taken += 1
            return batch

    batches = Counted(data.prefetch_to_device(data.Batches(Images(n=256, fail_at=5), 16, seed=0, read_ahead=2),
                                              trainer.shard_batch))
    with pytest.raises(jaxpar.DataError, match="^" + MESSAGE.replace("(", r"\(").replace(")", r"\)") + "$"):
        trainer.fit(trainer.init(0), batches, 20)
    assert batches.taken == 5  # steps 1..5 ran on batches 0..4; the 6th batch (its draw failed) raised
    batches.batches.close()
    assert not readers()


def test_close_and_garbage_collection_leave_no_thread():
    batches = data.Batches(Indices(), 32, seed=0, read_ahead=2)
    next(batches)
    assert len(readers()) == 1
    batches.close()
    assert not readers()
    next(batches)  # a new thread, at the same position
    assert batches.get_state() == {"position": 64, "step": 2}
    del batches
    gc.collect()
    deadline = time.monotonic() + 5
    while readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not readers()


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_and_ctrl_c_end_a_run_with_no_read_ahead_thread_left(signum, code, tmp_path, capsys):
    import run

    ended, unanswered = threading.Event(), []

    def send():  # once training reads ahead, and a few steps later
        deadline = time.monotonic() + 300
        while not readers() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)
        os.kill(os.getpid(), signum)
        if not ended.wait(120):  # the run went on: fail instead of training a million steps
            unanswered.append(signum)
            os.kill(os.getpid(), signal.SIGTERM)

    # Ctrl-C as a terminal delivers it: Python's own handler (a process started in the background ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=send, daemon=True).start()
    try:
        code_seen = run.main(["--model", "mlp", "--hidden", "16", "--steps", "1000000", "--eval-batches", "0",
                              "--batch-size", "64"])
    finally:
        ended.set()
        signal.signal(signal.SIGINT, previous)
    assert not unanswered and code_seen == code
    assert capsys.readouterr().err == f"run.py: {'terminated' if signum == signal.SIGTERM else 'interrupted'}\n"
    assert not readers()


def test_device_prefetch_places_read_ahead_batches_in_the_thread_that_builds_them():
    where = []

    def put(batch):
        where.append(threading.current_thread().name)
        return {k: v + 0 for k, v in batch.items()}

    with data.prefetch_to_device(data.Batches(Indices(), 16, seed=1, read_ahead=2), put) as ahead:
        got = draw(ahead, 6)
    inline = data.prefetch_to_device(data.Batches(Indices(), 16, seed=1), put)
    expected = draw(inline, 6)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(got, expected) for k in a)
    assert set(where[:6]) == {"jaxpar-read-ahead:dataset"} and set(where[-6:]) == {threading.main_thread().name}
