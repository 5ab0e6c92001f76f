"""Collective bytes against theory for every strategy on several meshes, from the compiled steps (no training).

    python -m benchmarks.comm                         # digits MLP (hidden 128), global batch 64
    python -m benchmarks.comm --model transformer     # the default transformer, global batch 32

For each strategy (sync with the partitioner's all-reduce and with the ring / torus2d / ps communicators, local SGD
and DiLoCo with H = 4, SSP S = 2, ASP) and mesh, every step variant is compiled by `jaxpar.explain` and its
collectives are read from the HLO. "data sent" is the bytes the busiest device sends over the data axis
(`explain`'s `busiest_sent`: a ring algorithm's share for all-reduce 2(g-1)/g R, all-gather (g-1)/g R, ...; for a
collective-permute only its sources, so the parameter server's root shows its (N-1) x B) against the theory line
`explain` prints (2(N-1)/N x B for psum / ring / torus2d, (N-1) x B at the ps root; B = one replica's gradient on
one device). Scalar collectives (metric means, the non-finite flag) are included: a few bytes over theory. "fsdp sent" / "fsdp theory" are the
same for the fsdp axis (ZeRO-3: 3 (F-1)/F x P_f). "unexpected": collectives theory does not explain.
"""

import argparse
import json
import time

import jaxpar
from benchmarks import common

MESHES = ("8", "2x4", "data=2,fsdp=2,model=2", "fsdp=8")


def strategies():
    return [("sync (partitioner)", lambda: jaxpar.Sync()), ("sync ring", lambda: jaxpar.Sync("ring")),
            ("sync torus2d", lambda: jaxpar.Sync("torus2d")), ("sync ps", lambda: jaxpar.Sync("ps")),
            ("local_sgd H=4", lambda: jaxpar.LocalSGD(period=4)), ("diloco H=4", lambda: jaxpar.DiLoCo(period=4)),
            ("ssp S=2", lambda: jaxpar.SSP(staleness=2, horizon=64)), ("asp", lambda: jaxpar.ASP(horizon=64))]


def count_over(variant, axis, kind):
    return sum(c["count"] for c in variant["communication"] if axis in c["axes"].split("+") and c["kind"] == kind)


def theory_over(variant, axis):
    return sum(t.get("bytes_sent_per_device", 0.0) for t in variant["theory"] if t["axis"] == axis)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--meshes", default=";".join(MESHES), help="mesh specs separated by ';'")
    args = parser.parse_args()
    jaxpar.make_mesh("8")  # before anything touches JAX: provides the CPU devices

    import optax

    if args.model == "mlp":
        parts = common.setup("mlp", hidden=128, dropout=0.0, batch_size=64)
    else:
        parts = common.setup("transformer", dropout=0.0, batch_size=32)
    blocks = parts.config.layers if args.model == "transformer" else None
    rows, started = [], time.perf_counter()
    for spec in args.meshes.split(";"):
        mesh = jaxpar.make_mesh(spec)
        for label, build in strategies():
            strategy = build()
            try:
                trainer = common.trainer(parts, mesh, optax.adam(1e-3), strategy=strategy)
                report = jaxpar.explain(trainer, parts.batch, blocks=blocks)
            except jaxpar.JaxparError as error:  # e.g. ps / torus2d on one replica
                print(f"{spec:24s} {label:20s} skipped: {str(error).splitlines()[0]}", flush=True)
                continue
            variants = report["variants"]
            share = {name: v["share"] or 0.0 for name, v in variants.items()}
            row = {"model": args.model, "mesh": spec, "strategy": label, "variants": {}}
            for name, v in variants.items():
                row["variants"][name] = {
                    "share": v["share"], "data_sent": v["busiest_sent"].get("data", 0.0),
                    "data_theory": theory_over(v, "data"), "fsdp_sent": v["busiest_sent"].get("fsdp", 0.0),
                    "fsdp_theory": theory_over(v, "fsdp"),
                    "data_permutes": count_over(v, "data", "collective-permute"),
                    "model_all_reduces": count_over(v, "model", "all-reduce"), "unexpected": v["unexpected"]}
            for key in ("data_sent", "data_theory"):
                row[key + "_per_step"] = sum(share[n] * row["variants"][n][key] for n in variants)
            rows.append(row)
            print(f"{spec:24s} {label:20s} done", flush=True)
    print(f"\n{args.model}: collective bytes sent per device against theory, from the compiled steps "
          f"({time.perf_counter() - started:.0f} s)\n")
    print("| mesh | strategy | variant | data sent | data theory | sent / theory | data permutes | fsdp sent | "
          "fsdp theory | model all-reduces | unexpected |")
    print("|---" * 11 + "|")
    for r in rows:
        for name, v in r["variants"].items():
            ratio = f"{v['data_sent'] / v['data_theory']:.3f}" if v["data_theory"] else "-"
            fsdp = f"{v['fsdp_sent']:,.0f} | {v['fsdp_theory']:,.0f}" if v["fsdp_theory"] else "- | -"
            share = f" ({v['share']:.2g})" if v["share"] not in (None, 1.0) else ""
            print(f"| `{r['mesh']}` | {r['strategy']} | {name}{share} | {v['data_sent']:,.0f} | "
                  f"{v['data_theory']:,.0f} | {ratio} | {v['data_permutes']} | {fsdp} | {v['model_all_reduces']} | "
                  f"{v['unexpected']} |")
    print("\ndata sent: bytes the busiest device sends over the data axis (metric scalars included); theory: "
          "2(N-1)/N x B (ps: (N-1) x B at the root); variant share of steps in brackets (local SGD: local 0.75, "
          "meet 0.25)")
    for r in rows:
        print(json.dumps(r))


def summarize(rows):
    """The suite's summary cell (`python -m benchmarks`): per mesh and strategy, the bytes the busiest device sends
    over data per step (variants weighted by their share) against theory, and any collective theory does not
    explain."""
    lines = [f"{rows[0].get('model')}: data-axis bytes sent per step by the busiest device / theory:"]
    for r in rows:
        theory = r.get("data_theory_per_step")
        ratio = f"**{r['data_sent_per_step'] / theory:.3f}**" if theory else "no exchange"
        unexpected = sum(v.get("unexpected", 0) for v in r.get("variants", {}).values())
        lines.append(f"`{r['mesh']}` {r['strategy']}: {ratio}" + (f", {unexpected} unexpected" if unexpected else ""))
    return lines


if __name__ == "__main__":
    main()
