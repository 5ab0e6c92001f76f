"""The allreduce algorithms of `jaxpar.collectives` inside the real train step: collectives XLA emitted vs theory,
and step time, on the 8-device data axis (mesh "8", i.e. 8 x 1).

    python benchmarks/collectives.py                              # transformer (default config, dropout 0)
    python benchmarks/collectives.py --model mlp --steps 50       # the digits MLP (tiny gradients: latency bound)

For each variant (`Sync()`: the partitioner's all-reduce, labelled "gspmd"; `Sync("psum")`, `Sync("ring")`,
`Sync("torus2d")`, `Sync("ps")`: the explicit `shard_map` average) the step is lowered and compiled, and
`jaxpar.explain.collective_stats` counts the collectives in the optimised HLO: count and result bytes per op kind.
Shapes inside `shard_map` are per device, so a ring's permute of `f32[59712]` sends 238,848 bytes from *every*
device. "sent/dev" is the bytes the busiest device sends, read from each collective-permute's
`source_target_pairs` (a parameter server's permutes have one pair each: only the root sends B seven times,
whereas the HLO sum of permute bytes, 14 B, is the traffic of all devices together). It is compared with
`jaxpar.collectives.theoretical_traffic(algorithm, 8, gradient_bytes)`, gradient_bytes = the float32 parameter
bytes. The ring pads the fused gradient to a multiple of 8 elements, so it can send slightly more than
2(N-1)/N x gradient bytes. All-reduces are shown with their result bytes (the buffer reduced), not bytes sent:
how XLA:CPU moves them is not visible in HLO. Besides the gradient, each step reduces two f32 scalars (loss and
accuracy; in the gspmd/psum steps they ride in the gradient's all-reduce, +8 bytes).

Step time: rounds of `--steps` timed steps per variant alternate in one process (gspmd, psum, ring, torus2d, ps,
gspmd, ...) with the same two-steps-in-flight loop as `benchmarks/overhead.py`; the median steps/s and its ratio
to psum are printed.

On one CPU host the "network" is memory: a collective-permute is a memcpy between buffers of one process, and
8 devices share 2 cores. Step-time ratios therefore reflect the number of collective ops (each one a rendezvous
of 8 device threads) and their latency, not link bandwidth; the bytes columns are what would matter on a cluster.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxpar  # noqa: E402

VARIANTS = (("gspmd", None), ("psum", "psum"), ("ring", "ring"), ("torus2d", "torus2d"), ("ps", "ps"))
KINDS = ("all-reduce", "collective-permute", "all-gather", "reduce-scatter")
SHORT = {"all-reduce": "AR", "collective-permute": "CP", "all-gather": "AG", "reduce-scatter": "RS"}


def permute_bytes_sent(hlo_text: str) -> dict[int, int]:
    """Bytes each device sends through collective-permutes: every (source, target) pair sends the result shape."""
    from jaxpar.explain import shape_bytes

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
    args = parser.parse_args()
    mesh = jaxpar.make_mesh("8")  # before anything touches JAX: provides the CPU devices

    import jax
    import optax

    import models
    from jaxpar import data
    from jaxpar.collectives import theoretical_traffic
    from jaxpar.explain import collective_stats

    config = jaxpar.Config(model=args.model, dropout=0.0, batch_size=args.batch_size)
    factory, loss_fn = models.factory(config), models.LOSSES[args.model]
    if args.model == "transformer":
        batch = next(data.text_batches(data.load_text(max_bytes=1 << 20), args.batch_size, config.seq_len, 0))
    else:
        batch = next(data.array_batches(data.load_digits()[0], args.batch_size, 0))
    n = mesh.shape["data"]

    runs, results = {}, {}
    for label, algorithm in VARIANTS:
        trainer = jaxpar.Trainer(factory, loss_fn, optax.adamw(1e-3), mesh, strategy=jaxpar.Sync(algorithm))
        state = trainer.init(0)
        sharded_batch = trainer.shard_batch(batch)
        compiled = trainer._steps["sync"].lower(state, sharded_batch, {}).compile()
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
        runs[label] = [trainer, state, sharded_batch]

    def run(label, steps):
        entry = runs[label]
        trainer, state, sharded_batch = entry
        previous = None
        for _ in range(steps):
            state, metrics = trainer.step(state, sharded_batch, 0)  # step_number only feeds Sync's sim clock
            if previous is not None:
                jax.block_until_ready(previous)  # the same two-in-flight bound as Trainer.fit
            previous = metrics["loss"]
        jax.block_until_ready(previous)
        entry[1] = state

    for label, _ in VARIANTS:
        run(label, 3)  # compile and warm up
    rates = {label: [] for label, _ in VARIANTS}
    for _ in range(args.rounds):
        for label, _ in VARIANTS:
            start = time.perf_counter()
            run(label, args.steps)
            rates[label].append(args.steps / (time.perf_counter() - start))
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


if __name__ == "__main__":
    main()
