"""The shape of the house: who may import whom, no import cycles, modules of a readable size, reference pages
without measurement history.

The import graph is read from the syntax tree of every module under `jaxpar/`, `models/` and `configs/`, with
function-level imports counted (they are imports all the same) and `if TYPE_CHECKING:` blocks left out (they never
run). An edge goes to the module an import names: `from jaxpar.parallel import mesh` -> `jaxpar.parallel.mesh`,
`from jaxpar.strategies import Sync` -> `jaxpar.strategies` (its `__init__`).
"""

import ast
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

PACKAGES = ("jaxpar", "models", "configs")
CORE = ("jaxpar.train", "jaxpar.strategies", "jaxpar.parallel", "jaxpar.pipeline")
CONSUMERS = ("jaxpar.cost", "jaxpar.cli", "jaxpar.advisor", "jaxpar.calibration")
MAX_LINES, MAX_LONG, HARD_LIMIT = 300, 4, 450
MEASUREMENT_PAGES = ("measurements.md",)  # the one page that holds measured tables and their history
MAX_PAGE_LINES = 400


def module_files() -> dict[str, str]:
    """Dotted module name -> path, for every module of the project's packages."""
    found = {}
    for package in PACKAGES:
        for where, dirs, names in os.walk(os.path.join(ROOT, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(where, name)
                    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def imports_of(module: str, source: str, known) -> set[str]:
    """The project modules `module` imports, anywhere in its body."""
    tree = ast.parse(source)
    skip = _type_checking_nodes(tree)
    is_package = module in known and known[module].endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:
                    name = name.rpartition(".")[0]
                if name:
                    out.add(name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    out.add(target)
                elif base in known:
                    out.add(base)
    out.discard(module)
    return out


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    graph = {}
    for module, path in known.items():
        with open(path, encoding="utf-8") as handle:
            graph[module] = imports_of(module, handle.read(), known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# --- the readers catch what they must ---------------------------------------------------------------------------------

def test_the_import_reader_counts_function_level_imports_and_skips_type_checking():
    known = {"jaxpar": "jaxpar/__init__.py", "jaxpar.cost": "jaxpar/cost/__init__.py",
             "jaxpar.cost.hlo": "jaxpar/cost/hlo.py", "jaxpar.train": "jaxpar/train/__init__.py",
             "jaxpar.train.step": "jaxpar/train/step.py", "jaxpar.train.trainer": "jaxpar/train/trainer.py"}
    source = ("from typing import TYPE_CHECKING\nimport numpy\nfrom . import step\n"
              "if TYPE_CHECKING:\n    from jaxpar.cost import hlo\n"
              "def f():\n    import jaxpar.cost.hlo as h\n    from jaxpar import train\n")
    assert imports_of("jaxpar.train.trainer", source, known) == {"jaxpar.train.step", "jaxpar.cost.hlo",
                                                                  "jaxpar.train"}


def test_the_cycle_finder():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]


# --- the house --------------------------------------------------------------------------------------------------------

def test_the_core_never_imports_the_cost_analyser_or_the_cli():
    graph = import_graph()
    found = [f"{m} imports {t}" for m in sorted(graph) if m.startswith(CORE)
             for t in sorted(graph[m]) if t.startswith(CONSUMERS)]
    assert not found, "\n".join(found)


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.slow
def test_import_jaxpar_loads_the_library_only():
    code = ("import sys, jaxpar\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('models', 'configs') "
            "or m.startswith('jaxpar.cli')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_modules_stay_readable():
    lengths = {}
    for module, path in module_files().items():
        if module.startswith("jaxpar"):
            with open(path, encoding="utf-8") as handle:
                lengths[module] = sum(1 for _ in handle)
    long = sorted((n, m) for m, n in lengths.items() if n > MAX_LINES)
    assert len(long) <= MAX_LONG and all(n <= HARD_LIMIT for n, _ in long), \
        f"{len(long)} modules over {MAX_LINES} lines (at most {MAX_LONG}, none over {HARD_LIMIT}): {long}"


def _reference_pages():
    docs = os.path.join(ROOT, "docs")
    return sorted(os.path.join(docs, n) for n in os.listdir(docs) if n.endswith(".md") and n not in MEASUREMENT_PAGES)


@pytest.mark.parametrize("page", _reference_pages(), ids=os.path.basename)
def test_reference_pages_hold_no_history(page):
    import re

    with open(page, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    history = re.compile(r"\bsessions?\b|load average|\bissues? #?\d+|before this change", re.I)
    found = [f"{n}: {line.strip()}" for n, line in enumerate(lines, 1) if history.search(line)]
    assert len(lines) <= MAX_PAGE_LINES, f"{os.path.basename(page)}: {len(lines)} lines (at most {MAX_PAGE_LINES})"
    assert not found, f"{os.path.basename(page)} speaks of history:\n" + "\n".join(found)
