"""How long the event simulator (`jaxpar.strategies.simulation.simulate_ps`, what SSP / ASP plan their updates
with, 10,000 by default when a trainer is built) takes for a long schedule with stragglers and jitter.

    python -m benchmarks.simulator                       # 20,000 updates on 8 replicas, 3 rounds
    python -m benchmarks.simulator --updates 100000 --rounds 1

The printed seconds are the median round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxpar.strategies.simulation import simulate_ps
from jaxpar.strategies.stragglers import parse_stragglers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--stragglers", default="3:2.0,5:1.7,jitter=0.3")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    seconds = []
    for _ in range(args.rounds):
        started = time.perf_counter()
        updates = simulate_ps(parse_stragglers(args.stragglers), args.replicas, args.staleness, args.updates)
        seconds.append(time.perf_counter() - started)
        assert len(updates) == args.updates
        print(f"{args.updates} updates: {seconds[-1]:.2f} s", flush=True)
    row = {"updates": args.updates, "replicas": args.replicas, "stragglers": args.stragglers,
           "staleness": args.staleness, "median_seconds": statistics.median(seconds)}
    print(json.dumps(row))


def summarize(rows):
    r = rows[-1]
    return [f"{r['updates']:,} simulated updates on {r['replicas']} replicas ({r['stragglers']}, S={r['staleness']}): "
            f"{r['median_seconds']:.2f} s"]


if __name__ == "__main__":
    main()
