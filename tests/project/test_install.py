"""The installed package imports from any working directory (CI runs the suite after `pip install -e '.[test]'`)."""

import pytest
import os
import subprocess
import sys


@pytest.mark.slow
def test_import_from_a_folder_that_holds_a_folder_named_jaxpar(tmp_path):
    """The parent folder of a clone called `jaxpar` holds such a folder; Python must not take it for the package
    (an empty namespace package: `module 'jaxpar' has no attribute 'Trainer'`)."""
    (tmp_path / "jaxpar").mkdir()
    (tmp_path / "models").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import jaxpar, models; print(jaxpar.Trainer.__name__, "
                                                 "models.factory.__name__)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Trainer", "factory"]
