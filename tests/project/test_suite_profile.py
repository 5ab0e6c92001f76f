"""benchmarks/suite_profile.py, the suite's time profiler: a pytest run under it records each test's CPU time and
JAX's compilation of it, and the summary names the file; with no profile the summary is one line and exit 2."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import suite_profile
from tests.helpers import ROOT, child_env

TEST = '''
import jax, jax.numpy as jnp

def test_compiles_one_program():
    assert int(jax.jit(lambda x: x * 3 + 1)(jnp.int32(2))) == 7

def test_compiles_nothing():
    assert 1 + 1 == 2
'''


@pytest.mark.slow
def test_a_profiled_run_counts_each_tests_compilation(tmp_path):
    (tmp_path / "test_small.py").write_text(TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "1.json").write_text(json.dumps({"old.py::test_of_the_run_before": {"cpu_s": 1.0}}))  # replaced
    # no compilation cache: the program is compiled, not read back
    env = child_env(JAXPAR_SUITE_PROFILE=str(folder), PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR="")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "benchmarks.suite_profile", "-p",
                           "no:cacheprovider", "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_small.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (written,) = os.listdir(folder)
    rows = json.loads((folder / written).read_text())
    one, none = rows["test_small.py::test_compiles_one_program"], rows["test_small.py::test_compiles_nothing"]
    assert one["compile_s"] > 0 and one["trace_s"] > 0 and one["cpu_s"] > 0
    assert "compile_s" not in none
    lines = suite_profile.table(suite_profile.load(str(folder)))
    assert lines[0] == "2 tests in 1 files" and lines[4].startswith("| test_small.py | ")


def test_without_a_profile_the_summary_is_one_line(tmp_path, capsys):
    assert suite_profile.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"suite_profile: no profile in {str(tmp_path)!r}; run `pytest -p "
                                       f"benchmarks.suite_profile` first\n")
