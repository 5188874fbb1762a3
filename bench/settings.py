"""The accuracy benchmark's settings: their names, the recompute policies they combine, and
the defaults that `bench accuracy` and its command line share (this is their one owner).

A setting is a cached rule ("baseline", "cached", "isolate", "scaffold", "cached-bf16"),
optionally with a recompute policy: "cached+first:4" is the cached rule with policy
first:4 applied per request (accuracy.py says what each one measures). Light on purpose:
`promptlang --help` imports it for the defaults it prints.
"""

from __future__ import annotations

from typing import Sequence

from promptlang.errors import InvalidArgumentError
from promptlang.runtime.recompute.policy import Recompute

BASE_SETTINGS = ("baseline", "cached", "isolate", "scaffold")
SETTINGS = BASE_SETTINGS                # the settings without recompute (see `settings`)
DESCRIPTIONS = {
    "baseline": "full prefill, no reuse",
    "cached": "modules, guaranteed context (default rule)",
    "cached-bf16": "cached, from a bfloat16 store (half the KV bytes per token)",
    "isolate": "modules, isolated (the paper's rule)",
    "scaffold": "one scaffold per item (joint encoding)",
    "RULE+SPEC": "RULE's cached modules with recompute policy SPEC per request",
}
DEFAULT_RECOMPUTE = ("exact", "first:16", "first:32", "deviation:0.15")   # exact: the default
QUICK_RECOMPUTE = ("exact", "first:2", "deviation:0.2")
RECOMPUTE_RULES = ("cached", "isolate")    # the cached rules a policy is applied to
STORE16 = "cached-bf16"       # the cached setting on a bfloat16 store


def normalize_specs(specs: Sequence[str | Recompute]) -> tuple[str, ...]:
    """Recompute policies as canonical text, in order, duplicates and "none" dropped
    (raises promptlang.errors.RecomputeSpecError on a malformed one)."""
    out: list[str] = []
    for spec in specs:
        policy = Recompute.parse(spec)
        if policy != Recompute() and str(policy) not in out:     # primed alone counts
            out.append(str(policy))
    return tuple(out)


def settings(recompute: Sequence[str] = (), rules: Sequence[str] = RECOMPUTE_RULES,
             scaffold: bool = True, store16: bool = False,
             isolate: bool = True) -> tuple[str, ...]:
    """Every setting, in report order: baseline, cached, cached+SPEC..., [cached-bf16],
    [isolate, isolate+SPEC...], [scaffold]; RULE+SPEC only for the RULEs in `rules`."""
    specs = normalize_specs(recompute)
    unknown = set(rules) - set(RECOMPUTE_RULES)
    if unknown:
        raise InvalidArgumentError(f"unknown rule(s) {sorted(unknown)}: choose from "
                                   f"{', '.join(RECOMPUTE_RULES)}")
    names = ["baseline"]
    for rule in RECOMPUTE_RULES:
        if rule == "isolate" and not isolate:
            continue
        names += [rule, *(f"{rule}+{s}" for s in specs if rule in rules)]
        if rule == "cached" and store16:
            names.append(STORE16)
    return tuple(names + ["scaffold"] * scaffold)


def split_setting(name: str) -> tuple[str, str]:
    """("cached", "first:4") for "cached+first:4"; ("cached", "none") for "cached"."""
    rule, _, spec = name.partition("+")
    return rule, spec or "none"
