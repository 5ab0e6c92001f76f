"""JAX's persistent compilation cache, on by default (jaxpar.runtime.compile_cache): run.py fills its folder, a second
run reads it, --no-compile-cache leaves it alone, a user's JAX_COMPILATION_CACHE_DIR wins, and a folder that cannot be
created costs one note, not the run."""

import os
import subprocess
import sys

import pytest

import jaxpar
from jaxpar.runtime import compile_cache
from tests.helpers import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = ["--model", "mlp", "--steps", "3", "--log-every", "1"]


def run_py(*args, **env):
    """run.py in a process whose cache settings are `env`'s alone (not the test session's shared folder)."""
    environ = child_env()
    environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    environ.update(env)
    return subprocess.run([sys.executable, "run.py", *RUN, *args], cwd=ROOT, env=environ, capture_output=True,
                          text=True, timeout=300)


def entries(folder) -> set[str]:
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_folder() == str(tmp_path / "xdg" / "jaxpar" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache.default_folder() == str(tmp_path / "home" / ".cache" / "jaxpar" / "xla")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "mine"))
    assert compile_cache.default_folder() == str(tmp_path / "mine")


@pytest.mark.parametrize("folder", [123, 1.5, ["/tmp/x"]])
def test_a_folder_that_is_not_a_path_is_one_error_line(folder):
    decided = list(compile_cache._decided)
    with pytest.raises(jaxpar.ConfigError, match=r"^use_compile_cache\(.*\): not a folder; pass a path \(a str or "
                                                 r"os.PathLike\), None to turn the cache off") as info:
        jaxpar.use_compile_cache(folder)
    assert "\n" not in str(info.value) and compile_cache._decided == decided  # nothing changed


@pytest.mark.slow
def test_a_run_fills_the_cache_and_a_second_run_reads_it(tmp_path):
    folder = str(tmp_path / "cache")
    first = run_py(JAXPAR_COMPILE_CACHE=folder)
    assert first.returncode == 0, first.stderr
    written = entries(folder)
    assert written, "the first run wrote no compiled program"
    second = run_py(JAXPAR_COMPILE_CACHE=folder)
    assert second.returncode == 0, second.stderr
    assert entries(folder) == written, "the second run compiled a program the first had cached"


@pytest.mark.slow
def test_no_compile_cache_writes_nothing(tmp_path):
    folder = str(tmp_path / "cache")
    done = run_py("--no-compile-cache", JAXPAR_COMPILE_CACHE=folder)
    assert done.returncode == 0, done.stderr
    assert not entries(folder)


@pytest.mark.slow
def test_the_users_jax_folder_wins_and_a_bad_folder_costs_a_note(tmp_path):
    mine, users = str(tmp_path / "mine"), str(tmp_path / "users")
    done = run_py(JAXPAR_COMPILE_CACHE=mine, JAX_COMPILATION_CACHE_DIR=users)
    assert done.returncode == 0, done.stderr
    assert entries(users) and not entries(mine)

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = run_py(JAXPAR_COMPILE_CACHE=str(blocker / "xla"))
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stdout.splitlines() if "compilation cache" in line]
    assert len(notes) == 1 and notes[0].startswith("jaxpar: note: compilation cache"), done.stdout
    assert "--no-compile-cache" in notes[0]
