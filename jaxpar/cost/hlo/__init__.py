"""What a compiled step really does, read from its optimised HLO text: the program and its loops (`program`), its
collectives (`collectives`) and its FLOPs with every loop counted (`flops`)."""

from jaxpar.cost.hlo.collectives import (COLLECTIVE_KINDS, Collective, bytes_sent, collective_ops, collective_stats,
                                         replica_groups, spanned_axes, unknown_loops)
from jaxpar.cost.hlo.flops import Flops, loop_flops
from jaxpar.cost.hlo.program import Program, parse_program, shape_bytes

__all__ = ["COLLECTIVE_KINDS", "Collective", "Flops", "Program", "bytes_sent", "collective_ops", "collective_stats",
           "loop_flops", "parse_program", "replica_groups", "shape_bytes", "spanned_axes", "unknown_loops"]
