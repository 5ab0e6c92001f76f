"""Large-batch recipes on digits: test accuracy after a fixed number of epochs, global batch 32 ... 1024.

    python -m benchmarks.largebatch                                   # mlp, 6 batch sizes x 4 recipes
    python -m benchmarks.largebatch --batches 32,256,1024 --seeds 0,1 --out benchmarks/largebatch.jsonl

Every run trains the same model (MLP, hidden 128) from the same seeds (initialisation and data order; default 0, 1
and 2, the table shows their mean) for the same number of epochs (default 30) of the 1,497-example digits training
split, so a larger batch takes fewer steps: ceil(epochs x 1497 / batch), 1404 at batch 32, 44 at batch 1024.
Optimizer: SGD with momentum 0.9 (Goyal et al. 2017's setting, where the learning rate has to follow the batch),
cosine decay to ~0 over the run (after warmup, if any), no weight decay, dropout 0. Base lr `--lr` 0.2 at
`--base-batch-size` 32, tuned with recipe (a) at batch 32, 30 epochs, seeds 0 and 1 over 0.01 / 0.02 / 0.05 / 0.1 /
0.2 / 0.4 (test accuracy 0.971 / 0.973 / 0.980 / 0.985 / 0.9865 / 0.983, mean of the two seeds; 0.2 also had the
lowest test and training loss; there is no separate validation split, so this tuning saw the test split).
Mesh "8": 8-way data parallel, so every batch size must divide by 8. The four recipes:

- (a) `none`:    lr = base lr at every batch size;
- (b) `linear`:  lr = base lr x batch / 32 (the linear scaling rule);
- (c) `warmup`:  (b) + linear warmup over `--warmup-epochs` epochs' worth of steps (ceil(epochs x 1497 / batch),
                 at least 1, at most the run), from lr/W to lr as `jaxpar.train.lr_schedules.lr_schedule` does it
                 (Goyal et al. start the warmup at the unscaled lr instead);
- (d) `smooth`:  (c) + label smoothing 0.1 on the training loss (the evaluation loss is never smoothed).

One `jaxpar.Trainer` per (batch size, recipe) (each compiles its step once), reused for every seed. Reported per
run: accuracy and loss on the first 296 of the 300 test digits (296 divides by the data axis), eval-mode loss and
accuracy on the first 1,496 training digits (unsmoothed cross-entropy, so (d) is comparable), and the last step's
training objective (smoothed for (d)). In the table, "!" marks each seed whose training batch loss rose above 2x
its first-step value at some step (a loss spike; the run may or may not recover), "*" a seed whose loss became
non-finite.

Runs are sequential in one process on 8 CPU devices sharing the cores; the default (6 x 4 x 3 = 72 runs, 24
compilations) took 3 min 6 s on 2 shared CPU cores (`time python benchmarks/largebatch.py`, as it was run then);
per-run wall times include compilation on the first seed.
"""

import argparse
import json
import math
import os
import statistics
import time

import jaxpar
from benchmarks import common
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.parallel.mesh import batch_ways, parse_mesh_spec

TRAIN_SIZE = 1497  # digits training split (jaxpar.io.data.load_digits)
TEST_EVAL = 296  # first 296 of the 300 test digits: divides by a data axis of 1, 2, 4 or 8
TRAIN_EVAL = 1496  # first 1,496 training digits for the eval-mode training loss
RECIPES = {  # name -> (lr scaling, uses warmup, label smoothing)
    "none": ("none", False, 0.0),
    "linear": ("linear", False, 0.0),
    "warmup": ("linear", True, 0.0),
    "smooth": ("linear", True, 0.1),
}
SPIKE = 2.0  # a run "spiked" when a training batch loss exceeded 2x the first step's (the untrained ~ln 10)
LABELS = {"none": "(a) none", "linear": "(b) linear", "warmup": "(c) +warmup", "smooth": "(d) +smooth"}


def steps_for(epochs, batch):
    return math.ceil(epochs * TRAIN_SIZE / batch)


