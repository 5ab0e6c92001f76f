"""How the advisor ranks its plans and says why each loses, and the text `run.py --plan` prints."""

from __future__ import annotations

import math

from jaxpar.advisor.candidates import Candidate


def score(c: Candidate) -> tuple:
    """Fits first; then plans whose steps to target are known (sync's are: the same math), by time to target
    (seconds per step x steps ratio), then the others by step time alone; ties: less memory."""
    return (not c.fits, c.steps_ratio is None, c.seconds * (c.steps_ratio or 1.0), c.memory)


def rank(plans) -> list[Candidate]:
    """`plans` best first, each with why it loses to the best."""
    ranked = sorted(plans, key=score)
    if not ranked:
        return []
    best = ranked[0]
    out = [best._replace(why="best")]
    for c in ranked[1:]:
        out.append(c._replace(why=why(c, best)))
    return out


def why(c: Candidate, best: Candidate) -> str:
    if not c.fits:
        return "does not fit a device's memory"
    reasons = []
    if c.parts["communication"] > best.parts["communication"] * 1.05:
        reasons.append(f"communication {c.parts['communication'] * 1e3:.3g} ms vs "
                       f"{best.parts['communication'] * 1e3:.3g}")
    if c.parts["compute"] > best.parts["compute"] * 1.05:
        reasons.append(f"compute {c.parts['compute'] * 1e3:.3g} ms vs {best.parts['compute'] * 1e3:.3g} (recompute or "
                       f"less parallel compute)")
    if c.steps_ratio is None:
        reasons.append("steps to target not known (a strategy that averages less often may need more steps)")
    elif math.isinf(c.steps_ratio):
        reasons.append("did not reach the target loss in the measured run")
    elif c.steps_ratio > 1:
        reasons.append(f"needs {c.steps_ratio:.2f}x the steps")
    return "; ".join(reasons) or "slightly slower"


def lines(result: dict, top: int = 5) -> list[str]:
    """The text `run.py --plan` prints."""
    plans = result["plans"]
    out = [f"jaxpar plan: {len(plans)} plans on {result['devices']} devices of {result['profile']} (a projection from "
           f"the cost model, not a measurement; memory budget {result['budget'] or 0:,} bytes per device)"]
    if not plans:
        out.append("no plan: every mesh was refused")
    for number, c in enumerate(plans[:top], 1):
        ratio = ("" if c.steps_ratio in (None, 1.0) else
                 f", x{c.steps_ratio:.2f} steps -> {c.seconds * c.steps_ratio * 1e3:.4g} ms per sync step")
        estimated = f" (estimated: {', '.join(c.parts['estimated'])})" if c.parts["estimated"] else ""
        out.append(f"{number:>3}. {c.seconds * 1e3:10.4g} ms/step{ratio}  {c.memory:>14,} bytes/device{estimated}"
                   f"{'' if c.fits else '  DOES NOT FIT'}")
        out.append(f"     python run.py {c.flags}")
    losers = plans[top:]
    if losers:
        out.append(f"and {len(losers)} more; why the next ones lose:")
        for c in losers[:top]:
            out.append(f"     {c.flags}: {c.seconds * 1e3:.4g} ms/step; {c.why}")
    for spec, reason in result["refused"].items():
        out.append(f"refused {spec}: {reason}")
    return out
