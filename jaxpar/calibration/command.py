"""`python -m jaxpar.calibrate` (also `python -m jaxpar.calibration`): measure this machine for the cost model and
write a hardware profile (JSON) that `run.py --hardware FILE` reads. The command line: its flags, one-line errors
(exit 2, nothing written), progress on stderr, and the file written whole or not at all. Without `--mesh`, on a
machine with only CPUs, it makes as many CPU devices as run.py's default `--mesh` uses, every one on data."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import models
from jaxpar.calibration.codecs import CODECS
from jaxpar.calibration.links import SIZES
from jaxpar.calibration.machine import MATMUL_SIZES, calibrate, summary
from jaxpar.calibration.model import calibrate_model
from jaxpar.checks import unwritable_file
from jaxpar.cli.config import Config
from jaxpar.cost.profile_json import is_profile_file
from jaxpar.errors import JaxparError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.runtime.cpu_devices import ensure_cpu_devices
from jaxpar.runtime import distributed

PROG = "python -m jaxpar.calibrate"


def _int_list(flag: str, low: int):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or any(v < low for v in values) or len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give distinct comma-separated integers >= {low}")
        return values

    return parse


def cpu_devices() -> int:
    """The CPU devices made when no --mesh is given: as many as run.py's default --mesh uses."""
    return math.prod(mesh_lib.parse_mesh_spec(Config.mesh))


def main(argv=None) -> int:
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, exit code 2, no usage dump
            print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
            sys.exit(2)

    parser = Parser(prog=PROG, description="Measure this machine's devices and write a hardware profile (JSON) "
                                           "that run.py --hardware FILE reads.")
    parser.add_argument("--out", default=None, help="write the profile here (JSON); default: print it")
    parser.add_argument("--mesh", default=None,
                        help="the mesh whose axes are measured (as run.py --mesh); default: every device on data (on "
                             f"a machine with only CPUs, {cpu_devices()} CPU devices, as run.py's default --mesh)")
    parser.add_argument("--sizes", type=_int_list("--sizes", 64), default=SIZES,
                        help="message sizes in bytes per device, comma-separated (at least 2)")
    parser.add_argument("--matmul-sizes", type=_int_list("--matmul-sizes", 8), default=MATMUL_SIZES,
                        help="n of the n x n matmuls timed, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per program (the fastest is kept); with "
                        "--model, also the rounds of its reference steps (the fastest is kept)")
    parser.add_argument("--trips", type=int, default=8, help="loop trips timed per call (one trip is one op)")
    parser.add_argument("--codecs", default=None,
                        help="the compression codecs whose encode + decode is timed, comma-separated, or 'none' "
                             "(default: bf16,fp16,int8,powersgd:4, the ones the plan advisor prices)")
    parser.add_argument("--model", default=None,
                        help="also time this built-in model's training step (sync, every device on data, on synthetic "
                             "batches of --batch-size and 2, 4, 8 and 16x it, a least-squares line): the profile then "
                             "prices that model's compute at its measured utilisation and adds its fixed cost per step "
                             "(jaxpar/calibration/model_step.py)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the global batch of --model's reference run (default: the model's default)")
    args = parser.parse_args(argv)

    def error(message: str) -> int:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2

    problem = argument_problem(args)
    if problem:
        return error(problem)
    codecs = CODECS if args.codecs is None else () if args.codecs == "none" else tuple(args.codecs.split(","))
    try:
        distributed.initialize()
        if args.mesh is None:  # every device on data: on CPU, as many as run.py's default mesh (before JAX starts)
            ensure_cpu_devices(cpu_devices())
        mesh = mesh_lib.make_mesh(args.mesh if args.mesh is not None else "-1")
        say = (lambda line: print(line, file=sys.stderr, flush=True)) if distributed.is_main() else None
        profile = calibrate(mesh, sizes=args.sizes, matmul_sizes=args.matmul_sizes, trips=args.trips,
                            repeats=args.repeats, progress=say, codecs=codecs)
        if args.model is not None:
            profile = calibrate_model(profile, args.model, args.batch_size, progress=say, rounds=args.repeats)
    except JaxparError as problem:
        return error(str(problem))
    if not distributed.is_main():
        return 0
    text = json.dumps(profile, indent=1) + "\n"
    print("\n".join(summary(profile)), file=sys.stderr)
    if args.out:
        partial = args.out + ".partial"
        with open(partial, "w") as handle:
            handle.write(text)
        os.replace(partial, args.out)  # nothing half-written under the final name
        print(f"wrote {args.out}: use it with run.py --hardware {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def argument_problem(args) -> str | None:
    """The first thing wrong with the parsed arguments (one line naming the flag), or None."""
    if args.model is not None:
        if args.model not in models.MODELS:
            return f"--model {args.model!r}: not a built-in model; choose one of {', '.join(models.MODELS)}"
    elif args.batch_size is not None:
        return f"--batch-size {args.batch_size}: applies only with --model (the reference run's batch)"
    if args.batch_size is not None and args.batch_size < 1:
        return f"--batch-size {args.batch_size}: give an integer >= 1"
    codecs = CODECS if args.codecs is None else () if args.codecs == "none" else tuple(args.codecs.split(","))
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        return (f"--codecs {args.codecs}: {unknown[0]!r} is not a codec calibration times; give a comma-separated "
                f"subset of {','.join(CODECS)}, or none")
    if len(args.sizes) < 2:
        return f"--sizes {','.join(map(str, args.sizes))}: a line needs at least 2 message sizes"
    for flag, value in (("--repeats", args.repeats), ("--trips", args.trips)):
        if value < 1:
            return f"{flag} {value}: give an integer >= 1"
    return args.out and out_problem(args.out) or None


def out_problem(path: str) -> str | None:
    """Why `--out path` cannot take the profile (one line), or None: a file that exists must be a profile already
    (or empty), so nothing but an old profile is ever replaced."""
    problem = unwritable_file(path, "--out", "pass another path for the profile (JSON)")
    if problem:
        return problem
    if os.path.isfile(path) and not is_profile_file(path):
        return (f"--out {path!r}: exists and is not a hardware profile (JSON, as this command writes); pass a new "
                f"file name, or delete the file first")
    return None
