"""Command line: flags -> jaxpar.Config -> jaxpar.train(config).   python run.py --mesh 2x4 --help"""

import argparse
import sys

import jaxpar
from jaxpar.config import load_config_file
from jaxpar.experiment import train

# (flag, type, help); every flag overrides the same-named Config field (dashes -> underscores).
FLAGS = [
    ("--mesh", str, "device mesh: '8' (data only), '2x4' (data x model) or 'data=2,model=4'; -1 = all remaining "
                    "devices. On a CPU-only machine the needed CPU devices are created (default 2x4)"),
    ("--model", str, "built-in model: transformer (byte-level LM), mlp or cnn (digits classifiers; default transformer)"),
    ("--steps", int, "number of optimizer updates (default 300)"),
    ("--batch-size", int, "GLOBAL batch size, split evenly over the data axis (default 32)"),
    ("--lr", float, "AdamW learning rate (default 3e-3)"),
    ("--seed", int, "seed of initialisation, data order and dropout; same seed -> same run on any mesh (default 0)"),
    ("--data", str, "text file or folder for the transformer (default: the Python standard library's .py files)"),
    ("--metrics", str, "write one JSON object per logged step (step, loss, samples_per_sec, ...) to this .jsonl file"),
    ("--log-every", int, "print and log every K steps (default 10)"),
    ("--dropout", float, "dropout rate of the model (default 0.1)"),
    ("--strategy", str, "how replicas agree: sync | local_sgd | diloco | ssp | asp (default sync)"),
    ("--allreduce", str, "gradient/parameter averaging: psum | ring | torus2d | ps (default: XLA's partitioner for "
                         "sync, psum otherwise)"),
    ("--torus", int, "torus2d: X of the X x Y grid over the data axis (default: divisor nearest sqrt)"),
    ("--sync-period", int, "local_sgd/diloco: local steps between meetings H (default 4)"),
    ("--local-after", int, "local_sgd/diloco: post-local SGD, synchronous for the first K steps (default 0)"),
    ("--outer-lr", float, "diloco: outer Nesterov SGD learning rate (default 0.7)"),
    ("--outer-momentum", float, "diloco: outer momentum (default 0.9)"),
    ("--staleness", int, "ssp: largest staleness S of an applied gradient (default 2; 0 = BSP)"),
    ("--stragglers", str, "simulated worker speeds: '3:2.0' = replica 3 is 2x slower; add ',jitter=0.1' for seeded "
                          "log-normal jitter (sets sim_time in the metrics)"),
]


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        print(f"run.py: error: {message} (see python run.py --help)", file=sys.stderr)
        sys.exit(2)


def parse(argv) -> jaxpar.Config:
    parser = Parser(description="Train a Flax NNX model with data x model parallelism on a JAX device mesh.")
    parser.add_argument("--config", help="Python file defining get_config() -> jaxpar.Config, e.g. "
                                         "configs/mlp.py; the flags below override its fields")
    for flag, kind, text in FLAGS:
        parser.add_argument(flag, type=kind, help=text, default=None)
    args = parser.parse_args(argv)
    config = load_config_file(args.config) if args.config else jaxpar.Config()
    given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    return config.replace(**given)


def main(argv=None) -> int:
    try:
        summary = train(parse(argv))
    except jaxpar.JaxparError as error:
        print(f"run.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("run.py: interrupted", file=sys.stderr)
        return 130
    print(f"done: {summary['steps']} steps in {summary['seconds']:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
