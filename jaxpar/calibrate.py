"""`python -m jaxpar.calibrate`: measure this machine for the cost model and write a hardware profile (JSON) that
`run.py --hardware FILE` reads. The measuring and fitting are `jaxpar.cost.calibration`; this is the command line:
its flags, one-line errors (exit 2), progress on stderr, and the file written whole or not at all."""

from __future__ import annotations

from jaxpar.cost.calibration import MATMUL_SIZES, SIZES, calibrate, summary

PROG = "python -m jaxpar.calibrate"


def _int_list(flag: str, low: int):
    def parse(text: str) -> tuple[int, ...]:
        import argparse

        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or any(v < low for v in values) or len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give distinct comma-separated integers >= {low}")
        return values

    return parse


def calibrate_model(profile: dict, model: str, batch_size: int | None = None, timer=None, progress=None,
                    rounds: int | None = None) -> dict:
    """`profile` (a calibration dict) with the built-in `model`'s step measured on every device over data
    (`jaxpar.cost.model_step`); `batch_size`: the reference's global batch (default: the model's)."""
    import jax

    import models
    from jaxpar.cli.build import datasets, make_optimizer
    from jaxpar.cli.config import Config
    from jaxpar.cost import model_step
    from jaxpar.cost.hardware import Profile
    from jaxpar.parallel.mesh import make_mesh
    from jaxpar.train.trainer import Trainer

    fields = {"batch_size": batch_size} if batch_size else {}
    config = Config(model=model, dropout=0.0, **fields).resolved()
    mesh_spec = str(len(jax.devices()))
    mesh = make_mesh(mesh_spec)

    def batch_of(size: int) -> dict:
        sized = config.replace(batch_size=size)
        return next(iter(datasets(sized, lambda step: size, size)[0]))

    def make_trainer(priced):
        return Trainer(models.factory(config), models.loss_for(config), make_optimizer(config, config.lr), mesh,
                       hardware=priced)

    machine = Profile.from_dict(profile)
    result = model_step.measure(make_trainer, batch_of, config.batch_size, machine, timer=timer, progress=progress,
                                rounds=rounds or model_step.ROUNDS)
    return model_step.apply(profile, model, mesh_spec, result)


def main(argv=None) -> int:
    import argparse
    import json
    import os
    import sys

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, exit code 2, no usage dump
            print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
            sys.exit(2)

    parser = Parser(prog=PROG, description="Measure this machine's devices and write a hardware profile (JSON) "
                                           "that run.py --hardware FILE reads.")
    parser.add_argument("--out", default=None, help="write the profile here (JSON); default: print it")
    parser.add_argument("--mesh", default=None,
                        help="the mesh whose axes are measured (as run.py --mesh); default: every device on data")
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
                        help="also time this built-in model's training step (sync, every device on data, at "
                             "--batch-size and 2, 4, 8 and 16x it, a least-squares fit): the profile then prices that model's compute at its measured "
                             "utilisation and adds its fixed cost per step (jaxpar/cost/model_step.py)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="the global batch of --model's reference run (default: the model's default)")
    args = parser.parse_args(argv)

    from jaxpar.checks import unwritable_file
    from jaxpar.errors import JaxparError

    def error(message: str) -> int:
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2

    if args.model is not None:
        import models

        if args.model not in models.MODELS:
            return error(f"--model {args.model!r}: not a built-in model; choose one of {', '.join(models.MODELS)}")
    elif args.batch_size is not None:
        return error(f"--batch-size {args.batch_size}: applies only with --model (the reference run's batch)")
    if args.batch_size is not None and args.batch_size < 1:
        return error(f"--batch-size {args.batch_size}: give an integer >= 1")
    from jaxpar.cost.codec_calibration import CODECS

    codecs = CODECS if args.codecs is None else () if args.codecs == "none" else tuple(args.codecs.split(","))
    unknown = [c for c in codecs if c not in CODECS]
    if unknown:
        return error(f"--codecs {args.codecs}: {unknown[0]!r} is not a codec calibration times; give a comma-separated "
                     f"subset of {','.join(CODECS)}, or none")
    if len(args.sizes) < 2:
        return error(f"--sizes {','.join(map(str, args.sizes))}: a line needs at least 2 message sizes")
    for flag, value in (("--repeats", args.repeats), ("--trips", args.trips)):
        if value < 1:
            return error(f"{flag} {value}: give an integer >= 1")
    if args.out:
        problem = unwritable_file(args.out, "--out", "pass another path for the profile (JSON)")
        if problem:
            return error(problem)
    try:
        from jaxpar.runtime import distributed

        distributed.initialize()
        from jaxpar.parallel.mesh import make_mesh

        import jax

        mesh = make_mesh(args.mesh if args.mesh is not None else str(len(jax.devices())))
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


if __name__ == "__main__":
    raise SystemExit(main())
