"""The allreduce algorithms of `jaxpar.parallel.collectives` inside the real train step: collectives XLA emitted vs theory,
and step time, on the 8-device data axis (mesh "8", i.e. 8 x 1).

    python -m benchmarks.collectives                              # transformer (default config, dropout 0)
    python -m benchmarks.collectives --model mlp --steps 50       # the digits MLP (tiny gradients: latency bound)
    python -m benchmarks.collectives --fsdp                       # FSDP (ZeRO-3) traffic on 5 meshes, vs theory

For each variant (`Sync()`: the partitioner's all-reduce, labelled "gspmd"; `Sync("psum")`, `Sync("ring")`,
`Sync("torus2d")`, `Sync("ps")`: the explicit `shard_map` average) the step is lowered and compiled, and
`jaxpar.cost.hlo.collective_stats` counts the collectives in the optimised HLO: count and result bytes per op kind.
Shapes inside `shard_map` are per device, so a ring's permute of `f32[59712]` sends 238,848 bytes from *every*
device. "sent/dev" is the bytes the busiest device sends, read from each collective-permute's
`source_target_pairs` (a parameter server's permutes have one pair each: only the root sends B seven times,
whereas the HLO sum of permute bytes, 14 B, is the traffic of all devices together). It is compared with
`jaxpar.parallel.collectives.theoretical_traffic(algorithm, 8, gradient_bytes)`, gradient_bytes = the float32 parameter
bytes. The ring pads the fused gradient to a multiple of 8 elements, so it can send slightly more than
2(N-1)/N x gradient bytes. All-reduces are shown with their result bytes (the buffer reduced), not bytes sent:
how XLA:CPU moves them is not visible in HLO. Besides the gradient, each step reduces two f32 scalars (loss and
accuracy; in the gspmd/psum steps they ride in the gradient's all-reduce, +8 bytes).

Step time: rounds of `--steps` timed steps per variant alternate in one process (gspmd, psum, ring, torus2d, ps,
gspmd, ...) with the same two-steps-in-flight loop as `benchmarks.overhead`; the median steps/s and its ratio
to psum are printed.

On one CPU host the "network" is memory: a collective-permute is a memcpy between buffers of one process, and
8 devices share 2 cores. Step-time ratios therefore reflect the number of collective ops (each one a rendezvous
of 8 device threads) and their latency, not link bandwidth; the bytes columns are what would matter on a cluster.

`--fsdp` prints a different table instead: the `Sync()` step (the partitioner inserts every collective) on the
meshes of `--meshes` (default fsdp=8, data=2,fsdp=4, data=2,fsdp=2,model=2, fsdp=4,model=2 and 8 for reference).
Per mesh: count and result bytes per device of each collective kind (`jaxpar.cost.hlo.collective_stats`); the bytes a device
holds of the parameters and of parameters + optimizer state (summed over a real initialised state's shards on
the fullest device); and FSDP traffic vs theory. Theory: with an fsdp axis of N, ZeRO-3 all-gathers the
parameters for the forward pass, again for the backward pass, and reduce-scatters the gradients; each moves
(N-1)/N of the gathered bytes per device on a ring, so theory = 3 x (N-1)/N x P_f, where P_f = the sum, over the
parameters whose sharding names the fsdp axis, of (bytes / split over the other axes) = N x the bytes of their
shard on one device: what one fsdp group gathers (a parameter also split over `model` counts 1/model of its
bytes). Measured: every collective whose replica groups span the fsdp axis alone, as bytes sent per device on
a ring from its result bytes R and group size g: all-gather (g-1)/g R, reduce-scatter (g-1) R, all-reduce
2(g-1)/g R, all-to-all (g-1)/g R; split into parameters + gradients (results shaped like a parameter gathered
over fsdp, or like its shard for a reduce-scatter; dims compared as sorted tuples) and the rest (activations).
"params gathered" and "grads reduced" say how many times P_f those parameter-shaped collectives moved: 2 gathers
and 1 reduce-scatter is textbook ZeRO-3; XLA may keep the forward gather for the backward pass (1 gather), or
all-reduce a gradient and slice it (AR: twice the bytes of a reduce-scatter). Collectives over other axis sets
(data-axis gradient all-reduces, tensor-parallel all-reduces over `model`, one op over data and fsdp together)
are listed per mesh below the table, not counted as fsdp traffic.
"""

import argparse
import json
import re
import statistics

import jaxpar
from benchmarks import common
from benchmarks.report import num

