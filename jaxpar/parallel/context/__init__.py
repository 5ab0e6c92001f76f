"""Context parallelism: attention over a sequence split on the seq axis (`jaxpar.attention`), its algorithms
(all-gather, ring, Ulysses), the ring's zig-zag balance, and the trace-time settings a trainer sets for it."""

from jaxpar.parallel.context.attention import attention
from jaxpar.parallel.context.settings import (ALGORITHMS, ALLGATHER, DEFAULT, RING, ULYSSES, ContextParallel,
                                              check_heads, check_length, current, running,
                                              settings_for, traced)

__all__ = ["ALGORITHMS", "ALLGATHER", "DEFAULT", "RING", "ULYSSES", "ContextParallel", "attention", "check_heads",
           "check_length", "current", "running", "settings_for", "traced"]
