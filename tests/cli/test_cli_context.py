"""--context-parallel and the seq axis on the command line: each bad combination is one stderr line and exit 2
before anything is built; the default algorithm given without a seq axis is a note."""

import pytest

from jaxpar.cli.config import Config
from jaxpar.cli.notes import run_notes
from tests.cli.test_cli_failures import fails

TINY = ["--steps", "1", "--d-model", "32", "--d-ff", "64", "--layers", "1"]


@pytest.mark.parametrize("args, contains", [
    (["--mesh", "seq=4", "--seq-len", "30"], "--seq-len 30: the sequence does not split over seq=4; use a multiple "
                                             "of 4, e.g. --seq-len 28"),
    (["--mesh", "seq=4", "--seq-len", "36", "--context-parallel", "ring"], "x 2 chunks per device for the zig-zag "
                                                                           "ring; use a multiple of 8"),
    (["--mesh", "seq=4", "--heads", "2", "--context-parallel", "ulysses"], "--context-parallel ulysses: 2 attention "
                                                                           "heads do not divide over seq=4"),
    (["--mesh", "data=2", "--context-parallel", "ring"], "--context-parallel ring: the mesh --mesh data=2 has no seq "
                                                         "axis"),
    (["--mesh", "seq=8", "--seq-len", "4"], "only 4 positions, fewer than the 8 devices"),
    (["--mesh", "seq=4", "--model", "mlp"], "--model mlp has no sequence to split"),
    (["--mesh", "seq=4", "--context-parallel", "tree"], "--context-parallel 'tree': choose one of allgather, ring, "
                                                        "ulysses"),
])
def test_bad_seq_inputs_are_one_line(args, contains, capsys):
    fails((["--steps", "1"] if "mlp" in args else TINY) + args, capsys, contains=contains)


def test_the_default_algorithm_without_a_seq_axis_is_a_note():
    notes = run_notes(Config(mesh="2x4", context_parallel="allgather").resolved())
    assert any("--context-parallel allgather without a seq axis" in line for line in notes)
    assert not any("context-parallel" in line for line in run_notes(Config(mesh="2x4").resolved()))
