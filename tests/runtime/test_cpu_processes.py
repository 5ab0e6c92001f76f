"""Gradients across CPU processes in one flat buffer (jaxpar.runtime.distributed.one_buffer_gradients).

XLA:CPU runs an all-reduce of several arrays as one gloo all-reduce per array; on several CPU processes, on a pure
data-parallel mesh, the explicit averages (Sync("psum"), local SGD's meetings, SSP / ASP) therefore send one flat
buffer per dtype. The default Sync() keeps the compiler's step, exactly the single-device computation. Here (one process,
8 devices) the decision is forced on and the compiled step is read; a real 2-process run checks it is on there."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cost.hlo import collective_ops
from jaxpar.parallel.collectives import allreduce_in_one_buffer
from jaxpar.parallel.mesh import REPLICA_AXIS
from jaxpar.parallel.partitioning import PER_REPLICA
from jaxpar.runtime import distributed
from jaxpar.strategies import Sync
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class MLP(nnx.Module):
    def __init__(self, rngs, batch_norm=False):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs) if batch_norm else None
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        h = self.hidden(x)
        return self.out(jax.nn.gelu(self.norm(h) if self.norm is not None else h))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean(), {}


def batch(step):
    rng = np.random.default_rng(step)
    return {"x": rng.standard_normal((32, 8), dtype=np.float32), "y": rng.integers(0, 3, 32).astype(np.int32)}


def test_allreduce_in_one_buffer_equals_pmean_with_one_single_array_all_reduce_per_dtype():
    mesh = jaxpar.make_mesh("8")
    tree = {"a": jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 2, 3), "b": jnp.arange(8.0) ** 2,
            "c": jnp.arange(8 * 4, dtype=jnp.bfloat16).reshape(8, 4)}

    def averaged(mean):
        return jax.jit(jax.shard_map(lambda t: mean(t, REPLICA_AXIS), mesh=mesh, in_specs=PER_REPLICA,
                                     out_specs=PER_REPLICA))

    fused, native = averaged(allreduce_in_one_buffer), averaged(jax.lax.pmean)
    for key, value in fused(tree).items():
        np.testing.assert_allclose(np.asarray(value, np.float32), np.asarray(native(tree)[key], np.float32),
                                   rtol=1e-6)
    ops = collective_ops(fused.lower(tree).compile())
    # one array per dtype (f32: a and b in one buffer, bf16: c; XLA combines the two into one all-reduce);
    # pmean sends one array per leaf
    assert [len(op.arrays) for op in ops] == [2]
    assert [len(op.arrays) for op in collective_ops(native.lower(tree).compile())] == [3]


def test_one_buffer_only_on_several_cpu_processes_and_a_pure_data_parallel_mesh(monkeypatch):
    assert not distributed.one_buffer_gradients(jaxpar.make_mesh("8"))  # this process: one process
    monkeypatch.setattr(distributed, "_several_cpu_processes", lambda: True)
    assert distributed.one_buffer_gradients(jaxpar.make_mesh("8"))
    assert not distributed.one_buffer_gradients(jaxpar.make_mesh("2x4"))  # flattening would all-gather the shards
    assert not distributed.one_buffer_gradients(jaxpar.make_mesh("data=4,fsdp=2"))


class DropoutMLP(nnx.Module):  # no RNG streams of its own: the step's rngs draw the masks (as the lm1b example)
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs):
        return self.out(self.dropout(jax.nn.gelu(self.hidden(x)), rngs=rngs))


def masked_mean_loss(model, batch, rngs):
    """A mean over the valid rows only: replica r (4 rows each on mesh 8) has (r % 4) + 1 of them, so the mean of
    the replicas' own means is NOT this loss."""
    per_row = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"], rngs), batch["y"])
    return (per_row * batch["valid"]).sum() / batch["valid"].sum(), {}


