"""Loops in the compiled step (a pipeline's ticks, gradient accumulation) counted as often as they run, and
`jaxpar.explain` of a pipelined trainer: ticks, bubble and stage traffic from the compiled step against theory.

Tolerances: ticks and the bubble are integers and the same fraction of integers as theory, compared exactly. Stage
bytes are compared within 5%: measured they are equal, and 5% leaves room for XLA padding a shape or combining a
permute with a small scalar, but not for a tick too many or too few (one tick is 1/7 of GPipe's traffic at S = 4,
M = 4, 1/11 of circular's, 1/14 of 1F1B's)."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.cost.hardware import collective_seconds, compiled_cost, parse_hardware
from jaxpar.cost.hlo import collective_ops, collective_stats, loop_flops, unknown_loops
from jaxpar.cost.pipelines import tick_permutes
from jaxpar.pipeline import Pipeline, Stack
from jaxpar.runtime.resources import step_flops

WIDTH, HIDDEN, ROWS, MICRO = 16, 32, 16, 4
A = ROWS // MICRO * WIDTH * 4  # one microbatch's activation on a device: 4 rows x 16 float32 = 256 bytes


# --- the loop-aware reading on hand-written programs -----------------------------------------------------------------

def ring_scan(trips: int, inner: int = 1):
    """A jitted shard_map over a 4-device axis: `trips` ticks of (`inner` matmuls, then a ppermute round the ring)."""
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def f(w, x):
        def tick(h, _):
            h = lax.scan(lambda g, _: (jnp.tanh(g @ w), None), h, None, length=inner)[0] if inner > 1 else h @ w
            return lax.ppermute(h, "stage", [(i, (i + 1) % 4) for i in range(4)]), None

        return lax.scan(tick, x, None, length=trips)[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    return fn.lower(jnp.ones((64, 64)), jnp.ones((8, 64))).compile()


def test_a_ppermute_in_a_scan_runs_its_trip_count_times_per_step():
    compiled = ring_scan(5)
    [op] = collective_ops(compiled)
    assert (op.kind, op.bytes, op.runs) == ("collective-permute", 8 * 64 * 4, 5)
    [(_, trip)] = op.loops
    assert trip == 5
    assert collective_stats(compiled)["collective-permute"] == {"count": 1, "bytes": 2048}  # what the program holds
    assert collective_stats(compiled, per_step=True)["collective-permute"] == {"count": 5, "bytes": 5 * 2048}
    # priced per step: 5 x (alpha + R / beta)
    profile = parse_hardware("flops=1e12,alpha=1e-5,bandwidth=1e9")
    assert collective_seconds(op, profile) == pytest.approx(5 * (1e-5 + 2048 / 1e9))


def test_nested_loops_multiply_and_flops_count_every_trip():
    compiled = ring_scan(3, inner=4)
    [op] = collective_ops(compiled)
    assert op.runs == 3 and len(op.loops) == 1  # the permute is in the outer loop only
    matmul = 2 * 8 * 64 * 64
    xla = step_flops(compiled)
    # XLA's cost analysis counts each while body once: one tick holding one inner matmul (+ loop counters)
    assert matmul <= xla < 1.1 * matmul
    counted = loop_flops(compiled, xla)
    assert counted.xla == xla and "trip count" in counted.note
    assert 12 * matmul <= counted.per_device < 1.1 * 12 * matmul  # 3 ticks x 4 matmuls


def test_a_loop_of_unknown_trip_count_counts_once_and_says_so():
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])

    def f(n, x):
        def body(c):
            return c[0] + 1, lax.ppermute(c[1], "stage", [(i, (i + 1) % 4) for i in range(4)])

        return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    compiled = fn.lower(jnp.int32(3), jnp.ones((8,))).compile()
    [op] = collective_ops(compiled)
    assert op.runs == 1 and op.loops[0][1] is None
    assert unknown_loops([op]) == [op.loops[0][0]]


def test_no_loops_keeps_the_static_reading():
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    fn = jax.jit(jax.shard_map(lambda x: lax.psum(x, "stage"), mesh=mesh, in_specs=P(), out_specs=P()))
    compiled = fn.lower(jnp.ones((8,))).compile()
    [op] = collective_ops(compiled)
    assert (op.runs, op.loops) == (1, ())
    assert loop_flops(compiled, step_flops(compiled)) == (step_flops(compiled), step_flops(compiled), "")


# --- explain of a pipelined trainer -----------------------------------------------------------------------------------

def named(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Block(nnx.Module):
    """A user's residual MLP block; its parameters named so that a Stack puts `layers` first."""

    def __init__(self, rngs):
        self.up = nnx.Linear(WIDTH, HIDDEN, use_bias=False, rngs=rngs, kernel_init=named("embed", "mlp"))
        self.down = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs, kernel_init=named("mlp", "embed"))

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Net(nnx.Module):
    def __init__(self, rngs, layers):
        self.inp = nnx.Linear(8, WIDTH, rngs=rngs)
        self.blocks = Stack(Block, layers, rngs=rngs)
        self.out = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean(), {}