VARIANTS = (("gspmd", None), ("psum", "psum"), ("ring", "ring"), ("torus2d", "torus2d"), ("ps", "ps"))
KINDS = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter")
FSDP_MESHES = ("fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,model=2", "fsdp=4,model=2", "8")
FSDP_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def permute_bytes_sent(hlo_text: str) -> dict[int, int]:
    """Bytes each device sends through collective-permutes: every (source, target) pair sends the result shape."""
    from jaxpar.cost.hlo import shape_bytes

    sent: dict[int, int] = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+collective-permute(?:-start)?\(", line)
        pairs = re.search(r"source_target_pairs=(\{\{.*?\}\})", line)
        if not match or not pairs:
            continue
        size = shape_bytes(match.group(1))
        for source, _ in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1)):
            sent[int(source)] = sent.get(int(source), 0) + size
    return sent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", choices=["transformer", "mlp"])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="the FSDP table (Sync() on --meshes) instead")
    parser.add_argument("--meshes", default=";".join(FSDP_MESHES), help="--fsdp: mesh specs separated by ';'")
    args = parser.parse_args()
    mesh = jaxpar.make_mesh("8")  # before anything touches JAX: provides the CPU devices
    if args.fsdp:
        fsdp_table(args)
    else:
        allreduce_table(args, mesh)


def allreduce_table(args, mesh):
    import jax

    from jaxpar.parallel.collectives import theoretical_traffic
    from jaxpar.cost.hlo import collective_stats

    parts = common.setup(args.model, dropout=0.0, batch_size=args.batch_size)
    n = mesh.shape["data"]

    steps, results = {}, {}
    for label, algorithm in VARIANTS:
        trainer = common.trainer(parts, mesh, strategy=jaxpar.Sync(algorithm))
        state = trainer.init(0)
        compiled = trainer.compiled_step("sync", parts.batch)
        stats = collective_stats(compiled)
        sent = permute_bytes_sent(compiled.as_text())
        grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params)
                         if x.dtype == jax.numpy.float32)
        theory = theoretical_traffic(algorithm or "psum", n, grad_bytes)
        results[label] = {
            "model": args.model, "mesh": "8", "variant": label, "allreduce": algorithm, "gradient_bytes": grad_bytes,
            **{f"{k}_count": stats[k]["count"] for k in KINDS}, **{f"{k}_bytes": stats[k]["bytes"] for k in KINDS},
            "permute_bytes_sent_max_device": max(sent.values(), default=0),
            "theory_steps": theory["steps"], "theory_bytes_sent_per_device": theory["bytes_sent_per_device"]}
        steps[label] = stepper(trainer, state, trainer.shard_batch(parts.batch))

    rates = common.alternating_rates(steps, args.rounds, args.steps)
    for label, _ in VARIANTS:
        results[label]["steps_per_sec"] = statistics.median(rates[label])
    for label, _ in VARIANTS:
        results[label]["ratio_to_psum"] = results[label]["steps_per_sec"] / results["psum"]["steps_per_sec"]

    grad_bytes = results["psum"]["gradient_bytes"]
    print(f"{args.model}, mesh 8 (8 data x 1 model), global batch {args.batch_size}; gradient {grad_bytes:,} bytes "
          f"float32; bytes are per device (HLO shapes inside shard_map); median of {args.rounds} rounds x "
          f"{args.steps} steps")
    header = (f"{'variant':9s}{'AR n':>5s}{'AR bytes':>11s}{'CP n':>6s}{'CP bytes':>12s}{'AG n':>5s}{'RS n':>5s}"
              f"{'sent/dev':>12s}{'theory':>12s}{'meas/th':>8s}{'th steps':>9s}{'steps/s':>9s}{'vs psum':>8s}")
    print(header)
    for label, _ in VARIANTS:
        r = results[label]
        sent = r["permute_bytes_sent_max_device"]
        vs_theory = f"{sent / r['theory_bytes_sent_per_device']:8.4f}" if sent else f"{'-':>8s}"
        print(f"{label:9s}{r['all-reduce_count']:5d}{r['all-reduce_bytes']:11,d}{r['collective-permute_count']:6d}"
              f"{r['collective-permute_bytes']:12,d}{r['all-gather_count']:5d}{r['reduce-scatter_count']:5d}"
              f"{sent:12,d}{r['theory_bytes_sent_per_device']:12,.0f}{vs_theory}{r['theory_steps']:9d}"
              f"{r['steps_per_sec']:9.2f}{r['ratio_to_psum']:8.3f}")
    print("AR/CP/AG/RS = all-reduce / collective-permute / all-gather / reduce-scatter (count n, result bytes); "
          "sent/dev = permute bytes sent by the busiest device; theory = theoretical_traffic bytes_sent_per_device "
          "(for gspmd/psum: what a ring all-reduce would send)")
    for label, _ in VARIANTS:
        print(json.dumps(results[label]))


