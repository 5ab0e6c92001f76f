import os
import subprocess
import sys

import numpy as np
import pytest

import jaxpar
from jaxpar.cli import Config
from jaxpar.io import corpus as corpus_lib
from jaxpar.io import data
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def source(n=10):
    return data.ArraySource({"x": np.arange(n), "y": np.arange(n) * 10})


def take(batches, count):
    return [next(batches)["x"].tolist() for _ in range(count)]


def test_every_epoch_is_a_fresh_permutation_and_batches_may_straddle_epochs():
    batches = data.Batches(source(10), 4, seed=0)
    drawn = sum(take(batches, 5), [])  # 20 indices = exactly two epochs
    assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
    assert drawn[:10] != drawn[10:]


def test_order_is_a_pure_function_of_the_seed():
    assert take(data.Batches(source(), 4, seed=1), 3) == take(data.Batches(source(), 4, seed=1), 3)
    assert take(data.Batches(source(), 4, seed=1), 3) != take(data.Batches(source(), 4, seed=2), 3)
    assert take(data.Batches(source(), 4, seed=1, shuffle=False), 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_iterator_state_restores_exactly():
    batches = data.Batches(source(10), 3, seed=0)
    take(batches, 3)
    state = batches.get_state()
    assert state == {"position": 9, "step": 3}
    expected = take(batches, 4)
    fresh = data.Batches(source(10), 3, seed=0)
    fresh.set_state(state)
    assert take(fresh, 4) == expected


def test_device_prefetch_reports_the_state_of_the_next_unconsumed_batch():
    placed = []
    prefetched = data.prefetch_to_device(data.Batches(source(10), 2, seed=0), lambda b: placed.append(1) or b, size=2)
    first = next(prefetched)["x"].tolist()
    assert len(placed) == 2  # one more batch is already on its way
    assert prefetched.get_state() == {"position": 2, "step": 1}
    state = prefetched.get_state()
    second = next(prefetched)["x"].tolist()
    prefetched.set_state(state)
    assert next(prefetched)["x"].tolist() == second != first


def test_batch_size_ramp_draws_the_planned_sizes():
    batches = data.Batches(source(100), lambda step: 4 if step < 2 else 8, seed=0, largest_batch=8)
    assert [len(next(batches)["x"]) for _ in range(4)] == [4, 4, 8, 8]
    assert batches.get_state() == {"position": 24, "step": 4}


def test_text_windows_are_consecutive_bytes():
    tokens = np.arange(50, dtype=np.uint8)
    windows = data.TextWindows(tokens, seq_len=8)
    assert len(windows) == 6
    np.testing.assert_array_equal(windows[np.array([2])]["tokens"][0], np.arange(16, 25))
    assert windows[np.array([0, 5])]["tokens"].dtype == np.int32


def test_default_corpus_is_real_local_text_and_deterministic():
    tokens = data.load_text(max_bytes=1 << 16)
    assert len(tokens) == 1 << 16
    np.testing.assert_array_equal(tokens, data.load_text(max_bytes=1 << 16))
    assert b"def " in tokens.tobytes() or b"import" in tokens.tobytes()


def test_batches_load_only_the_rows_a_process_holds():
    full = data.Batches(source(100), 8, seed=3)
    part = data.Batches(source(100), 8, seed=3, rows=lambda size: np.array([2, 3, 6, 7]))
    for _ in range(3):
        whole, mine = next(full), next(part)
        np.testing.assert_array_equal(mine["x"], whole["x"][[2, 3, 6, 7]])
    assert part.get_state() == full.get_state() == {"position": 24, "step": 3}


def test_data_errors(tmp_path):
    with pytest.raises(jaxpar.DataError, match=r"dataset has 10 examples, fewer than one global batch of 16"):
        data.Batches(source(10), 16, seed=0)
    with pytest.raises(jaxpar.DataError, match=r"no such file or folder"):
        data.load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(jaxpar.DataError, match=r"contains no text \(0 bytes\)"):
        data.load_text(str(tmp_path / "empty.txt"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(jaxpar.DataError, match=r"the folder contains no files"):
        data.load_text(str(tmp_path / "folder"))


@pytest.mark.parametrize("length, seq_len", [(5120, 128), (5119, 128), (100_000, 128), (100_000, 64), (1 << 20, 512),
                                             (3_000, 16)])
def test_held_out_blocks_partition_the_corpus(length, seq_len):
    positions = np.arange(length)  # split_text only looks at the length, so positions show where each byte went
    train, val = data.split_text(positions, seq_len=seq_len)
    assert len(val) > 0 and len(train) + len(val) == length
    np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), positions)  # no byte in both, none lost
    assert (np.diff(train) > 0).all() and (np.diff(val) > 0).all()  # each part keeps the corpus order
    again = data.split_text(positions, seq_len=seq_len)
    np.testing.assert_array_equal(again[0], train)
    np.testing.assert_array_equal(again[1], val)


@pytest.mark.parametrize("seq_len", [16, 128, 200])
def test_windows_never_mix_training_and_held_out_text(seq_len):
    positions = np.arange(300_000)
    train, val = data.split_text(positions, seq_len=seq_len)
    held_out = set(val.tolist())
    for part in (train, val):
        windows = data.TextWindows(part, seq_len)[np.arange(len(data.TextWindows(part, seq_len)))]["tokens"]
        # a window's inputs are one contiguous run of the corpus (blocks are multiples of seq_len); only its last
        # target may come from the next block of the same part
        assert (np.diff(windows[:, :seq_len], axis=1) == 1).all()
        in_held_out = np.isin(windows, val)
        assert in_held_out.all() if part is val else not in_held_out.any()
    assert not held_out & set(train.tolist())


def test_tiny_corpus_still_has_a_held_out_window():
    tokens = np.frombuffer(bytes(range(256)) * 20, dtype=np.uint8)  # tests/cli/test_cli.py's 5,120-byte file
    train, val = data.split_text(tokens)
    assert len(data.TextWindows(val, 128)) == 1 and len(data.TextWindows(train, 128)) == 37
    with pytest.raises(ValueError, match="validation_fraction"):
        data.split_text(tokens, validation_fraction=0)


def test_default_corpus_held_out_blocks_are_about_5_percent_spread_over_the_whole_corpus():
    tokens = data.load_text(None)
    train, val = data.split_text(tokens)
    assert 0.045 < len(val) / len(tokens) < 0.055
    positions = data.split_text(np.arange(len(tokens)))[1]
    np.testing.assert_array_equal(tokens[positions], val)
    assert positions[0] < 0.05 * len(tokens) and positions[-1] > 0.95 * len(tokens)
    starts = positions[np.r_[0, np.flatnonzero(np.diff(positions) > 1) + 1]]
    assert len(starts) >= 40 and np.diff(starts).max() < 0.03 * len(tokens)  # ~50 blocks, evenly spaced
    # the held-out bytes are distributed like the training bytes (the old last-5% split: KL 0.54 bits)
    p, q = (np.bincount(part, minlength=256) + 1.0 for part in (val, train))
    p, q = p / p.sum(), q / q.sum()
    assert (p * np.log2(p / q)).sum() < 0.05


# --- the corpus on disk: each process reads only its windows -------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.05, 0.1, 1 / 3, 0.5])
@pytest.mark.parametrize("length, seq_len", [(1, 16), (40, 16), (5120, 128), (5119, 128), (100_000, 64),
                                             (3_000, 16), (77_777, 200)])
def test_the_lazy_split_is_split_text_position_for_position(length, seq_len, fraction):
    positions = np.arange(length)  # a corpus whose byte k is k: the split's positions, computed without reading
    train, val = data.split_text(positions, fraction, seq_len)
    lazy_train, lazy_val = data.split_corpus(positions, fraction, seq_len)
    assert (len(lazy_train), len(lazy_val)) == (len(train), len(val))
    np.testing.assert_array_equal(lazy_train[np.arange(len(train))], train)
    np.testing.assert_array_equal(lazy_val[np.arange(len(val))], val)
    with pytest.raises(IndexError):
        lazy_val[np.array([len(val)])]


def _files(tmp_path, contents):
    names = []
    for k, content in enumerate(contents):
        (tmp_path / f"f{k}.txt").write_bytes(content)
        names.append(str(tmp_path / f"f{k}.txt"))
    return names


def test_a_corpus_reads_exactly_the_bytes_asked_for_across_files(tmp_path):
    contents = [b"abcdefghij", b"", b"KLMNO", b"pqrstuvwxyz0123456789"]
    corpus = corpus_lib.Corpus(_files(tmp_path, contents), max_bytes=30)
    whole = np.frombuffer(b"".join(contents)[:30], np.uint8)
    assert len(corpus) == 30 and corpus.bytes_read == 0  # sizes come from os.stat
    picked = np.array([[9, 10, 11], [14, 15, 29], [10, 10, 0]])  # across the empty file; repeats; the cut end
    np.testing.assert_array_equal(corpus[picked], whole[picked])
    assert corpus.bytes_read == 7  # distinct positions 0, 9, 10, 11, 14, 15, 29: each read once
    assert corpus.read(8, 16) == whole[8:16].tobytes() and corpus.bytes_read == 15
    with pytest.raises(IndexError):
        corpus[np.array([30])]
    assert len(corpus_lib.Corpus(_files(tmp_path, contents), max_bytes=12).files) == 3  # stops at the cut


def test_empty_runs_and_runs_at_a_file_end_before_an_empty_file(tmp_path):
    corpus = corpus_lib.Corpus(_files(tmp_path, [b"abcd", b"", b"efgh"]))
    assert corpus.runs(np.array([0, 4]), np.array([2, 0])).tobytes() == b"ab"
    assert corpus.runs(np.array([1, 4]), np.array([3, 3])).tobytes() == b"bcdefg"
    assert corpus.rows(np.array([4]), np.array([0]), width=2).shape == (1, 2)
    assert corpus.bytes_read == 2 + 6


def test_many_small_files_read_in_groups_under_the_open_file_budget(tmp_path, monkeypatch):
    """40 files (some empty) with room for 8 open descriptors: runs of one length (windows), runs of mixed lengths
    and runs that cross several files all equal the bytes in memory, each distinct byte read once, and never more
    than 8 descriptors are open."""
    monkeypatch.setattr(corpus_lib, "OPEN_FILES", 8)
    rng = np.random.default_rng(3)
    contents = [bytes(rng.integers(97, 123, int(rng.integers(0, 30)), dtype=np.uint8)) for _ in range(40)]
    corpus = corpus_lib.Corpus(_files(tmp_path, contents), max_bytes=1 << 20)
    whole = np.frombuffer(b"".join(contents), np.uint8)
    opened = []
    real_open = os.open
    monkeypatch.setattr(corpus_lib.os, "open", lambda *a: opened.append(a) or real_open(*a))
    for lengths in (np.full(30, 17), rng.integers(1, 60, 30), np.r_[np.full(29, 5), 300]):
        starts = rng.integers(0, len(whole) - lengths.max(), len(lengths))
        before = corpus.bytes_read
        got = corpus.runs(starts, lengths)
        np.testing.assert_array_equal(got, np.concatenate([whole[a:a + n] for a, n in zip(starts, lengths)]))
        distinct = np.unique(np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)]))
        assert corpus.bytes_read - before == len(distinct)
        assert (corpus._fds >= 0).sum() <= 8
    assert corpus.read(0, len(whole)) == whole.tobytes()  # every file, in groups of at most 4
    assert (corpus._fds >= 0).sum() <= 8 and len(opened) > 40