BATCH = {"x": jax.ShapeDtypeStruct((ROWS, 8), jnp.float32), "y": jax.ShapeDtypeStruct((ROWS,), jnp.int32)}
S = 4
CASES = {  # pipeline, layers, ticks (theory), bubble (theory), stage bytes of the busiest device per step (theory)
    "gpipe": (Pipeline("gpipe", MICRO), 4, MICRO + S - 1, (S - 1) / (MICRO + S - 1), 2 * (MICRO + S - 1) * A),
    "circular": (Pipeline("circular", MICRO, repeats=2), 8, 2 * MICRO + S - 1, (S - 1) / (2 * MICRO + S - 1),
                 2 * (2 * MICRO + S - 1) * A),
    "1f1b": (Pipeline("1f1b", MICRO), 4, MICRO + S - 1, (S - 1) / (MICRO + S - 1), 2 * (MICRO + S - 1) * A),
}
_REPORTS: dict = {}


def explained(name):
    if name not in _REPORTS:
        pipeline, layers = CASES[name][:2]
        trainer = jaxpar.Trainer(lambda rngs: Net(rngs, layers), loss_fn, optax.adam(1e-2), jaxpar.make_mesh("stage=4"),
                                 pipeline=pipeline, hardware="a100-ib100")
        _REPORTS[name] = trainer, jaxpar.explain(trainer, BATCH)
    return _REPORTS[name]


@pytest.mark.parametrize("name", list(CASES))
def test_explain_reads_ticks_bubble_and_stage_traffic_from_the_compiled_schedule(name):
    pipeline, _, ticks, bubble, stage_bytes = CASES[name]
    trainer, report = explained(name)
    sync = report["variants"]["sync"]
    p = sync["pipeline"]
    assert (p["schedule"], p["stages"], p["microbatches"], p["repeats"]) == (name, S, MICRO, pipeline.rounds)
    # ticks: the trip count of the while loop(s) holding the stage permutes; GPipe and circular have a forward loop
    # and the backward loop autodiff makes of it, 1F1B one loop of ticks of two half-steps, each followed by one
    # permute whose pairs go both ways (a stage after its forward sends right, one after its backward left)
    loops = p["loops"]
    assert [loop["ticks"] for loop in loops] == ([ticks] if name == "1f1b" else [ticks, ticks])
    assert sorted(d for loop in loops for d in loop["directions"]) == (
        ["both", "both"] if name == "1f1b" else ["left", "right"])
    assert p["ticks"] == p["ticks_theory"] == pipeline.ticks(S) == ticks
    assert p["kept_inputs"] == (S if name == "1f1b" else ticks)  # 1F1B's stash, or one input per forward tick
    assert p["bubble"] == p["bubble_theory"] == pipeline.bubble(S) == bubble  # exactly: the same integer fraction
    assert p["activation"]["bytes"] == A and p["activation"]["shape"] == [WIDTH]
    assert p["stage_bytes_theory"] == stage_bytes
    assert p["stage_bytes"] == pytest.approx(stage_bytes, rel=0.05)
    # the other collectives over stage are listed apart, never counted as tick traffic
    assert all("stage" in o["axes"].split("+") for o in p["other"])
    assert sync["unexpected"] == 0
    # per-step counts: the permutes over stage run once per tick of each loop (GPipe, circular: a forward and a
    # backward loop) or twice per tick (1F1B), plus those outside the ticks
    [permutes] = [c for c in sync["communication"] if c["kind"] == "collective-permute" and c["axes"] == "stage"]
    in_ticks = 2 * ticks
    outside = sum(o["count"] for o in p["other"] if o["kind"] == "collective-permute" and o["axes"] == "stage")
    assert permutes["count"] == in_ticks + outside
    assert sync["busiest_sent"]["stage"] >= p["stage_bytes"]
    # FLOPs count every tick, not one (XLA's cost analysis counts a while body once)
    assert sync["flops_per_device"] > 2 * sync["xla_flops_per_device"]


