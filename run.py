"""Command line: flags -> jaxpar.Config -> jaxpar.experiment.train(config).   python run.py --mesh 2x4 --help"""

import argparse
import logging
import sys

import jaxpar
from jaxpar.config import load_config_file
from jaxpar.experiment import train
from jaxpar.flags import add_flags, overrides


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        print(f"run.py: error: {message} (see python run.py --help)", file=sys.stderr)
        sys.exit(2)


def parser() -> Parser:
    out = Parser(prog="run.py",
                 description="Train a Flax NNX model with data, FSDP and model parallelism on a JAX device mesh.")
    out.add_argument("--config", help="Python file defining get_config() -> jaxpar.Config, e.g. configs/mlp.py; "
                                      "the flags below override its fields")
    add_flags(out)
    return out


def parse(argv) -> jaxpar.Config:
    """The config the command line asks for: the --config file's (or the default) with the flags' overrides,
    validated and with every default that applies filled in."""
    args = parser().parse_args(argv)
    config = load_config_file(args.config) if args.config else jaxpar.Config()
    return config.replace(**overrides(args)).validate().resolved()


def main(argv=None) -> int:
    notes = logging.getLogger("jaxpar")  # the trainer's start-up notes (e.g. parameters FSDP leaves whole)
    if not notes.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("jaxpar: note: %(message)s"))
        notes.addHandler(handler)
        notes.propagate = False
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
