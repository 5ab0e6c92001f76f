"""FLOPs, temporaries and collective bytes per device of each explicit strategy's step on an fsdp x model mesh,
against Sync()'s, with the replica's rows split over fsdp (now) and replicated over the replica's devices (before).

    python -m benchmarks.replica_compute                        # default transformer, data=2,fsdp=2,model=2
    python -m benchmarks.replica_compute --mesh data=2,fsdp=2,model=2 --batch 32

Nothing runs: every step variant is compiled ahead of time (`Trainer.compiled_step`) on a real batch of the default
transformer (`jaxpar.cli.Config().resolved()`, adamw). Per variant: FLOPs of one step on one device (XLA's cost
analysis with every while body counted its trip count times, `jaxpar.cost.hlo.loop_flops`), the ratio to Sync()'s,
the compiled step's temporaries per device (`memory_analysis().temp_size_in_bytes`) and the bytes one device sends
in collectives (`jaxpar.cost.hlo.bytes_sent`, ring algorithms). "before" rebuilds each explicit strategy with the
replica's rows replicated over its devices (the formulation used before this benchmark existed, still the one for
models with BatchNorm statistics): `jaxpar.strategies.replicas._rows_split_by_hand` patched to False.
"""

import argparse
import json
import time
from unittest import mock

import jaxpar
from benchmarks import common


def strategies():
    import optax

    return {"Sync()": jaxpar.Sync(), "Sync('psum')": jaxpar.Sync("psum"), "Sync('ring')": jaxpar.Sync("ring"),
            "LocalSGD(period=4)": jaxpar.LocalSGD(period=4),
            "DiLoCo(period=4)": jaxpar.DiLoCo(period=4, outer_optimizer=optax.sgd(0.7, momentum=0.9, nesterov=True)),
            "SSP(staleness=1)": jaxpar.SSP(staleness=1)}


def measure(parts, spec, name, strategy, formulation):
    import jax
    from jaxpar.cost.hlo import bytes_sent, collective_ops, loop_flops
    from jaxpar.runtime.resources import step_flops

    trainer = common.trainer(parts, jaxpar.make_mesh(spec), strategy=strategy)
    rows = []
    for variant in sorted(trainer._steps):
        inputs = strategy.plan(trainer.ctx, 0).inputs if variant == "update" else None
        compiled = trainer.compiled_step(variant, parts.batch, inputs)
        flops = loop_flops(compiled, step_flops(compiled)).per_device
        rows.append({"strategy": name, "variant": variant, "formulation": formulation, "mesh": spec,
                     "batch": parts.config.batch_size, "flops_per_device": flops,
                     "temp_bytes_per_device": compiled.memory_analysis().temp_size_in_bytes,
                     "collective_bytes_sent_per_device": sum(bytes_sent(op) for op in collective_ops(compiled,
                                                                                                     trainer.mesh))})
    del trainer
    jax.clear_caches()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="data=2,fsdp=2,model=2")
    parser.add_argument("--batch", type=int, default=None, help="global batch size (default: the config's)")
    args = parser.parse_args()
    jaxpar.make_mesh("8")  # before anything touches JAX: provides the 8 CPU devices
    from jaxpar.strategies import replicas

    start = time.perf_counter()
    parts = common.setup("transformer", batch_size=args.batch)
    rows = []
    for name, strategy in strategies().items():
        rows += measure(parts, args.mesh, name, strategy, "now")
        if name != "Sync()":
            with mock.patch.object(replicas, "_rows_split_by_hand", lambda *args: False):
                rows += measure(parts, args.mesh, name, strategy, "before")
        print(f"{name}: compiled ({time.perf_counter() - start:.0f} s)", flush=True)
    sync = next(r["flops_per_device"] for r in rows if r["strategy"] == "Sync()")
    for r in rows:
        r["flops_vs_sync"] = r["flops_per_device"] / sync
    print(f"\ntransformer (batch {parts.config.batch_size}) on {args.mesh}: per device, per step")
    print("| strategy | variant | formulation | FLOPs / device | / Sync() | temporaries / device | "
          "collective bytes sent / device |")
    print("|---" * 7 + "|")
    for r in rows:
        print(f"| {r['strategy']} | {r['variant']} | {r['formulation']} | {r['flops_per_device']:,.0f} | "
              f"{r['flops_vs_sync']:.4f} | {r['temp_bytes_per_device']:,} | "
              f"{r['collective_bytes_sent_per_device']:,.0f} |")
    for r in rows:
        print(json.dumps(r))
    print(f"total {time.perf_counter() - start:.1f} s")


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`) from this script's JSON rows."""
    cells = [f"{r['strategy']} {r['variant']} {r['formulation']} **{r['flops_vs_sync']:.3f}**" for r in rows
             if r["strategy"] != "Sync()"]
    return ["FLOPs per device / Sync()'s: " + ", ".join(cells)]


if __name__ == "__main__":
    main()
