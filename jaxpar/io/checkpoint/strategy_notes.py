"""What a restore keeps and says of each strategy, in a table keyed by strategy class: the `TrainState` fields of
its own that carry over when the same strategy restores onto another replica count (`kept`), and what its
`reduce` did, for the restore's note (`note`). A subclass takes its base's entry (ASP SSP's); a strategy class
the table does not know (one of your own) keeps nothing of its own and says its state carried over unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.strategies import SSP, DiLoCo, LocalSGD


class RestoreNotes(NamedTuple):
    kept: tuple = ()  # TrainState fields of its own that a restore onto another replica count keeps
    note: str = "its parameters and optimizer state carry over unchanged"  # "{replicas}": the saved replica count


UNCHANGED = RestoreNotes()
_AVERAGED = "the {replicas} replicas' parameters, optimizer and BatchNorm states were averaged, as at a meeting"
TABLE: dict[type, RestoreNotes] = {
    LocalSGD: RestoreNotes(note=_AVERAGED),
    DiLoCo: RestoreNotes(("opt_state",), _AVERAGED),  # the outer optimizer's state does not depend on the replicas
    SSP: RestoreNotes(note="its stale parameter versions were dropped: every replica restarts from the current "
                           "parameters"),
}


def notes_of(cls: type | None) -> RestoreNotes:
    """The entry of strategy class `cls`: its own, its nearest base's, else `UNCHANGED` (also for None: a
    checkpoint of no known strategy)."""
    return next((TABLE[c] for c in (cls.__mro__ if cls is not None else ()) if c in TABLE), UNCHANGED)