def parse_ints(parser, flag, text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag} {text!r}: not a comma-separated list of integers, e.g. 32,64,128")
    if not values:
        parser.error(f"{flag} {text!r}: empty list")
    return values


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=float, default=30, help="epochs of the training split per run (default 30)")
    parser.add_argument("--batches", default="32,64,128,256,512,1024", help="global batch sizes, comma-separated")
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--mesh", default="8", help="device mesh (default 8: data parallel only)")
    parser.add_argument("--lr", type=float, default=0.2,
                        help="SGD (momentum 0.9) learning rate at --base-batch-size (default 0.2, tuned at batch 32)")
    parser.add_argument("--base-batch-size", type=int, default=32, help="batch size --lr was tuned for (default 32)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--schedule", default="cosine", choices=["constant", "cosine", "step"],
                        help="lr decay after warmup, the same for every recipe (default cosine)")
    parser.add_argument("--warmup-epochs", type=float, default=5, help="warmup of recipes (c) and (d) (default 5)")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="recipe (d) (default 0.1)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="subset of: " + ", ".join(RECIPES))
    parser.add_argument("--seeds", default="0,1,2",
                        help="seeds, comma-separated; the table shows their mean (default 0,1,2)")
    parser.add_argument("--out", default=None, help="JSONL file: one object per run")
    args = parser.parse_args()

    batches = parse_ints(parser, "--batches", args.batches)
    seeds = parse_ints(parser, "--seeds", args.seeds)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for recipe in recipes:
        if recipe not in RECIPES:
            parser.error(f"--recipes: {recipe!r} is not one of {', '.join(RECIPES)}")
    if not args.epochs > 0:
        parser.error(f"--epochs {args.epochs}: must be > 0")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr}: must be > 0")
    if not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing {args.label_smoothing}: must be in [0, 1)")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out {args.out!r}: its folder does not exist")
    try:
        shape = dict(zip(mesh_lib.AXES, parse_mesh_spec(args.mesh)))
        data_axis = math.prod(shape[axis] for axis in mesh_lib.BATCH_AXES)  # the batch axes (negative: -1 given)
    except jaxpar.MeshError as error:
        parser.error(str(error))
    for batch in batches:
        if batch < 1 or batch > TRAIN_SIZE:
            parser.error(f"--batches: {batch} must be between 1 and the {TRAIN_SIZE} training examples")
        if data_axis > 0 and batch % data_axis:
            parser.error(f"--batches: {batch} does not divide by the data-axis size {data_axis} (--mesh {args.mesh})")
    mesh = jaxpar.make_mesh(args.mesh)  # before anything touches JAX: provides the CPU devices
    data_axis = batch_ways(mesh)
    if TEST_EVAL % data_axis or TRAIN_EVAL % data_axis:
        parser.error(f"--mesh {args.mesh}: data axis {data_axis} does not divide the {TEST_EVAL} test examples")

    import jax
    import optax

    import models
    from jaxpar.io import data
    from jaxpar.train import lr_schedules

    train, test = data.load_digits()
    test_batch = {k: v[:TEST_EVAL] for k, v in test.items()}
    train_batch = {k: v[:TRAIN_EVAL] for k, v in train.items()}

    print(f"largebatch: {args.model} on digits, mesh {args.mesh} ({mesh.size} {mesh.devices.flat[0].platform} "
          f"devices), {args.epochs:g} epochs, SGD momentum {args.momentum} base lr {args.lr:g} @ batch "
          f"{args.base_batch_size}, {args.schedule} decay, warmup {args.warmup_epochs:g} epochs for (c)/(d), "
          f"label smoothing {args.label_smoothing:g} for (d), seeds {seeds}", flush=True)

    out = open(args.out, "w", encoding="utf-8") if args.out else None
    total_start = time.perf_counter()
    runs = []
    try:
        for batch in batches:
            steps = steps_for(args.epochs, batch)
            for recipe in recipes:
                scaling, uses_warmup, smoothing = RECIPES[recipe]
                smoothing = args.label_smoothing if smoothing else 0.0
                warmup = min(max(math.ceil(args.warmup_epochs * TRAIN_SIZE / batch), 1), steps) if uses_warmup else 0
                parts = common.setup(args.model, mesh=args.mesh, dropout=0.0, hidden=128, batch_size=batch,
                                     label_smoothing=smoothing)
                schedule = lr_schedules.lr_schedule(args.lr, steps, scaling=scaling,
                                                 base_batch_size=args.base_batch_size, batch_at=lambda step: batch,
                                                 warmup_steps=warmup, schedule=args.schedule)
                optimizer = optax.sgd(schedule, momentum=args.momentum)
                trainer = common.trainer(parts, mesh, optimizer, eval_loss_fn=models.LOSSES[args.model])
                peak_lr = args.lr * (batch / args.base_batch_size if scaling == "linear" else 1.0)
                for seed in seeds:
                    started = time.perf_counter()
                    last = {}
                    first, worst = [], [0.0]

                    def on_step(step, metrics):
                        last.update(metrics, step=step)
                        loss = metrics["loss"]
                        if not first:
                            first.append(loss)
                        worst[0] = loss if not math.isfinite(loss) else max(worst[0], loss)

                    state = trainer.init(seed)
                    state = trainer.fit(state, common.batches(parts.config, seed), steps, on_step=on_step)
                    held = jax.device_get(trainer.evaluate(state, test_batch))
                    fitted = jax.device_get(trainer.evaluate(state, train_batch))
                    run = {"model": args.model, "mesh": args.mesh, "batch_size": batch, "recipe": recipe,
                           "seed": seed, "epochs": args.epochs, "steps": steps, "optimizer": "sgd",
                           "momentum": args.momentum, "base_lr": args.lr, "base_batch_size": args.base_batch_size,
                           "lr_scaling": scaling, "peak_lr": peak_lr, "warmup_steps": warmup,
                           "schedule": args.schedule, "label_smoothing": smoothing,
                           "test_accuracy": float(held["accuracy"]), "test_loss": float(held["loss"]),
                           "train_accuracy": float(fitted["accuracy"]), "train_loss": float(fitted["loss"]),
                           "first_batch_loss": first[0], "final_batch_loss": last.get("loss"),
                           "max_batch_loss": worst[0],
                           "spiked": not worst[0] <= SPIKE * first[0],
                           "diverged": not (math.isfinite(float(held["loss"])) and math.isfinite(worst[0])),
                           "seconds": time.perf_counter() - started}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
                    if out:
                        out.write(json.dumps(run) + "\n")
                        out.flush()
    finally:
        if out:
            out.close()
    print_tables(runs, batches, recipes, seeds, args)
    print(f"total {time.perf_counter() - total_start:.1f} s")


