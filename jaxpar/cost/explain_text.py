"""The text of a `jaxpar.explain` report (`jaxpar.format_explain`, what `run.py --explain` prints)."""
from __future__ import annotations

from jaxpar.cost import context_traffic, memory_fit, pipelines


def _fmt_bytes(n) -> str:
    return f"{n:,.0f}"


_OVERLAP_NOTE = {True: "the gradient all-reduce overlapping the backward pass (overlap)",
                 False: "no overlap of compute and communication"}


def format_explain(report: dict) -> str:
    """The human-readable text of an `explain` report."""
    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    lines = [f"jaxpar explain: strategy {report['strategy']} on mesh {mesh} ({report['devices']} devices); "
             f"{report['parameters']:,} parameters; nothing was trained"]
    if report.get("assumed"):
        lines.append(f"assumed: {report['assumed']}")
    if report["model_flops_per_token"]:
        lines.append(f"model FLOPs per token: {report['model_flops_per_token']:,} (6 x parameters: forward and "
                     f"backward, the usual estimate; the compiled count per token is under each variant)")
    lines += ["", "sharding plan (per device):"]
    width = max((len(p["name"]) for p in report["plan"]["parameters"]), default=4)
    for p in report["plan"]["parameters"]:
        lines.append(f"  {p['name']:<{width}}  {str(p['shape']):<16} {p['spec']:<22} {p['bytes_per_device']:>12,} of "
                     f"{p['bytes']:,} bytes")
    for part, t in report["plan"]["per_device"].items():
        if t["total"] or part == "all":
            lines.append(f"  {part + ':':<14} {t['total']:>12,} bytes per device ({t['replicated']:,} replicated, "
                         f"{t['sharded']:,} sharded)")
    memory = report["device_memory"]
    for name, v in report["variants"].items():
        share = f", {v['share']:.3g} of the steps" if v["share"] is not None else ""
        lines += ["", f"step variant {name!r}{share}:"]
        m = v["memory"]
        if m:
            lines.append(f"  memory per device: {m['total']:,} bytes of {memory:,} (arguments {m['arguments']:,}, "
                         f"outputs {m['outputs']:,}, temporaries {m['temporaries']:,}, donated {m['donated']:,})")
        if v["flops"]:
            per_token = f"; {v['flops_per_token']:,.0f} per token" if v.get("flops_per_token") else ""
            loops = (f"; {v['flops_note']}: XLA's own count is {v['xla_flops_per_device']:,.0f} per device"
                     if v.get("flops_note") else "")
            lines.append(f"  FLOPs per step: {v['flops']:,.0f} on all devices ({v['flops_per_device']:,.0f} per "
                         f"device){per_token}{loops}")
        lines.append("  collectives (compiled HLO): kind over axes (group) x count: result bytes, sent per device")
        for c in v["communication"]:
            flag = f"   <- UNEXPECTED x{c['unexpected']}: not explained by the strategy and mesh" if c["unexpected"] else ""
            seconds = f", {c['seconds'] * 1e6:,.1f} us projected" if "seconds" in c else ""
            looped = ""
            if c.get("loops"):
                inside = ", ".join(f"{n} in loops of {trips} trips" for trips, n in c["loops"].items())
                looped = f" (per step: {c['ops']} op(s) in the program, {inside})"
            lines.append(f"    {c['kind']} over {c['axes']} (g={c['group']}) x {c['count']}: {_fmt_bytes(c['bytes'])}, "
                         f"sent {_fmt_bytes(c['bytes_sent_per_device'])}{seconds}{looped}{flag}")
        if not v["communication"]:
            lines.append("    none")
        if v["busiest_sent"]:
            lines.append("  sent by the busiest device: " + ", ".join(
                f"{_fmt_bytes(b)} bytes over {axis}" for axis, b in v["busiest_sent"].items()))
        for t in v["theory"]:
            expected = (f": {t['bytes_sent_per_device']:,.0f} bytes sent per device in {t['steps']} steps"
                        if "bytes_sent_per_device" in t else "")
            over = (f" ({t['per_step_over_period']:,.0f} per step averaged over the period)"
                    if "per_step_over_period" in t else "")
            lines.append(f"  theory, {t['axis']}: {t['what']}{expected}{over}")
            if "codec" in t:
                work = t["codec"]["flops"]
                lines.append(f"  codec {t['codec']['name']} compute: {sum(work.values()):,} FLOPs per device per "
                             f"step (" + ", ".join(f"{kind} {count:,}" for kind, count in work.items()) + ")")
            if t.get("fsdp_leg", {}).get("flops"):
                lines.append(f"  codec {t['fsdp_leg']['name']} compute on the fsdp leg: {t['fsdp_leg']['flops']:,} "
                             f"FLOPs per device per step (encode, decode and the float32 sum)")
        if v.get("unknown_loops"):
            lines.append(f"  while loops of unknown trip count, their collectives counted once per step: "
                         f"{', '.join(v['unknown_loops'])}")
        if v.get("pipeline"):
            lines += pipelines.lines(v["pipeline"])
        if v.get("context"):
            lines += context_traffic.lines(v["context"])
        if "projected_seconds" in v:
            p = v["projected_seconds"]
            hidden = f" - overlap {p['overlap'] * 1e3:.4g} ms" if p.get("overlap") else ""
            lines.append(f"  PROJECTED on {report['hardware']['name']}: compute {p['compute'] * 1e3:.4g} ms + "
                         f"communication {p['communication'] * 1e3:.4g} ms{hidden} = {p['step'] * 1e3:.4g} ms per step")
    if "projection" in report:
        lines += ["", f"PROJECTED mean step time per strategy on {report['hardware']['describe']} (a projection "
                  f"from the alpha-beta cost model, not a measurement; "
                  f"{_OVERLAP_NOTE[report['hardware']['overlap']]}):"]
        for name, p in report["projection"].items():
            lines.append(f"  {name:<10} {p['seconds'] * 1e3:10.4g} ms   ({p['how']})")
        lines.append(f"  profile numbers: {report['hardware']['source']}")
    if "fit" in report:
        lines += memory_fit.lines(report["fit"])
    flagged = sum(v["unexpected"] for v in report["variants"].values())
    lines += ["", f"{flagged} collective(s) not explained by theory" + (
        " (an unexpected all-gather or all-to-all usually means a resharding: check the sharding rules)"
        if flagged else "")]
    return "\n".join(lines)