def test_a_file_that_shrinks_or_goes_during_the_run_is_one_line(tmp_path):
    name, = _files(tmp_path, [b"x" * 100])
    corpus = data.open_corpus(name)
    open(name, "wb").write(b"x" * 50)
    with pytest.raises(jaxpar.DataError, match=r"^--data '.*f0.txt': '.*f0.txt' has shrunk to 50 bytes since the run "
                                               r"started \(it had at least 100\); leave a run's data unchanged while "
                                               r"it trains$"):
        corpus[np.array([60])]
    gone = corpus_lib.Corpus([name], label=name)  # (open_corpus would have it open already: its text sample)
    os.remove(name)
    with pytest.raises(jaxpar.DataError, match=r"^--data '.*f0.txt': cannot read '.*f0.txt' \(No such file or "
                                               r"directory\)$"):
        gone[np.array([0])]
    os.mkdir(name)  # a folder in its place: it opens, and the read itself fails
    with pytest.raises(jaxpar.DataError, match=r"^--data '.*f0.txt': cannot read '.*f0.txt' \(Is a directory\)$"):
        gone[np.array([0])]


def test_opening_reads_nothing_of_the_default_corpus_and_a_bounded_sample_of_data(tmp_path):
    assert data.open_corpus(None).bytes_read == 0
    name, = _files(tmp_path, [b"text " * 100_000])
    assert data.open_corpus(name).bytes_read == corpus_lib.SAMPLE_BYTES


