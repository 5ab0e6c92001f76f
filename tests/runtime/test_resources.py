"""The compiled step's memory is checked before it runs, and a step failing on the device ends in one line.

Device failures run in subprocesses: after a failed collective XLA:CPU leaves the other device threads blocked, so
the process that saw it can only end with os._exit (as run.py does).
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
import jaxpar.runtime.resources as resources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.ones((4, 2)))

    def __call__(self, x):
        return x @ self.w


def sorting_loss(model, batch):
    """Each example's row of 2**20 floats is sorted: a temporary of 4 MiB per example, which cannot be fused away."""
    y = model(batch["x"])
    wide = jnp.sort(jnp.broadcast_to(y[:, :1], (y.shape[0], 2**20)), axis=1)
    return wide[:, 0].mean(), {}


def machine_memory(monkeypatch, total: int) -> None:
    """Makes this machine report `total` bytes of memory: what a CPU device's share is read from (a CPU device
    reports no limit of its own), so the trainer's whole memory check runs as it would on a smaller machine."""
    real = os.sysconf
    page = real("SC_PAGE_SIZE")
    assert jax.devices()[0].memory_stats() is None and total % page == 0
    monkeypatch.setattr(os, "sysconf", lambda name: total // page if name == "SC_PHYS_PAGES" else real(name))


def test_a_step_whose_temporaries_do_not_fit_is_refused_with_a_batch_that_fits(monkeypatch):
    machine_memory(monkeypatch, 8 * 30 * 2**20)  # 8 CPU devices share it: 30 MiB each
    assert resources.device_memory(jaxpar.make_mesh("8")) == 30 * 2**20
    trainer = jaxpar.Trainer(Tiny, sorting_loss, optax.sgd(0.1), jaxpar.make_mesh("8"))
    state = trainer.init(0)
    with pytest.raises(jaxpar.ResourceError, match=r"^step 'sync' needs [\d,]+ bytes per device \(arguments [\d,]+, "
                                                   r"outputs [\d,]+, temporaries [\d,]+, donated [\d,]+ reused\) but "
                                                   r"a device has 31,457,280; use a global batch of at most about "
                                                   r"8 rows \(now 16\)") as info:
        trainer.step(state, {"x": np.ones((16, 4), np.float32)})
    assert "\n" not in str(info.value)
    needed = int(str(info.value).split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > 30 * 2**20  # 2 examples per device, each sorting 2**20 floats (values, indices, gradient)
    state, metrics = trainer.step(state, {"x": np.ones((8, 4), np.float32)})  # the suggested batch runs
    assert float(metrics["loss"]) == 4.0 and trainer.trace_counts == {"sync": 2}  # traced once per batch shape


def test_the_memory_check_is_on_the_compilation_the_step_uses():
    """No second trace or compile: the AOT compilation checked is the one jit calls (one trace per shape)."""
    trainer = jaxpar.Trainer(Tiny, sorting_loss, optax.sgd(0.1), jaxpar.make_mesh("8"))
    state = trainer.init(0)
    for _ in range(3):
        state, _ = trainer.step(state, {"x": np.ones((8, 4), np.float32)})
    assert trainer.trace_counts == {"sync": 1}
    assert resources.step_bytes(trainer._steps["sync"].lower(state, trainer.shard_batch(
        {"x": np.ones((8, 4), np.float32)}), {}).compile())["temporaries"] >= 4 * 2**20


@pytest.mark.parametrize("model, mesh, kw", [
    ("transformer", "stage=2", {"pipeline": jaxpar.Pipeline("1f1b", 2)}),
    ("transformer", "seq=4", {"context_parallel": "ring"}), ("cnn", "fsdp=8", {"remat": "full"}),
    ("mlp", "data=4", {"strategy": jaxpar.Sync("ring", compress="int8")})])
def test_the_bound_that_spares_the_memory_analysis_holds(model, mesh, kw):
    """The exact total is below 2 x (state + bytes accessed) (measured 4 to 10% of it), so the trainer may skip
    XLA's memory analysis where that bound already fits; the sorting step's temporaries are counted too."""
    import models
    from tests.helpers import TINY, batch_for

    config = TINY[model].replace(layers=2) if model == "transformer" else TINY[model]  # two stages, a scan of two
    cases = [(jaxpar.Trainer(models.factory(config), models.LOSSES[model], optax.adam(0.1), jaxpar.make_mesh(mesh),
                             **kw), batch_for(model, 16))]
    cases.append((jaxpar.Trainer(Tiny, sorting_loss, optax.sgd(0.1), jaxpar.make_mesh("8")),
                  {"x": np.ones((16, 4), np.float32)}))
    for trainer, batch in cases:
        compiled = trainer.compiled_step("sync", batch)
        accessed = resources.bytes_accessed(resources.cost_analysis(compiled))
        assert accessed is not None and resources.step_bytes(compiled)["total"] <= (
            trainer.state_bytes_per_device() + accessed)


def test_the_memory_analysis_runs_only_where_the_bound_does_not_fit(monkeypatch):
    calls = []
    real = resources.step_bytes
    monkeypatch.setattr(resources, "step_bytes", lambda compiled: calls.append(1) or real(compiled))
    trainer = jaxpar.Trainer(Tiny, sorting_loss, optax.sgd(0.1), jaxpar.make_mesh("8"))
    trainer.step(trainer.init(0), {"x": np.ones((8, 4), np.float32)})
    assert calls == []  # a few MiB against this machine's share
    machine_memory(monkeypatch, 8 * 30 * 2**20)
    trainer = jaxpar.Trainer(Tiny, sorting_loss, optax.sgd(0.1), jaxpar.make_mesh("8"))
    trainer.step(trainer.init(0), {"x": np.ones((8, 4), np.float32)})
    assert calls == [1]  # 30 MiB per device: the bound does not fit, the exact analysis says it does


FAILING = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    sys.path.insert(0, {root!r})
    {setup}
""")


def run_script(body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = FAILING.format(root=ROOT, setup=textwrap.dedent(body))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_a_step_failing_on_the_device_raises_one_line_in_fit_not_a_hang():
    result = run_script("""
        import optax, jaxpar
        from tests.runtime.test_resources import Tiny

        def fail_from(step):
            if step >= 3:
                raise RuntimeError(f"sensor offline at batch {step}")

        def loss(model, batch):
            jax.debug.callback(fail_from, batch["s"][0])
            return (model(batch["x"]) ** 2).mean(), {}

        trainer = jaxpar.Trainer(Tiny, loss, optax.sgd(0.1), jaxpar.make_mesh("2x4"))
        batches = ({"x": np.ones((8, 4), np.float32), "s": np.full(8, i, np.int32)} for i in range(100))
        started = time.time()
        try:
            trainer.fit(trainer.init(0), batches, 10)
        except jaxpar.JaxparError as error:
            print(type(error).__name__, error.step, error, flush=True)
            print("seconds", time.time() - started, flush=True)
        os._exit(0)
    """)
    lines = result.stdout.splitlines()
    assert lines[0] == ("DeviceError 3 step 4 failed on the device: INTERNAL: RuntimeError: sensor offline at batch "
                        "3; its train state is lost (restart from a checkpoint or a fresh state)"), result.stdout
    assert float(lines[1].split()[1]) < 30


@pytest.mark.slow
def test_the_cli_ends_a_device_failure_in_one_line_with_a_complete_jsonl(tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = run_script(f"""
        import json, models, run

        calls = []

        def fail_after_a_while(_):
            calls.append(1)
            if len(calls) > 40:  # a few steps in (the callback runs once per device per step)
                raise MemoryError("cannot allocate")

        def failing(config):
            def loss(model, batch):
                jax.debug.callback(fail_after_a_while, batch["label"][0])
                return models.LOSSES[config.model](model, batch)
            return loss

        models.loss_for = failing  # the run builds its loss through models.loss_for
        run.cli(["--model", "mlp", "--mesh", "8", "--steps", "50", "--log-every", "1", "--metrics", {str(metrics)!r}])
    """)
    assert result.returncode == 2, result.stderr[-2000:]
    err = [line for line in result.stderr.splitlines() if line.startswith("run.py")]
    assert len(err) == 1 and err[0].startswith("run.py: error: step ") and err[0].endswith(
        "failed on the device: INTERNAL: MemoryError: cannot allocate; its train state is lost (restart from a "
        "checkpoint or a fresh state)"), result.stderr[-2000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["stopped"] == err[0].removeprefix("run.py: error: ")


def test_readiness_polls_never_sleep_far_past_a_ready_step():
    """`wait_ready`'s polls, simulated: a step ready after `ready_at` seconds is seen within 5% of the wait (or one
    shortest sleep), and a long step is polled a bounded number of times (the old fixed 2 ms cap slept up to 2 ms past
    a 1 ms step)."""
    from jaxpar.runtime.resources import SHORTEST_POLL, next_poll

    for ready_at in (1e-4, 1e-3, 1.5e-3, 1e-2, 1.0, 30.0):
        waited, delay, polls = 0.0, SHORTEST_POLL, 0
        while waited < ready_at:
            waited += delay
            delay = next_poll(delay, waited)
            polls += 1
        assert waited - ready_at <= max(SHORTEST_POLL, 0.05 * ready_at) + 1e-12, (ready_at, waited)
        # shortest sleeps for the first millisecond, then each sleep 5% of the wait: geometric
        assert polls <= 21 + math.log(max(ready_at, 1e-3) / 1e-3, 1.05), (ready_at, polls)
    assert next_poll(2e-3, 1e-3) == SHORTEST_POLL  # the old policy slept 2 ms here
