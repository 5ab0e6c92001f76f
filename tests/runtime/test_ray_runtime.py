"""The Ray runtime: the emulation predicts it exactly (replaying its real schedule gives its parameters; SSP(0) on
the runtime is sync SGD), faults lose nothing and apply nothing twice, and bad input is one line.

One local Ray instance for the whole module (2 CPUs), tiny MLPs, a few updates."""

import math
import os
import signal
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.runtime.ray import replay_batches, replay_strategy, run

ray = pytest.importorskip("ray")
TOL = 1e-5  # float32 params after ~12 updates: different XLA programs (one device vs a shard_map over two)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.tanh(self.a(x)))


def loss(model, batch):
    return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean(), {}


def batches(worker, workers, seq):
    rng = np.random.default_rng([worker, seq])
    x = rng.standard_normal((4, 4)).astype(np.float32)
    return {"x": x, "y": x.sum(1).astype(np.float32)}


def failing(rngs):
    raise RuntimeError("my model is broken\nsecond line")


@pytest.fixture(scope="module")
def ray_instance():
    from jaxpar.runtime.ray.connect import start

    assert start(num_cpus=2)  # the runtime's own local instance, started once for the module
    yield
    ray.shutdown()


def emulated(strategy, global_batches, optimizer=None):
    trainer = jaxpar.Trainer(Tiny, loss, optimizer or optax.sgd(0.05),
                             jaxpar.make_mesh("data=2", devices=jax.devices()[:2]), strategy=strategy)
    state = trainer.init(0)
    for batch in global_batches:
        state, _ = trainer.step(state, batch)
    return trainer.params(state)


def assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=TOL)


@pytest.mark.slow
def test_a_model_failing_inside_a_worker_is_one_line_and_leaves_nothing(ray_instance, tmp_path):
    with pytest.raises(jaxpar.JaxparError, match=r"^worker 0: model failing: the factory raised RuntimeError: my "
                                                 r"model is broken; it must build") as error:
        run(failing, loss, optax.sgd(0.05), "data=2", jaxpar.ASP(), batches, 3, run_dir=str(tmp_path / "records"))
    assert "\n" not in str(error.value) and not (tmp_path / "records").exists()


@pytest.mark.slow
def test_a_killed_worker_rejoins_and_nothing_is_lost_or_applied_twice(ray_instance, tmp_path):
    def killer(progress, done=[]):  # SIGKILL worker 1 once, mid-run
        if not done and progress["version"] >= 3:
            done.append(os.kill(int(open(tmp_path / "pid1").read()), signal.SIGKILL))

    def slow_batches(worker, workers, seq):
        if worker == 1 and not (tmp_path / "pid1").exists():
            (tmp_path / "pid1").write_text(str(os.getpid()))
        time.sleep(0.05)
        return batches(worker, workers, seq)

    out = run(Tiny, loss, optax.sgd(0.05), "data=2", jaxpar.SSP(1), slow_batches, 30, max_restarts=1,
              on_progress=killer, progress_every=0.2)
    assert out.restarts[1] == 1 and out.duplicates == 0
    for worker in (0, 1):
        seqs = [d.seq for update in out.schedule for d in update if d.worker == worker]
        assert seqs == list(range(len(seqs)))  # every batch exactly once, in order
    assert max(r["staleness_max"] for r in out.records) <= 1


def test_bad_runs_are_refused_before_ray_starts():
    with pytest.raises(jaxpar.MeshError, match="data axis is 1"):
        run(Tiny, loss, optax.sgd(0.1), "data=1,model=2", jaxpar.ASP(), batches, 3)
    with pytest.raises(jaxpar.ConfigError, match="post-local SGD"):
        run(Tiny, loss, optax.sgd(0.1), "data=2", jaxpar.LocalSGD(2, local_after=3), batches, 3)
    with pytest.raises(jaxpar.ConfigError, match="compression is not supported"):
        run(Tiny, loss, optax.sgd(0.1), "data=2", jaxpar.Sync(allreduce="psum", compress="bf16"), batches, 3)