def masked_batch(step):
    rows = np.arange(32)
    return {**batch(step), "valid": ((rows % 4) <= (rows // 4) % 4).astype(np.float32)}


def trained(strategy=None, model=MLP, loss=loss_fn, batches=batch, steps=3):
    trainer = jaxpar.Trainer(model=model, loss_fn=loss, optimizer=optax.adamw(1e-2), mesh=jaxpar.make_mesh("8"),
                             strategy=strategy)
    state, losses = trainer.init(0), []
    for step in range(steps):
        state, metrics = trainer.step(state, batches(step))
        losses.append(float(metrics["loss"]))
    ops = collective_ops(trainer.compiled_step("sync", batches(0)))
    return [len(op.arrays) for op in ops if op.kind == "all-reduce"], losses, jax.tree.leaves(trainer.params(state))


def test_default_sync_on_several_cpu_processes_stays_the_compiler_step_with_dropout_and_a_masked_mean(monkeypatch):
    """The default Sync() is the single-device computation on every mesh, several CPU processes included: dropout
    masks drawn for the global batch and the global masked mean differentiated, bit for bit the same losses and
    parameters as with one process. (The per-replica step the decision once switched to fails this: its masks come
    from fold_in(key, replica) and it averages the replicas' own masked means.)"""
    arrays, losses, params = trained(model=DropoutMLP, loss=masked_mean_loss, batches=masked_batch)
    monkeypatch.setattr(distributed, "_several_cpu_processes", lambda: True)
    assert distributed.one_buffer_gradients(jaxpar.make_mesh("8"))
    forced_arrays, forced_losses, forced_params = trained(model=DropoutMLP, loss=masked_mean_loss,
                                                          batches=masked_batch)
    assert forced_losses == losses
    for a, b in zip(forced_params, params):
        np.testing.assert_array_equal(a, b)
    # the partitioner places the all-reduce at each gradient's producer, as with one process: the valid-row count
    # (forward) alone, then the 4 gradients and the loss's sum combined into one all-reduce of 5 arrays
    assert forced_arrays == arrays == [1, 5]


def test_sync_psum_on_several_cpu_processes_sends_one_flat_buffer_and_equals_the_compiler_step(monkeypatch):
    """Sync(allreduce="psum") (the explicit per-replica step) sends gradients and loss as one flat buffer there:
    for a plain mean over examples without dropout, the compiler step's losses and parameters (rtol 1e-5)."""
    compiler_arrays, compiler_losses, compiler_params = trained()
    assert compiler_arrays == [5]  # 4 gradients + the loss, one array each
    monkeypatch.setattr(distributed, "_several_cpu_processes", lambda: True)
    flat_arrays, flat_losses, flat_params = trained(Sync("psum"))
    assert flat_arrays == [1]  # every gradient and the loss: 4 * (8*16 + 16 + 16*3 + 3 + 1) bytes
    np.testing.assert_allclose(flat_losses, compiler_losses, rtol=1e-5)
    for a, b in zip(flat_params, compiler_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


WORKER = """
import sys
import jaxpar
jaxpar.runtime.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[1]), local_devices=1)
from jaxpar.runtime import distributed
print("one buffer:", distributed.one_buffer_gradients(jaxpar.make_mesh("2")),
      distributed.one_buffer_gradients(jaxpar.make_mesh("1x2")), flush=True)
"""


@pytest.mark.slow
def test_two_cpu_processes_turn_one_buffer_gradients_on():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = child_env()
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(port)], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        outputs = [w.communicate(timeout=120) for w in workers]
    finally:
        for w in workers:
            w.kill()
    assert [w.returncode for w in workers] == [0, 0], outputs[0][1][-2000:]
    assert all("one buffer: True False" in out for out, _ in outputs)  # a model axis of 2: not pure data parallel


@pytest.mark.slow
def test_two_processes_on_a_data_parallel_mesh_equal_one_process(tmp_path):
    """run.py under the launcher, --mesh 2 over 2 processes against 1 process (the compiler's step in both): the
    same losses (rtol 1e-5), 12 steps of the MLP without dropout."""
    import json

    import run

    args = ["--model", "mlp", "--dropout", "0", "--steps", "12", "--log-every", "1", "--eval-batches", "0",
            "--lr", "0.01", "--mesh", "2"]

    def losses(path):
        return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r and "step" in r}

    assert run.main([*args, "--metrics", str(tmp_path / "one.jsonl")]) == 0
    two = subprocess.run([sys.executable, "-m", "jaxpar.runtime.launch", "--nproc", "2", "--", "run.py", *args,
                          "--metrics", str(tmp_path / "two.jsonl")], cwd=ROOT, env=child_env(), capture_output=True,
                         text=True, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    one, two = losses(tmp_path / "one.jsonl"), losses(tmp_path / "two.jsonl")
    assert sorted(two) == list(range(1, 13))
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(two)], rtol=1e-5)


@pytest.mark.parametrize("strategy", [lambda: jaxpar.LocalSGD(period=2), lambda: jaxpar.SSP(staleness=1)])
@pytest.mark.slow
def test_explicit_strategies_on_several_cpu_processes_send_parameters_or_gradients_as_one_array(strategy,
                                                                                              monkeypatch):
    """Local SGD's meeting (the parameter average) and SSP's update (participants' gradients, metrics and count)
    go as one flat array too, with the same result."""
    all_params = 4 * (8 * 16 + 16 + 16 * 3 + 3)

    def run(steps=4):
        trainer = jaxpar.Trainer(model=MLP, loss_fn=loss_fn, optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("8"),
                                 strategy=strategy())
        state = trainer.init(0)
        for step in range(steps):
            state, _ = trainer.step(state, batch(step), step)
        plans = [trainer.strategy.plan(trainer.ctx, step) for step in range(steps)]  # the meeting: step 1
        largest = max(size for plan in plans for op in collective_ops(
            trainer.compiled_step(plan.variant, batch(0), plan.inputs)) for _, size in op.arrays)
        return largest, jax.tree.leaves(trainer.params(state))

    largest, params = run()
    assert largest < all_params  # one array per parameter
    monkeypatch.setattr(distributed, "_several_cpu_processes", lambda: True)
    largest, flat_params = run()
    assert largest >= all_params  # every parameter (or gradient) in one array
    for a, b in zip(flat_params, params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