@pytest.mark.parametrize("fraction", [0.05, 0.5])
def test_runs_of_a_part_equal_its_bytes_in_memory_when_they_cross_into_the_next_block(tmp_path, fraction):
    """Every window of both parts, then only windows that cross a block end (each two corpus runs when the part's
    next block is not the corpus's next): the bytes in memory, each distinct byte read once."""
    content = np.random.default_rng(5).integers(0, 256, 77_777, dtype=np.uint8)
    corpus = corpus_lib.Corpus(_files(tmp_path, [content[:30_000].tobytes(), content[30_000:].tobytes()]))
    for part, lazy in zip(data.split_text(content, fraction, 200), data.split_corpus(corpus, fraction, 200)):
        block = lazy.split.block
        every = np.arange(0, len(part) - 200, 37)
        crossing = np.arange(block - 150, len(part) - 200, block)  # 150 bytes in one block, 50 in the next
        assert len(crossing) >= (1 if len(part) > 2 * block else 0)
        for starts in (every, crossing, crossing[:1]) if len(crossing) else (every,):
            before = corpus.bytes_read
            got = lazy.runs(starts, 200)
            np.testing.assert_array_equal(got, part[starts[:, None] + np.arange(200)])
            assert corpus.bytes_read - before == len(np.unique(starts[:, None] + np.arange(200)))