def mean_of(runs, batch, recipe, key):
    """(mean over seeds or None, how many seeds diverged, how many spiked)."""
    chosen = [r for r in runs if r["batch_size"] == batch and r["recipe"] == recipe]
    if not chosen:
        return None, 0, 0
    return (statistics.mean(r[key] for r in chosen), sum(r["diverged"] for r in chosen),
            sum(r["spiked"] for r in chosen))


def print_tables(runs, batches, recipes, seeds, args):
    seed_note = f"seed {seeds[0]}" if len(seeds) == 1 else f"mean of seeds {','.join(map(str, seeds))}"
    for key, title, fmt in (("test_accuracy", f"test accuracy ({TEST_EVAL} test digits)", "{:.4f}"),
                            ("train_loss", f"eval-mode training loss ({TRAIN_EVAL} training digits, unsmoothed)",
                             "{:.4f}")):
        print(f"\n{args.model}: {title}, {args.epochs:g} epochs, {seed_note}; lr(b) = peak lr of the linear recipes")
        header = f"{'batch':>6s}{'steps':>7s}{'lr(b)':>8s}" + "".join(f"{LABELS[r]:>13s}" for r in recipes)
        print(header)
        for batch in batches:
            cells = []
            for recipe in recipes:
                value, diverged, spiked = mean_of(runs, batch, recipe, key)
                if value is None:
                    text = "-"
                elif not math.isfinite(value):
                    text = "div"
                else:
                    text = fmt.format(value) + ("*" * bool(diverged)) + ("!" * spiked)
                cells.append(f"{text:>13s}")
            lr_b = args.lr * batch / args.base_batch_size
            print(f"{batch:6d}{steps_for(args.epochs, batch):7d}{lr_b:8.3g}" + "".join(cells))
    print(f"each ! = one seed whose training batch loss rose above {SPIKE:g}x its first-step value (a loss spike); "
          f"* = a seed whose loss became non-finite (div: the mean is non-finite)")


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`): test accuracy per batch size and recipe, mean of seeds."""
    seeds = sorted({r["seed"] for r in rows})
    lines = [f"test accuracy, mean of seeds {','.join(map(str, seeds))} (* = a seed diverged):"]
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for batch in dict.fromkeys(r["batch_size"] for r in rows):
        cells = []
        for recipe in recipes:
            chosen = [r for r in rows if r["batch_size"] == batch and r["recipe"] == recipe]
            if chosen:
                mean = statistics.mean(r["test_accuracy"] for r in chosen)
                cells.append(f"{recipe} {mean:.4f}" + "*" * sum(bool(r.get("diverged")) for r in chosen))
        steps = next(r.get("steps") for r in rows if r["batch_size"] == batch)
        lines.append(f"batch {batch} ({steps} steps): " + ", ".join(cells))
    return lines


if __name__ == "__main__":
    main()