def stepper(trainer, state, sharded_batch):
    """A step function for `common.run_steps`: one `trainer.step` on `sharded_batch`, the state carried along."""
    def step():
        nonlocal state
        state, metrics = trainer.step(state, sharded_batch, 0)  # step_number only feeds Sync's sim clock
        return metrics

    return step


# --- FSDP ----------------------------------------------------------------------------------------------------------
def device_bytes(tree) -> int:
    """Bytes the fullest device holds of a tree of placed arrays (summed over its shards)."""
    import jax

    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def fsdp_table(args):
    import jax

    from jaxpar.parallel import mesh as mesh_lib
    from jaxpar.cost.hlo import bytes_sent, collective_ops, collective_stats

    parts = common.setup(args.model, dropout=0.0, batch_size=args.batch_size)
    rows = []
    for spec in args.meshes.split(";"):
        mesh = jaxpar.make_mesh(spec)
        trainer = common.trainer(parts, mesh, strategy=jaxpar.Sync())
        state = trainer.init(0)
        compiled = trainer.compiled_step("sync", parts.batch)
        stats, ops = collective_stats(compiled), collective_ops(compiled.as_text(), mesh)
        for kind in FSDP_KINDS:  # the two parsers must agree before the split by axes is trusted
            mine = (sum(o.kind == kind for o in ops), sum(o.bytes for o in ops if o.kind == kind))
            assert mine == (stats[kind]["count"], stats[kind]["bytes"]), (spec, kind, mine, stats[kind])
        n = mesh.shape[mesh_lib.FSDP_AXIS]
        # P_f = what one fsdp group gathers: N x each fsdp-sharded parameter's shard; `gathered` / `shards`: the
        # (sorted) shapes of those parameters gathered over fsdp only / of their shards, to recognise them in HLO
        fsdp_group_bytes, gathered, shards = 0, set(), set()
        for leaf in jax.tree.leaves(state.params):
            axes = [(e,) if isinstance(e, str) else tuple(e or ()) for e in leaf.sharding.spec]
            if any(mesh_lib.FSDP_AXIS in a for a in axes):
                shard = leaf.sharding.shard_shape(leaf.shape)
                fsdp_group_bytes += n * leaf.addressable_shards[0].data.nbytes
                shards.add(tuple(sorted(shard)))
                gathered.add(tuple(sorted(d * (n if i < len(axes) and mesh_lib.FSDP_AXIS in axes[i] else 1)
                                          for i, d in enumerate(shard))))
        on_fsdp = [o for o in ops if o.axes == (mesh_lib.FSDP_AXIS,)]

        def param_bytes(kinds, shapes):
            return sum(b for o in on_fsdp if o.kind in kinds for dims, b in o.arrays if dims in shapes)

        param_ag = param_bytes({"all-gather"}, gathered)
        grad_ar, grad_rs = param_bytes({"all-reduce"}, gathered), param_bytes({"reduce-scatter"}, shards)
        sent = sum(bytes_sent(o) for o in on_fsdp)
        sent_params = (n - 1) / n * (param_ag + 2 * grad_ar) + (n - 1) * grad_rs
        breakdown: dict = {}
        for o in ops:
            key = (o.kind, "+".join(o.axes) or "-", o.group)
            count, size = breakdown.get(key, (0, 0))
            breakdown[key] = (count + 1, size + o.bytes)
        rows.append({
            "mesh": spec, "fsdp": n, **{f"{k}_count": stats[k]["count"] for k in FSDP_KINDS},
            **{f"{k}_bytes": stats[k]["bytes"] for k in FSDP_KINDS},
            "param_bytes_total": sum(x.nbytes for x in jax.tree.leaves(state.params)),
            "param_bytes_per_device": device_bytes(state.params),
            "param_opt_bytes_per_device": device_bytes((state.params, state.opt_state)),
            "fsdp_group_param_bytes": fsdp_group_bytes,
            "fsdp_param_allgather_bytes": param_ag, "fsdp_grad_allreduce_bytes": grad_ar,
            "fsdp_grad_reducescatter_bytes": grad_rs,
            "fsdp_sent_per_device": sent, "fsdp_sent_params_grads_per_device": sent_params,
            "fsdp_theory_sent_per_device": 3 * (n - 1) / n * fsdp_group_bytes,
            "breakdown": [f"{k} over {a} (g={g}): {c} / {b:,}" for (k, a, g), (c, b) in sorted(breakdown.items())]})
        step = stepper(trainer, state, trainer.shard_batch(parts.batch))
        rows[-1]["steps_per_sec"] = statistics.median(common.alternating_rates({spec: step}, args.rounds,
                                                                               args.steps)[spec])
        del trainer, state, step, compiled

    print(f"{args.model} (dropout 0), Sync() (partitioner's collectives), global batch {args.batch_size}, adamw; "
          f"total parameter bytes {rows[0]['param_bytes_total']:,} float32; collective n / bytes = count / result "
          f"bytes per device in the compiled HLO; steps/s = median of {args.rounds} rounds x {args.steps} steps\n")
    print("| mesh | all-gather | reduce-scatter | all-reduce | collective-permute | all-to-all | params / dev | "
          "params + opt / dev | P_f | params gathered | grads reduced | sent over fsdp: params+grads / other | "
          "theory 3(N-1)/N P_f | meas / theory: all (params+grads) | steps/s |")
    print("|---" * 15 + "|")
    for r in rows:
        kinds = " | ".join(f"{r[k + '_count']} / {r[k + '_bytes']:,}" for k in FSDP_KINDS)
        pf, theory = r["fsdp_group_param_bytes"], r["fsdp_theory_sent_per_device"]
        passes = (f"{r['fsdp_param_allgather_bytes'] / pf:.2f} x | "
                  f"{r['fsdp_grad_allreduce_bytes'] / pf:.2f} x AR + "
                  f"{r['fsdp_grad_reducescatter_bytes'] * r['fsdp'] / pf:.2f} x RS") if pf else "- | -"
        sent, sent_params = r["fsdp_sent_per_device"], r["fsdp_sent_params_grads_per_device"]
        ratio = f"{sent / theory:.2f} ({sent_params / theory:.2f})" if theory else "-"
        print(f"| `{r['mesh']}` | {kinds} | {r['param_bytes_per_device']:,} | {r['param_opt_bytes_per_device']:,} | "
              f"{pf:,} | {passes} | {sent_params:,.0f} / {sent - sent_params:,.0f} | {theory:,.0f} | {ratio} | "
              f"{r['steps_per_sec']:.2f} |")
    print("\nP_f = bytes of the fsdp-sharded parameters per fsdp group (N x their shard on one device); params "
          "gathered = fsdp all-gathers whose result has a parameter's fsdp-gathered shape, / P_f; grads reduced = "
          "parameter-shaped all-reduces (full shape) and reduce-scatters (shard shape, x N) over fsdp, / P_f; sent = "
          "ring bytes per device of every collective over the fsdp axis alone (AG (g-1)/g R, RS (g-1) R, AR "
          "2(g-1)/g R, all-to-all (g-1)/g R); other = activations. Collectives by kind and the axes they span "
          "(count / result bytes per device):")
    for r in rows:
        print(f"  {r['mesh']}: " + "; ".join(r["breakdown"]))
    for r in rows:
        print(json.dumps(r))


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from the JSON rows of either table."""
    return summarize_fsdp(rows) if "fsdp_sent_per_device" in rows[0] else summarize_allreduce(rows)


def summarize_allreduce(rows):
    first = rows[0]
    lines = [f"{first.get('model')} on `{first.get('mesh')}`, gradient {num(first.get('gradient_bytes'))} B; "
             f"bytes sent per device vs theory, steps/s vs psum:"]
    for r in rows:
        theory, sent = r["theory_bytes_sent_per_device"], r["permute_bytes_sent_max_device"]
        if sent:
            bytes_part = f"sent {num(sent)} / theory {num(theory)} = **{sent / theory:.3f}**"
        else:  # the partitioner's / psum's all-reduce: result bytes only (how XLA:CPU moves them is not in HLO)
            bytes_part = f"all-reduce of {num(r['all-reduce_bytes'])} B (theory sends {num(theory)})"
        lines.append(f"{r['variant']}: {bytes_part}; **{r['ratio_to_psum']:.2f}x** psum "
                     f"({r['steps_per_sec']:.2f} steps/s)")
    return lines


def summarize_fsdp(rows):
    lines = ["FSDP traffic measured / theory 3(N-1)/N P_f: all (params + grads only):"]
    for r in rows:
        theory = r.get("fsdp_theory_sent_per_device")
        if theory:
            lines.append(f"`{r['mesh']}`: **{r['fsdp_sent_per_device'] / theory:.2f}** "
                         f"({r['fsdp_sent_params_grads_per_device'] / theory:.2f}); {r['steps_per_sec']:.2f} steps/s")
        else:
            lines.append(f"`{r['mesh']}`: no fsdp axis; {r['steps_per_sec']:.2f} steps/s")
    return lines


if __name__ == "__main__":
    main()