def test_without_ray_the_extra_to_install_is_named(monkeypatch):
    from jaxpar.runtime.ray.connect import ray_module

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(jaxpar.ConfigError, match=r"needs Ray, which is not installed; pip install 'jaxpar\[ray\]'"):
        ray_module()


def test_an_unreachable_address_is_said_quickly():
    from jaxpar.runtime.ray.connect import check_address

    started = time.time()
    with pytest.raises(jaxpar.OptionError, match="ray_address='127.0.0.1:1': nothing answers there"):
        check_address("127.0.0.1:1")
    assert time.time() - started < 30


@pytest.mark.slow
def test_a_killed_server_ends_the_run_in_one_line_and_resumes_exactly(ray_instance, tmp_path):
    """SSP(0) with a straggler, killed and resumed: every update has both workers at staleness 0, and the resumed
    run's parameters are 8 steps of sync SGD on the same batches (SSP(0) on the runtime is sync SGD)."""
    folder, ssp0 = str(tmp_path / "server"), jaxpar.SSP(0, stragglers="0:2.0")

    def kill_server(progress, done=[]):
        if not done and progress["version"] >= 4:
            done.append(os.kill(int(open(tmp_path / "server.pid").read()), signal.SIGKILL))

    def slow_batches(worker, workers, seq):
        time.sleep(0.1)
        return batches(worker, workers, seq)

    died = r"^the parameter server died \(noticed at: [a-z ]+\); the run stops here"
    with pytest.raises(jaxpar.JaxparError, match=died):
        run(Tiny, loss, optax.sgd(0.05), "data=2", ssp0, slow_batches, 8, checkpoint_dir=folder,
            checkpoint_every=2, on_progress=kill_server, progress_every=0.2, run_dir=str(tmp_path))
    out = run(Tiny, loss, optax.sgd(0.05), "data=2", ssp0, batches, 8, checkpoint_dir=folder, checkpoint_every=2,
              resume=True)
    assert out.resumed_at in (4, 6) and out.version == 8
    assert all(r["contributors"] == 2 and r["staleness_max"] == 0 for r in out.records)
    same = [{k: np.concatenate([batches(0, 2, s)[k], batches(1, 2, s)[k]]) for k in ("x", "y")} for s in range(8)]
    assert_close(out.params, emulated(jaxpar.Sync(), same))


@pytest.mark.slow
def test_asynchronous_diloco_across_two_workers_of_two_devices(ray_instance, tmp_path):
    from jaxpar.runtime.ray.outer import delayed_nesterov

    strategy = jaxpar.DiLoCo(2, delayed_nesterov(0.7, 0.9, delay=2), stragglers="1:2.0")
    out = run(Tiny, loss, optax.sgd(0.05), "data=2,model=2", strategy, batches, 6, run_dir=str(tmp_path))
    assert out.version == 6 and all(r["contributors"] == 1 for r in out.records)  # merged as each change arrives
    first = [r["loss"] for r in out.records[:2]]
    assert np.isfinite([r["loss"] for r in out.records]).all() and out.records[-1]["loss"] < max(first)
    assert {d.worker for update in out.schedule for d in update} == {0, 1}


@pytest.mark.slow
def test_local_sgd_meeting_on_the_runtime_is_the_emulated_local_sgd(ray_instance):
    out = run(Tiny, loss, optax.sgd(0.05), "data=2", jaxpar.LocalSGD(2), batches, 3, asynchronous_local=False)
    assert all(r["contributors"] == 2 for r in out.records)
    same = [{k: np.concatenate([batches(0, 2, s)[k], batches(1, 2, s)[k]]) for k in ("x", "y")} for s in range(6)]
    assert_close(out.params, emulated(jaxpar.LocalSGD(2), same))


def test_delayed_nesterov_with_delay_1_is_nesterov_sgd():
    from jaxpar.runtime.ray.outer import delayed_nesterov

    params = {"w": np.ones(3, np.float32)}
    mine, theirs = delayed_nesterov(0.5, 0.9, 1), optax.sgd(0.5, momentum=0.9, nesterov=True)
    a, b = mine.init(params), theirs.init(params)
    for g in (1.0, -2.0, 0.5):
        grads = {"w": np.full(3, g, np.float32)}
        (ua, a), (ub, b) = mine.update(grads, a), theirs.update(grads, b)
        np.testing.assert_allclose(ua["w"], ub["w"], rtol=1e-6)


