"""Path rules: a parameter's layout chosen by a regular expression over its path, as t5x and MaxText write them.

    path_rules = [(r".*Dense_0/kernel", ("embed", "mlp")),        # logical names: mapped by the rules
                  (r".*attention.*kernel", (None, TENSOR_AXIS))]  # a mesh axis name: used as it is
    jaxpar.Trainer(..., path_rules=path_rules)

A parameter's path is its tree path without the variable's own `value`, keys joined by `/`: `hidden/kernel` for an
NNX model's `self.hidden = nnx.Linear(...)`, `blocks/0/kernel` inside a list, and for a Linen model wrapped by
`jaxpar.from_linen` the path of `flax.traverse_util.flatten_dict(variables["params"], sep="/")` (`Dense_0/kernel`,
`Encoder_0/MlpBlock_0/Dense_1/bias`; the wrapper's own prefix is dropped). Matching is `re.search` (t5x's): a rule
need not cover the whole path, and an unescaped `.` also matches the `/` (`Dense_0.kernel` works). The first rule
that matches decides; a parameter no rule matches keeps its own annotations (or, with none, the automatic FSDP
placement).

A rule gives one entry per dimension of the parameter: None (unsplit), a name, or a tuple of names (one dimension
over several axes). A name that is a mesh axis is used directly; any other name is a logical name and goes through
the rules (so `("embed", "mlp")` shards like `nnx.with_partitioning(init, ("embed", "mlp"))`). A rule whose length
differs from the parameter's rank is a `ShardingError` naming the parameter, its shape and the rule.

Path rules are a separate Trainer argument (not a form of `rules`): Flax's logical rules are also a list of pairs
whose first element is a plain name, which is also a valid regular expression.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from jaxpar.errors import ShardingError
from jaxpar.names import key_text

FORM = ("path_rules are a list of (regex over the parameter path, one entry per dimension: None, a logical or "
        "mesh axis name, or a tuple of them) pairs, e.g. [(r'.*Dense_0/kernel', ('embed', 'mlp'))]")


class MeshAxes(tuple):
    """A dimension a path rule puts on mesh axes directly (not a logical name for the rules to map)."""

    def __repr__(self) -> str:
        return "mesh axis " + " x ".join(repr(a) for a in self)


class PathRule(NamedTuple):
    pattern: re.Pattern
    entries: tuple  # per dimension: None, a name, or a tuple of names

    @property
    def text(self) -> str:
        return self.pattern.pattern


def normalize_path_rules(path_rules) -> tuple[PathRule, ...]:
    """Path rules checked and compiled; None or empty: no rules."""
    if path_rules is None:
        return ()
    if not isinstance(path_rules, (list, tuple)):
        raise ShardingError(f"path_rules {path_rules!r}: not a list; {FORM}")
    out = []
    for rule in path_rules:
        if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], (str, re.Pattern))
                and isinstance(rule[1], (list, tuple))):
            raise ShardingError(f"path_rules: {rule!r} is not a (regex, tuple of names) pair; {FORM}")
        regex, entries = rule
        for entry in entries:
            names = (entry,) if entry is None or isinstance(entry, str) else entry
            if not (isinstance(names, (list, tuple)) and all(n is None or isinstance(n, str) for n in names)):
                raise ShardingError(f"path_rules: rule {regex!r} -> {tuple(entries)!r}: entry {entry!r} is not None, "
                                    f"a name or a tuple of names; {FORM}")
        try:
            pattern = re.compile(regex) if isinstance(regex, str) else regex
        except re.error as error:
            raise ShardingError(f"path_rules: {regex!r} is not a regular expression ({error}); {FORM}") from None
        out.append(PathRule(pattern, tuple(tuple(e) if isinstance(e, list) else e for e in entries)))
    return tuple(out)


def rule_path(path) -> str:
    """The path rules match: the tree-path keys joined by `/` (`hidden/kernel`)."""
    return "/".join(key_text(entry) for entry in path)


def match(rules: tuple[PathRule, ...], path: str) -> PathRule | None:
    """The first rule whose regex is found in `path`, or None."""
    return next((rule for rule in rules if rule.pattern.search(path)), None)


def dimension_names(rule: PathRule, shape, where: str, mesh_axes) -> tuple:
    """Per dimension of the parameter `where`: None, a logical name, or `MeshAxes` for names that are mesh axes."""
    if len(rule.entries) != len(shape):
        raise ShardingError(f"parameter {where} of shape {tuple(shape)}: path rule {rule.text!r} -> "
                            f"{rule.entries!r} gives {len(rule.entries)} dimension(s) for a parameter of rank "
                            f"{len(shape)}; give one entry per dimension (None for an unsplit one)")

    def one(entry):
        if entry is None:
            return None
        names = (entry,) if isinstance(entry, str) else tuple(n for n in entry if n is not None)
        if not names:
            return None
        if all(n in mesh_axes for n in names):
            return MeshAxes(names)
        if len(names) == 1:
            return names[0]
        raise ShardingError(f"path_rules: rule {rule.text!r}: entry {entry!r} of parameter {where} mixes names; a "
                            f"tuple entry must list mesh axes ({', '.join(mesh_axes)}), a logical name stands alone")

    return tuple(one(e) for e in rule.entries)
