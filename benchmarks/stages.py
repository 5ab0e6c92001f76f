"""The built-in transformer pipelined through the Trainer: equivalence, activation memory against M, the bubble
read from the compiled program, and step time of stage=4 against data=4.

    python -m benchmarks.stages                               # all four parts
    python -m benchmarks.stages --parts memory,speed --layers 8

- equivalence: per-step losses (3 steps) and parameters after 3 steps (SGD, lr 0.1) of GPipe, circular and 1F1B on
  stage=2, stage=4, data=2,stage=2,model=2 and data=2,stage=2,fsdp=2, dropout off and on, against the unpipelined
  stacked model on 1x1 with the same microbatch count (the bar: losses rtol 1e-5, parameters atol 2e-5);
- memory: the compiled step's temporaries per device (XLA memory analysis) on stage=4 for M = 4, 8, 16 with a fixed
  microbatch (so the global batch grows with M), in microbatch activations (rows x seq_len x d_model x 4 bytes);
- bubble: the tick loop's trip count in the compiled step against `Pipeline.ticks`, and the bubble it implies
  (1 - useful ticks / ticks) against `Pipeline.bubble`, on stage=4 for M = 4, 8, 16;
- collectives: the all-reduces over data in the compiled step of each schedule on data=2,stage=2 (and with
  model=2) against one gradient average;
- remat: compiled temporaries and FLOPs of GPipe and 1F1B on stage=2 under each remat policy;
- speed: steps/s of stage=4 (or `--speed-mesh`, e.g. data=2,stage=2; each schedule) against data=4 (data=<the
  mesh's devices>) on the same model and global batch, alternating rounds.

Every row is also printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re

import jaxpar
from jaxpar.cli import Config

MESHES = ("stage=2", "stage=4", "data=2,stage=2,model=2", "data=2,stage=2,fsdp=2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="equivalence,memory,bubble,speed")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--microbatches", default="4,8,16", help="M for memory and bubble")
    parser.add_argument("--rows", type=int, default=4, help="rows per microbatch (memory)")
    parser.add_argument("--rounds", type=int, default=3, help="speed: alternating rounds")
    parser.add_argument("--steps", type=int, default=5, help="speed: steps per round")
    parser.add_argument("--speed-mesh", default="stage=4",
                        help="speed: the pipelines' mesh (e.g. data=2,stage=2); the baseline is data=<its devices>")
    parser.add_argument("--speed-dropout", type=float, default=0.0, help="speed: the model's dropout rate")
    args = parser.parse_args()
    jaxpar.make_mesh("8")  # before anything touches JAX: the 8 CPU devices
    parts = args.parts.split(",")
    model = dict(layers=args.layers, d_model=args.d_model, heads=4, d_ff=2 * args.d_model, seq_len=args.seq_len)
    if "equivalence" in parts:
        equivalence(model)
    if "memory" in parts:
        memory(model, [int(m) for m in args.microbatches.split(",")], args.rows)
    if "bubble" in parts:
        bubble(model, [int(m) for m in args.microbatches.split(",")], args.rows)
    if "collectives" in parts:
        collectives(model)
    if "remat" in parts:
        remat()
    if "speed" in parts:
        speed(model, args.rounds, args.steps, args.speed_mesh, args.speed_dropout)


def pipelines(stages: int, microbatches: int):
    from jaxpar.pipeline import Pipeline

    yield Pipeline("gpipe", microbatches)
    yield Pipeline("circular", microbatches, repeats=2)
    yield Pipeline("1f1b", microbatches)


def trained(model, mesh, pipeline, dropout, steps=3, batch_size=16):
    import jax
    import numpy as np

    from benchmarks import common

    import optax

    parts = common.setup("transformer", dropout=dropout, batch_size=batch_size, **model)
    # SGD: under Adam, a parameter whose gradient is near zero moves by up to lr whatever the gradient's float noise,
    # so parameter differences would measure Adam's normalisation rather than the pipeline (AdamW at lr 1e-3 gave
    # 2.3e-4 on data=2,stage=2,model=2 for GPipe, from losses equal to 3e-7)
    trainer = common.trainer(parts, jaxpar.make_mesh(mesh), optimizer=optax.sgd(0.1), pipeline=pipeline)
    state, losses = trainer.init(0), []
    for _, batch in zip(range(steps), common.batches(parts.config)):
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.leaves(trainer.params(state))


def equivalence(model) -> None:
    import numpy as np

    from jaxpar.pipeline import Pipeline

    print("| schedule | mesh | dropout | max loss rel. diff | max parameter abs. diff |\n|---|---|---|---|---|")
    for dropout in (0.0, 0.1):
        want_losses, want_params = trained(model, "1x1", Pipeline(microbatches=4), dropout)
        for mesh in MESHES:
            stages = int(re.search(r"stage=(\d+)", mesh).group(1))
            for pipeline in pipelines(stages, 4):
                if model["layers"] % (stages * pipeline.rounds):
                    continue
                losses, params = trained(model, mesh, pipeline, dropout)
                loss_diff = float(np.max(np.abs(losses - want_losses) / np.abs(want_losses)))
                param_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(params, want_params))
                row = {"part": "equivalence", "schedule": pipeline.schedule, "repeats": pipeline.repeats,
                       "mesh": mesh, "dropout": dropout, "loss_rel_diff": loss_diff, "param_abs_diff": param_diff}
                print(f"| {pipeline.schedule}{' R=2' if pipeline.repeats > 1 else ''} | {mesh} | {dropout} | "
                      f"{loss_diff:.1e} | {param_diff:.1e} |")
                print(json.dumps(row), flush=True)


def compiled(model, mesh, pipeline, batch_size):
    from benchmarks import common

    parts = common.setup("transformer", dropout=0.0, batch_size=batch_size, **model)
    trainer = common.trainer(parts, jaxpar.make_mesh(mesh), pipeline=pipeline)
    variant = next(iter(trainer.variants))
    return trainer.compiled_step(variant, parts.batch)


def memory(model, counts, rows) -> None:
    from jaxpar.pipeline import Pipeline

    activation = rows * model["seq_len"] * model["d_model"] * 4
    print(f"\nstage=4, {model['layers']} layers, {rows} rows per microbatch: one microbatch activation = "
          f"{activation:,} bytes; compiled step temporaries per device:\n")
    print("| M | global batch | GPipe | 1F1B |\n|---|---|---|---|")
    for count in counts:
        row = {"part": "memory", "stages": 4, "microbatches": count, "activation_bytes": activation}
        for schedule in ("gpipe", "1f1b"):
            analysis = compiled(model, "stage=4", Pipeline(schedule, count), rows * count).memory_analysis()
            row[schedule] = analysis.temp_size_in_bytes
        print(f"| {count} | {rows * count} | {row['gpipe']:,} | {row['1f1b']:,} |")
        print(json.dumps(row), flush=True)


def trip_counts(text: str) -> list[int]:
    return [int(n) for n in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', text)]


def bubble(model, counts, rows) -> None:
    from jaxpar.pipeline import Pipeline

    print("\n| schedule | M | compiled ticks | theory ticks | bubble measured | bubble theory |\n|---|---|---|---|---|---|")
    for count in counts:
        for pipeline in pipelines(4, count):
            if model["layers"] % (4 * pipeline.rounds):
                continue
            ticks = pipeline.ticks(4)
            found = trip_counts(compiled(model, "stage=4", pipeline, rows * count).as_text())
            measured = ticks if ticks in found else max(found)  # the tick loop; layer scans run per layer count
            useful = pipeline.rounds * count
            row = {"part": "bubble", "schedule": pipeline.schedule, "repeats": pipeline.repeats,
                   "microbatches": count, "ticks": measured, "theory_ticks": ticks,
                   "bubble": 1 - useful / measured, "theory_bubble": pipeline.bubble(4)}
            print(f"| {pipeline.schedule}{' R=2' if pipeline.repeats > 1 else ''} | {count} | {measured} | {ticks} | "
                  f"{row['bubble']:.3f} | {row['theory_bubble']:.3f} |")
            print(json.dumps(row), flush=True)


def collectives(model) -> None:
    """All-reduces over data in the compiled step (count per step, bytes per device per step) of each schedule on
    data=2,stage=2 and data=2,stage=2,model=2 (M = 4, global batch 16), against one gradient average: the
    parameter bytes a device holds."""
    import math

    import jax

    from benchmarks import common
    from jaxpar.cost.hlo import collective_ops

    print("\n| schedule | mesh | all-reduces over data per step | their bytes per device | one gradient average |"
          "\n|---|---|---|---|---|")
    for mesh in ("data=2,stage=2", "data=2,stage=2,model=2"):
        for pipeline in pipelines(2, 4):
            parts = common.setup("transformer", dropout=0.0, batch_size=16, **model)
            trainer = common.trainer(parts, jaxpar.make_mesh(mesh), pipeline=pipeline)
            ops = [op for op in collective_ops(trainer.compiled_step("sync", parts.batch), trainer.mesh)
                   if op.kind == "all-reduce" and "data" in (op.axes or ())]
            held = sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                       for leaf in jax.tree.leaves(trainer.abstract_state().params))
            runs, nbytes = sum(op.runs for op in ops), sum(op.runs * op.bytes for op in ops)
            name = pipeline.schedule + (" R=2" if pipeline.repeats > 1 else "")
            print(f"| {name} | {mesh} | {runs} | {nbytes:,} | {held:,} |")
            print(json.dumps({"part": "collectives", "schedule": name, "mesh": mesh, "runs": runs, "bytes": nbytes,
                              "gradient_bytes": held}), flush=True)


def remat() -> None:
    """Compiled temporaries per device and FLOPs per step of GPipe and 1F1B on stage=2 (M = 4) under each remat
    policy (the model of tests/pipeline/test_pipeline_remat.py: 4 layers, d_model 64, d_ff 256, seq_len 64, batch 16)."""
    import numpy as np
    import optax

    import models
    from jaxpar.pipeline import Pipeline
    from jaxpar.runtime.resources import step_flops

    config = Config(model="transformer", layers=4, d_model=64, heads=4, d_ff=256, seq_len=64, vocab=256,
                           dropout=0.0)
    batch = {"tokens": np.zeros((16, 65), np.int32)}
    print("\n| schedule | remat | temporaries (bytes) | against none | FLOPs per step | against none |\n"
          "|---|---|---|---|---|---|")
    for schedule in ("gpipe", "1f1b"):
        base = None
        for policy in ("none", "full", "dots", "dots-no-batch"):
            trainer = jaxpar.Trainer(model=models.factory(config), loss_fn=models.LOSSES["transformer"],
                                     optimizer=optax.sgd(0.1), mesh=jaxpar.make_mesh("stage=2"), remat=policy,
                                     pipeline=Pipeline(schedule, 4))
            compiled = trainer.compiled_step("sync", batch)
            temp, flops = compiled.memory_analysis().temp_size_in_bytes, step_flops(compiled)
            base = base or (temp, flops)
            print(f"| {schedule} | {policy} | {temp:,} | {temp / base[0]:.2f} | {flops:,.0f} | {flops / base[1]:.2f} |")
            print(json.dumps({"part": "remat", "schedule": schedule, "remat": policy, "temp_bytes": temp,
                              "flops": flops}), flush=True)


def speed(model, rounds, steps, mesh_spec="stage=4", dropout=0.0) -> None:
    import statistics

    from benchmarks import common
    from jaxpar.pipeline import Pipeline

    parts = common.setup("transformer", dropout=dropout, batch_size=32, **model)
    batch = parts.batch
    mesh = jaxpar.make_mesh(mesh_spec)
    baseline = f"data={mesh.size}"
    runs = {baseline: (jaxpar.make_mesh(baseline), Pipeline()),
            f"{mesh_spec} gpipe": (mesh, Pipeline("gpipe", 8)),
            f"{mesh_spec} 1f1b": (mesh, Pipeline("1f1b", 8))}
    funcs = {}
    for name, (mesh, pipeline) in runs.items():
        trainer = common.trainer(parts, mesh, pipeline=pipeline)
        holder = {"state": trainer.init(0)}

        def step(trainer=trainer, holder=holder):
            holder["state"], metrics = trainer.step(holder["state"], batch)
            return metrics

        funcs[name] = step
    rates = common.alternating_rates(funcs, rounds, steps)
    base = statistics.median(rates[baseline])
    print(f"\n| run | steps/s (median) | against {baseline} |\n|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {median / base:.3f} |")
        print(json.dumps({"part": "speed", "run": name, "steps_per_s": median, "ratio": median / base}), flush=True)


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    lines = []
    eq = [r for r in rows if r.get("part") == "equivalence"]
    if eq:
        lines.append(f"equivalence: max loss rel. diff **{max(r['loss_rel_diff'] for r in eq):.1e}**, max parameter "
                     f"diff **{max(r['param_abs_diff'] for r in eq):.1e}** over {len(eq)} runs")
    mem = [r for r in rows if r.get("part") == "memory"]
    if len(mem) > 1:
        first, last = mem[0], mem[-1]
        extra = (last["microbatches"] - first["microbatches"]) * last["activation_bytes"]
        lines.append("temporaries per extra microbatch, in microbatch activations: " + ", ".join(
            f"{s} **{(last[s] - first[s]) / extra:.2f}**" for s in ("gpipe", "1f1b")))
    bub = [r for r in rows if r.get("part") == "bubble"]
    if bub:
        worst = max(abs(r["bubble"] - r["theory_bubble"]) for r in bub)
        lines.append(f"bubble measured vs theory: max difference **{worst:.3f}** over {len(bub)} schedules")
    for r in rows:
        if r.get("part") == "speed" and " " in r["run"]:  # a pipeline (the baseline is a bare data=N)
            lines.append(f"{r['run']} / data=N steps/s: **{r['ratio']:.3f}**")
    return lines


if __name__ == "__main__":
    main()
