"""`run.py --plan --hardware PROFILE [--devices N]`: the plan advisor (`jaxpar.advisor`) on the configured model,
optimizer and global batch, for N devices (default: as many as --mesh uses); prints the ranked plans with the flags
that run them; nothing trains and nothing is written."""

from __future__ import annotations

import math

import jax

import models
from jaxpar.advisor import MAX_DEVICES, advise, lines
from jaxpar.cli.build import datasets, make_optimizer
from jaxpar.cli.config import Config
from jaxpar.cost.hardware import parse_hardware
from jaxpar.errors import OptionError
from jaxpar.parallel import mesh as mesh_lib
from jaxpar.strategies import DiLoCo, LocalSGD, Sync

# Steps to the target loss measured by `python -m benchmarks --only strategies` (benchmarks/RESULTS-strategies.md,
# fast-link scenario, mesh 4x2: 4 replicas, seed 0): the first step whose 10-step mean training loss reached the
# lowest such mean sync SGD had within its first 160 steps. inf: not reached in the run. Only for the built-in
# models, at their default learning rates; another model, lr or replica count needs its own measurement.
MEASURED_STEPS = {
    "mlp": {Sync.name: 138, f"{LocalSGD.name} H=4": 219, f"{LocalSGD.name} H=16": 236, f"{DiLoCo.name} H=4": 306},
    "transformer": {Sync.name: 160, f"{LocalSGD.name} H=4": 200, f"{LocalSGD.name} H=16": 256,
                    f"{DiLoCo.name} H=4": math.inf},
}


# Steps to target of sync with an explicit allreduce and a codec, summed over seeds 0, 1, 2 (`python -m
# benchmarks.compression_convergence --part time`, mesh 8, 300 steps; docs/compression.md): the uncompressed run of
# each seed sets its target. A codec changes the math, so the advisor ranks its plans by step time x this ratio.
MEASURED_CODEC_STEPS = {
    "mlp": {"none": 417, "bf16": 416, "int8": 419, "powersgd:4": 561},
    "transformer": {"none": 421, "bf16": 437, "int8": 458, "powersgd:4": 502},
}


def steps_ratios(model: str) -> dict:
    steps = MEASURED_STEPS.get(model, {})
    if Sync.name not in steps:
        return {}
    ratios = {label: count / steps[Sync.name] for label, count in steps.items() if label != Sync.name}
    coded = MEASURED_CODEC_STEPS.get(model, {})
    ratios.update({f"{Sync.name} compress={codec}": count / coded["none"] for codec, count in coded.items()
                   if codec != "none"})
    return ratios


def _mesh_devices(spec: str) -> int | None:
    """The device count `--mesh` asks for (None when a -1 takes every device)."""
    sizes = mesh_lib.parse_mesh_spec(spec)
    return None if -1 in sizes else math.prod(sizes)


def plan_run(config: Config) -> dict:
    """Prints the ranked plans and returns {"plan": result}."""
    devices = config.devices or _mesh_devices(config.mesh)
    if devices is not None:
        if devices > MAX_DEVICES:  # before JAX starts that many CPU devices
            flag, value = ("devices", config.devices) if config.devices else ("mesh", config.mesh)
            raise OptionError(flag, value, f"the advisor would start {devices:,} devices and compile every mesh of "
                              f"them on this machine; plan for at most {MAX_DEVICES:,} devices")
        mesh_lib.make_mesh(str(devices))  # on CPU, JAX starts with that many devices
    devices = devices or len(jax.devices())
    profile = parse_hardware(config.hardware)
    if profile is not None and profile.model not in (None, config.model):
        print(f"plan: note: --hardware {config.hardware} prices compute and the fixed cost per step as measured on "
              f"{profile.model}'s training step, not {config.model}'s; for {config.model}, calibrate with python -m "
              f"jaxpar.calibrate --model {config.model}", flush=True)
    train, _ = datasets(config, lambda step: config.batch_size, config.batch_size)
    first = next(iter(train))
    batch = {k: jax.ShapeDtypeStruct((config.batch_size,) + v.shape[1:], v.dtype) for k, v in first.items()}
    result = advise(models.factory(config), models.loss_for(config), make_optimizer(config, config.lr), batch,
                    config.hardware, devices, rules=config.rules, steps_ratio=steps_ratios(config.model),
                    progress=lambda line: print(f"plan: {line}", flush=True))
    print("\n".join(lines(result)), flush=True)
    return {"plan": result}
