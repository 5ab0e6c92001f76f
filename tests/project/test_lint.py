"""Lints of the library's shape: one owner per decision (issue 18).

- no module outside `jaxpar/strategies/` names a strategy or a step variant as a string literal: it asks the strategy;
- no module outside the partitioning package (`jaxpar/parallel/partitioning/`) builds a `PartitionSpec` or a
  `NamedSharding`;
- no file points at a design file the user does not have.

Each failure lists every offending file:line. The lints read the syntax tree (comments and f-string pieces are not
string literals); each lint's matcher is also run on a few lines of source that must and must not be caught.
"""

import ast
import os

import pytest

import jaxpar.strategies
from jaxpar.cost.strategy_costs import variant_shares

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("sync", "local", "meet", "update")  # the step variants the strategies define
STRATEGY_WORDS = frozenset(jaxpar.strategies.REGISTRY) | frozenset(VARIANTS)
SHARDING_CLASSES = ("PartitionSpec", "NamedSharding")
PARTITIONING = "jaxpar/parallel/partitioning/"  # the one package that builds them


def python_files(folder: str, skip=()):
    """(path relative to ROOT, source) of every .py file under ROOT/folder, except under the `skip` paths."""
    for where, dirs, names in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.relpath(os.path.join(where, name), ROOT)
            if name.endswith(".py") and not any(path == s or path.startswith(s.rstrip("/") + "/") for s in skip):
                with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
                    yield path, handle.read()


def string_literals(source: str, words) -> list[int]:
    """Lines holding a string literal that is exactly one of `words` (not a piece of an f-string)."""
    tree = ast.parse(source)
    pieces = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    return sorted(node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
                  and isinstance(node.value, str) and node.value in words and id(node) not in pieces)


def sharding_calls(source: str) -> list[int]:
    """Lines calling PartitionSpec / NamedSharding, by name, attribute (`jax.sharding.PartitionSpec(...)`) or an
    alias it was imported as (`from jax.sharding import PartitionSpec as P`)."""
    tree = ast.parse(source)
    names = set(SHARDING_CLASSES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {alias.asname for alias in node.names if alias.name in SHARDING_CLASSES and alias.asname}
        elif isinstance(node, ast.Assign) and isinstance(node.value, (ast.Name, ast.Attribute)):
            value = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if value in SHARDING_CLASSES:  # P = jax.sharding.PartitionSpec
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called in names:
                lines.append(node.lineno)
    return sorted(lines)


def offenders(files, find) -> list[str]:
    out = []
    for path, source in files:
        lines = source.splitlines()
        out += [f"{path}:{n}: {lines[n - 1].strip()}" for n in find(source)]
    return out


def report(what: str, found: list[str]) -> str:
    return f"{len(found)} {what}:\n" + "\n".join(found)


# --- the matchers catch what they must, and only that -----------------------------------------------------------------

def test_the_string_literal_matcher():
    source = ('a = "sync"\nb = f"sync {x}"\n# "meet"\nc = ("local", \'update\')\nd = "synchronous"\n'
              'e = {"ssp": 1}\nf = "diloco is slow"\n')
    assert string_literals(source, STRATEGY_WORDS) == [1, 4, 4, 6]


def test_the_sharding_call_matcher():
    source = ("from jax.sharding import PartitionSpec as P, NamedSharding\nimport jax\n"
              "a = P('data')\nb = NamedSharding(mesh, a)\nc = jax.sharding.PartitionSpec()\n"
              "Q = jax.sharding.PartitionSpec\nd = Q(None)\ne = isinstance(a, jax.sharding.PartitionSpec)\n"
              "f = p(1)  # another p\n")
    assert sharding_calls(source) == [3, 4, 5, 7]


# --- the lints --------------------------------------------------------------------------------------------------------

def test_no_strategy_or_variant_name_outside_strategies():
    """Checkpoint, explain, the CLI and the trainer ask the strategy; they do not spell its name or its variants'."""
    assert {"sync", "local_sgd", "diloco", "ssp", "asp"} <= STRATEGY_WORDS
    found = offenders(python_files("jaxpar", skip=["jaxpar/strategies"]),
                      lambda source: string_literals(source, STRATEGY_WORDS))
    assert not found, report(f"string literals naming a strategy or a variant ({sorted(STRATEGY_WORDS)}) outside "
                             f"jaxpar/strategies/", found)


def test_only_the_partitioning_module_builds_partition_specs_and_shardings():
    assert os.path.isfile(os.path.join(ROOT, PARTITIONING, "__init__.py"))
    found = offenders(python_files("jaxpar", skip=[PARTITIONING]), sharding_calls)
    assert not found, report(f"PartitionSpec / NamedSharding built outside {PARTITIONING}", found)


@pytest.mark.parametrize("folder", ["jaxpar", "tests"])
def test_no_pointer_to_a_design_file_the_user_does_not_have(folder):
    needle = "DESIGN" + ".md"  # spelled in two pieces so that this file does not match itself
    found = []
    for where, dirs, names in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(where, name)
            try:
                with open(path, encoding="utf-8") as handle:
                    lines = handle.read().splitlines()
            except UnicodeDecodeError:
                continue  # binary data (checkpoint arrays)
            found += [f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
                      if needle in line]
    assert not found, report(f"lines pointing at {needle} (what they refer to belongs in docs/)", found)


@pytest.mark.parametrize("strategy", [jaxpar.Sync(), jaxpar.LocalSGD(period=2, local_after=1), jaxpar.DiLoCo(),
                                      jaxpar.SSP(), jaxpar.ASP()], ids=lambda s: s.name)
def test_the_variant_list_covers_every_variant_a_strategy_declares(strategy):
    """The lint's VARIANTS are what the strategies really declare (a new variant name must be linted too): the
    variants the cost table weighs for each strategy (`jaxpar.cost.strategy_costs`, keyed by strategy class)."""
    assert set(variant_shares(strategy)) <= set(VARIANTS)