@pytest.mark.parametrize("name", list(CASES))
def test_the_cost_model_prices_every_tick(name):
    trainer, report = explained(name)
    compiled = trainer.compiled_step("sync", BATCH)
    ops = collective_ops(compiled, trainer.mesh)
    cost = compiled_cost(compiled, trainer.mesh, trainer.pricer.profile)
    assert cost.comm == pytest.approx(sum(collective_seconds(op, trainer.pricer.profile) for op in ops))
    link = trainer.pricer.profile.links["stage"]
    ticks = tick_permutes(ops)
    runs = sum(op.runs for op in ticks)
    assert runs == (CASES[name][2] * 2)  # 2 permutes per tick (1F1B) or one per tick of 2 loops
    tick_seconds = sum(collective_seconds(op, trainer.pricer.profile) for op in ticks)
    assert tick_seconds == pytest.approx(runs * (link.alpha + A / link.bandwidth))
    sustained = trainer.pricer.profile.compute_flops  # compute is priced at the sustained FLOP/s
    assert cost.compute == pytest.approx(loop_flops(compiled, step_flops(compiled)).per_device / sustained)
    assert report["variants"]["sync"]["projected_seconds"]["communication"] == pytest.approx(cost.comm)


def test_the_explain_text_keeps_its_lines_and_adds_the_pipeline():
    _, report = explained("1f1b")
    text = jaxpar.format_explain(report)
    lines = text.splitlines()
    assert any(line.startswith("  memory per device: ") and ", temporaries " in line for line in lines)
    [permutes] = [line for line in lines if line.startswith("    collective-permute over stage (g=2) x ")]
    ticks = MICRO + S - 1
    assert permutes.startswith(f"    collective-permute over stage (g=2) x {2 * ticks}: {2 * ticks * A:,}, sent "
                               f"{2 * ticks * A:,}")
    assert f"in loops of {ticks} trips" in permutes
    assert "  pipeline 1f1b over stage=4: S=4, M=4, R=1" in lines
    assert any(line.startswith(f"    ticks (compiled while loops holding the stage permutes): {ticks} ticks")
               and line.endswith(f"= {ticks}") for line in lines)
    assert any(line.startswith(f"    bubble (compiled): 3 idle of {ticks} ticks") for line in lines)
    assert any(line.startswith(f"    stage traffic (the ticks' collective-permutes, busiest device, per step): "
                               f"{2 * ticks * A:,} bytes") and "measured / theory 1.000" in line for line in lines)
    assert (f"    activations kept for the backward per device (theory): {S} stage inputs = {S * A:,} bytes; GPipe "
            f"keeps M+S-1 = {ticks} ({S / ticks:.2f} of it)") in lines
    assert "0 collective(s) not explained by theory" in text
    assert "every while body counted its trip count times" in text


def test_gradient_accumulation_multiplies_the_ticks():
    """grad_accum 2 around 1F1B: the tick loop sits in the accumulation loop; per step it runs twice."""
    trainer = jaxpar.Trainer(lambda rngs: Net(rngs, 4), loss_fn, optax.sgd(0.1), jaxpar.make_mesh("stage=4"),
                             pipeline=Pipeline("1f1b", 2), grad_accum=2)
    p = jaxpar.explain(trainer, BATCH)["variants"]["sync"]["pipeline"]
    ticks = 2 + S - 1
    assert p["ticks"] == ticks and p["bubble"] == Pipeline("1f1b", 2).bubble(S)
    a = ROWS // (2 * 2) * WIDTH * 4  # 4 rows per microbatch of an accumulation step
    assert p["activation"]["bytes"] == a
    assert p["stage_bytes"] == p["stage_bytes_theory"] == 2 * 2 * ticks * a
    assert math.isclose(p["stage_bytes"] / p["stage_bytes_theory"], 1.0)
    assert all(loop["starts"] == 2 for loop in p["loops"])
