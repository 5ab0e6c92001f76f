"""Command line: flags -> jaxpar.Config -> jaxpar.experiment.train(config).   python run.py --mesh 2x4 --help"""

import argparse
import sys

import jaxpar
from jaxpar.config import load_config_file
from jaxpar.experiment import train
from jaxpar.flags import FLAGS



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
