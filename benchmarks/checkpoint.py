"""What checkpointing costs: the default transformer trained with a checkpoint every N steps against none.

    python -m benchmarks.checkpoint --mesh 2x4 --every 10 --steps 40 --rounds 5

Rounds alternate (with checkpoints, without, with, ...) in one process on one trainer, so machine noise hits both
alike. Each round is `fit` for --steps steps, timed to its end (a round with checkpoints also waits until its last
save is durable). Prints the median samples/s of each and their ratio (the goal is >= 0.9), as one JSON line too.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import jaxpar
from benchmarks import common


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--steps", type=int, default=40, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    mesh = jaxpar.make_mesh(args.mesh)  # before anything touches JAX: provides the CPU devices

    import jax
    import optax

    from jaxpar.train import actions
    from jaxpar.io import data
    from jaxpar.io.checkpoint import Checkpointer

    parts = common.setup()  # the default run: transformer, batch 32, seq 128
    config = parts.config
    trainer = common.trainer(parts, mesh, optax.adamw(config.lr))
    batches = data.prefetch_to_device(common.batches(config), trainer.shard_batch)
    state = trainer.fit(trainer.init(0), batches, 3)  # compile
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as folder:
        checkpoints = Checkpointer(folder, keep=2)
        rates = {"with": [], "without": []}
        for round_index in range(2 * args.rounds):
            kind = "with" if round_index % 2 == 0 else "without"
            loop = [actions.Checkpoint(checkpoints, args.every, at_end=False)] if kind == "with" else []
            start = time.perf_counter()
            state = trainer.fit(state, batches, args.steps, actions=loop)
            jax.block_until_ready(state)
            checkpoints.wait()
            rates[kind].append(args.steps * config.batch_size / (time.perf_counter() - start))
        checkpoints.close()
        size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)
    result = {"mesh": args.mesh, "every": args.every, "steps_per_round": args.steps, "rounds": args.rounds,
              "samples_per_sec_with": statistics.median(rates["with"]),
              "samples_per_sec_without": statistics.median(rates["without"]),
              "checkpoint_bytes_on_disk": size}
    result["ratio"] = result["samples_per_sec_with"] / result["samples_per_sec_without"]
    print(f"checkpoint every {args.every} steps: {result['samples_per_sec_with']:.1f} samples/s, none: "
          f"{result['samples_per_sec_without']:.1f} samples/s, ratio {result['ratio']:.3f} "
          f"(median of {args.rounds} alternating rounds of {args.steps} steps; {size:,} bytes on disk for 2 kept)")
    print(json.dumps(result))


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    r = rows[-1]
    return [f"with / without checkpoints **{r['ratio']:.3f}** ({r['samples_per_sec_with']:.1f} vs "
            f"{r['samples_per_sec_without']:.1f} samples/s, every {r['every']} steps on `{r['mesh']}`)"]


if __name__ == "__main__":
    main()