@pytest.mark.parametrize("seq_len", [16, 128])
def test_windows_read_from_disk_equal_the_windows_of_the_corpus_in_memory(seq_len):
    tokens = data.load_text(None)
    corpus = data.open_corpus(None)
    for part, lazy in zip(data.split_text(tokens, seq_len=seq_len), data.split_corpus(corpus, seq_len=seq_len)):
        windows, lazy_windows = data.TextWindows(part, seq_len), data.TextWindows(lazy, seq_len)
        assert len(lazy_windows) == len(windows)
        picked = np.r_[np.random.default_rng(0).integers(0, len(windows), 100), 0, len(windows) - 1]
        np.testing.assert_array_equal(lazy_windows[picked]["tokens"], windows[picked]["tokens"])


def test_a_run_builds_the_batches_of_the_corpus_in_memory_and_a_process_reads_only_its_windows():
    from jaxpar.cli.build import datasets

    config = Config(model="transformer", seq_len=16, seed=3)
    old_train, old_val = data.split_text(data.load_text(None), seq_len=16)  # the whole corpus in memory
    old = data.text_batches(old_train, 8, 16, seed=3)
    train, held_out = datasets(config, lambda step: 8, 8)
    assert train.read_ahead == data.DEFAULT_READ_AHEAD  # a run builds batches ahead: the same batches
    train.read_ahead = 0  # (bytes counted exactly: without the batches a thread would have built ahead)
    for _ in range(5):
        np.testing.assert_array_equal(next(train)["tokens"], next(old)["tokens"])
    np.testing.assert_array_equal(held_out[np.arange(10)]["tokens"], data.TextWindows(old_val, 16)[np.arange(10)]["tokens"])
    corpus = train.source.tokens.corpus
    assert corpus.bytes_read == 5 * 8 * 17 + 10 * 16 + 1  # 40 training windows, 10 consecutive held-out ones
    half, _ = datasets(config, lambda step: 8, 8)
    half.rows = lambda size: np.arange(size // 2, size)  # the second of two processes' rows
    half.read_ahead = 0
    np.testing.assert_array_equal(next(half)["tokens"], next(data.text_batches(old_train, 8, 16, seed=3))["tokens"][4:])
    assert half.source.tokens.corpus.bytes_read == 4 * 17


@pytest.mark.slow
def test_two_processes_draw_the_rows_of_the_one_process_batches_reading_half_the_bytes(tmp_path):
    # 2 processes x 1 CPU device (tests/distributed_data.py) against this process drawing every row
    from jaxpar.cli.build import datasets

    env = child_env()
    done = subprocess.run([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "2", "--devices-per-process", "1",
                           "--", os.path.join(ROOT, "tests", "distributed_data.py"), str(tmp_path / "p")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [dict(np.load(tmp_path / f"p{k}.npz")) for k in (0, 1)]
    train, held_out = datasets(Config(model="transformer", seq_len=16, seed=3), lambda step: 8, 8)
    expected = np.stack([next(train)["tokens"] for _ in range(5)])
    evaluated = next(data.Batches(held_out, 8, seed=0, shuffle=False))["tokens"]
    assert [p["rows"].tolist() for p in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for key, whole in (("first", expected[:3]), ("rest", expected[3:]), ("resumed", expected[3:])):
        np.testing.assert_array_equal(np.concatenate([p[key] for p in got], axis=1), whole)
    np.testing.assert_array_equal(np.concatenate([p["evaluated"] for p in got]), evaluated)
    # each process read its 28 training windows (5 + 2 resumed batches of 4) and 4 held-out ones (65 bytes), not
    # the corpus (4 MiB)
    assert [int(p["bytes_read"]) for p in got] == [7 * 4 * 17 + 65] * 2
    assert int(got[0]["corpus_bytes"]) == data.DEFAULT_CORPUS_BYTES