def test_the_server_waits_for_a_worker_that_has_not_joined_yet():
    """SSP(0) is BSP: a worker whose process is still starting bounds the others as a slow one does, so no update is
    applied with fewer than every worker (the server alone, in this process; no Ray)."""
    import asyncio

    from jaxpar.runtime.ray.compute import leaves_of
    from jaxpar.runtime.ray.server import ParameterServer
    from jaxpar.runtime.ray.spec import make_spec

    async def scenario(strategy):
        server = ParameterServer(make_spec(Tiny, loss, optax.sgd(0.05), "data=2", strategy, batches, 3))
        assert await server.ready() is None
        zeros = [np.zeros_like(x) for x in leaves_of(server.params)]
        version, _, seq, _ = await server.join(0)
        first = asyncio.ensure_future(server.push(0, seq, version, zeros, 1.0))
        await asyncio.sleep(0.05)
        applied_alone = server.version  # worker 1 has not joined
        await server.join(1)
        await asyncio.wait_for(server.push(1, 0, 0, zeros, 1.0), 10)  # (a server that applied alone waits here)
        await asyncio.wait_for(first, 10)
        return applied_alone, server.records[0]["contributors"]

    assert asyncio.run(scenario(jaxpar.SSP(0))) == (0, 2)
    assert asyncio.run(scenario(jaxpar.ASP())) == (1, 1)  # ASP applies each arrival at once


@pytest.mark.slow
def test_the_server_split_over_two_shards_is_the_emulation_and_resumes_with_them(ray_instance, tmp_path):
    """ASP with a 3x straggler, replayed through the emulation, on two ParameterServerShard actors holding Adam's
    parameters and state by bytes: a run saved at its last version (12) and resumed to 16 has the parameters of both
    runs' real schedules, one after the other, replayed through the emulated ASP (so the shards saved and restored
    every part exactly); the workers wrote their records; resuming with one server is one line."""
    adam, folder = optax.adam(0.01), str(tmp_path / "server")
    first = run(Tiny, loss, adam, "data=2", jaxpar.ASP(stragglers="1:3.0"), batches, 12, server_shards=2,
                checkpoint_dir=folder, checkpoint_every=5, run_dir=str(tmp_path / "records"))
    assert first.version == 12 and first.duplicates == 0
    assert max(r["staleness_max"] for r in first.records) >= 1  # the straggler's gradients really were stale
    lines = open(tmp_path / "records" / "worker-1.jsonl").read().splitlines()
    assert lines and all(k in lines[0] for k in ("version_read", "staleness", "wait_s"))
    out = run(Tiny, loss, adam, "data=2", jaxpar.ASP(stragglers="1:3.0"), batches, 16, server_shards=2,
              checkpoint_dir=folder, resume=True)
    assert out.resumed_at == 12 and out.version == 16 and len(out.schedule) == 4
    both = first.schedule + out.schedule
    assert_close(out.params, emulated(replay_strategy(both, 2), replay_batches(both, batches, 2), adam))
    with pytest.raises(jaxpar.JaxparError, match=r"holds a server checkpoint of another layout than this run's "
                                                 r"\(server_shards 1"):
        run(Tiny, loss, adam, "data=2", jaxpar.Sync(), batches, 20, checkpoint_dir=folder, resume=True)


@pytest.mark.slow
def test_an_optimizer_that_couples_the_parameters_is_refused_with_shards(ray_instance, tmp_path):
    clipped = optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.05))
    with pytest.raises(jaxpar.JaxparError, match=r"^server_shards 2: the server's optimizer does not update each "
                                                 r"part of the parameters alone \(differs;") as error:
        run(Tiny, loss, clipped, "data=2", jaxpar.ASP(), batches, 3, server_shards=2, run_dir=str(tmp_path / "r"))
    assert "\n" not in str(error.value) and not (tmp_path / "r").exists()
