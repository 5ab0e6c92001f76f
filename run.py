"""Command line: flags -> jaxpar.cli.Config -> jaxpar.cli.training.train(config).   python run.py --mesh 2x4 --help"""

import argparse
import logging
import os
import signal
import sys
import threading

import jaxpar
from jaxpar.cli import Config
from jaxpar.cli.files import load_config_file
from jaxpar.errors import Preempted, Terminated, cli_message
from jaxpar.runtime.resources import DeviceError
from jaxpar.cli.flags import add_flags, overrides
from jaxpar.cli.paths import same_file
from jaxpar.cli.training import train


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, no usage dump
        print(f"run.py: error: {message} (see python run.py --help)", file=sys.stderr)
        sys.exit(2)


def parser() -> Parser:
    out = Parser(prog="run.py",
                 description="Train a Flax NNX model with data, FSDP and model parallelism on a JAX device mesh.")
    out.add_argument("--config", help="Python file defining get_config() -> jaxpar.cli.Config, e.g. configs/mlp.py; "
                                      "the flags below override its fields")
    add_flags(out)
    return out


def parse(argv) -> Config:
    """The config the command line asks for: the --config file's (or the default) with the flags' overrides,
    validated and with every default that applies filled in."""
    args = parser().parse_args(argv)
    config = load_config_file(args.config) if args.config else Config()
    config = config.replace(**overrides(args))
    if args.config and isinstance(config.metrics, str) and config.metrics and same_file(config.metrics, args.config):
        raise jaxpar.ConfigError(f"--metrics {config.metrics!r}: is the --config file (it would be overwritten); "
                                 f"pass another path, e.g. run.jsonl")
    return config.validate().resolved()


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM kills at once
    raise Terminated()


class _Stdout(logging.StreamHandler):  # writes to whatever sys.stdout is at the time (tests swap it)
    stream = property(lambda self: sys.stdout, lambda self, value: None)


_device_failed = threading.Event()  # a step failed on the device: other devices may stay blocked in a collective


def cli(argv=None) -> None:
    """`main` as a process: exits with its code; after a device failure without waiting for blocked devices."""
    code = main(argv)
    if _device_failed.is_set():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the message and the metrics file are written; XLA's blocked threads would never end
    sys.exit(code)


def main(argv=None) -> int:
    notes = logging.getLogger("jaxpar")  # the trainer's start-up notes (e.g. parameters FSDP leaves whole)
    if not notes.handlers:
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("jaxpar: note: %(message)s"))
        notes.addHandler(handler)
        notes.propagate = False
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        summary = train(parse(argv))
    except jaxpar.JaxparError as error:
        print(f"run.py: error: {cli_message(error)}", file=sys.stderr)
        if isinstance(error, DeviceError):
            _device_failed.set()
        return 2
    except Preempted as stop:  # SIGTERM / Ctrl-C with --checkpoint-dir: the checkpoint is durable
        print(f"run.py: stopped at step {stop.step}; its checkpoint is saved: continue with --resume", file=sys.stderr)
        return 0
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM as Terminated: the JSONL is saved either way
        terminated = isinstance(stop, Terminated)
        print(f"run.py: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    if jaxpar.runtime.distributed.is_main() and not {"explain", "plan"} & set(summary):
        print(f"done: {summary['steps']} steps in {summary['seconds']:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    cli()
