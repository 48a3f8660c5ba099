"""Communication variables whose names or values the libraries would silently ignore.

NCCL, libfabric, gloo and friends say nothing about a variable they do not know:
``NCCL_SOCKET_IFNAM=ib0`` leaves NCCL choosing its own interface, and the job hangs or crawls
on the wrong network. The known names are data: NCCL, FI, RCCL, ... come from
:mod:`nodescale.launch.envcheck` (what ``nodescale launch`` checks before submitting), the gloo
names below from torch itself. The decisions:

* ``fail``: a name one typo (or a reordering of its words) from a known one, a known word
  cut short or spelt out (``NCCL_DEBUG_SUBSYSTEMS`` for ``NCCL_DEBUG_SUBSYS``), a known name in
  the wrong case, a misspelt prefix (``NCLL_DEBUG``), or a value the library would reject;
* ``warn``: a name of a known family that matches nothing (a newer library may read it), or
  an old name that has a new one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from nodescale.doctor.check import Check, fail, ok, warn
from nodescale.launch.envcheck import FAMILIES as LAUNCH_FAMILIES
from nodescale.launch.envcheck import RENAMED, VALUE_RULES, Family, closest, near_miss

# gloo: the names libtorch_cpu.so of torch 2.13 reads (its strings GLOO_* and TORCH_GLOO_*).
GLOO_NAMES = frozenset({
    "GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT", "GLOO_DISABLE_CONNECTION_RETRIES",
    "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "GLOO_LOG_LEVEL",
})
TORCH_GLOO_NAMES = frozenset({"TORCH_GLOO_LAZY_INIT"})

# Longer prefixes first: TORCH_NCCL_X belongs to TORCH_NCCL_, not to a typo of NCCL_.
FAMILIES: tuple[Family, ...] = (
    Family("TORCH_GLOO_", "PyTorch gloo", "a", TORCH_GLOO_NAMES),
    *LAUNCH_FAMILIES,
    Family("GLOO_", "gloo", "a", GLOO_NAMES),
)

# A looser guess for names that are no near miss: offered with a warning, never a failure.
_LOOSE_CUTOFF = 0.8


def family_of(name: str) -> Family | None:
    """The family whose prefix ``name`` starts with (case-sensitive, as the libraries read it)."""
    return next((family for family in FAMILIES if name.startswith(family.prefix)), None)


def is_known(name: str) -> bool:
    """Whether some library reads ``name`` exactly as written."""
    family = family_of(name)
    return family is not None and (name in family.known or name.startswith(family.open_prefixes))


def misspelt_prefix(name: str) -> Family | None:
    """The family ``name`` was probably meant for when its prefix is one typo off (``NCLL_``, ``GLO_``).

    Prefixes of two letters (``FI_``) are left out: one edit from them matches too many names.
    """
    head, sep, _ = name.partition("_")
    if not sep:
        return None
    for family in FAMILIES:
        wanted = family.prefix.rstrip("_")
        if "_" in wanted or len(wanted) < 4 or head == wanted:
            continue
        if closest(head, (wanted,), limit=1):
            return family
    return None


def communication_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the name checks look at: every family's, in any case, and misspelt prefixes.

    Only these are sent to rank 0 and written to the report; the rest of a job's environment
    (tokens, paths) stays on its node.
    """
    selected = {}
    for name, value in environ.items():
        upper = name.upper()
        if family_of(upper) is not None or misspelt_prefix(upper) is not None:
            selected[name] = value
    return dict(sorted(selected.items()))


def abbreviation_of(name: str, family: Family) -> str | None:
    """A known name equal to ``name`` but for one word cut short or spelt out.

    ``NCCL_DEBUG_SUBSYSTEMS`` -> ``NCCL_DEBUG_SUBSYS``; ``NCCL_SOCKET_IFNAM`` -> ``NCCL_SOCKET_IFNAME``.
    A word must keep at least 3 letters, so that ``NCCL_IB`` is no abbreviation of anything.
    """
    words = name.split("_")
    for known in sorted(family.known):
        other = known.split("_")
        if len(other) != len(words):
            continue
        differing = [(a, b) for a, b in zip(words, other, strict=True) if a != b]
        if len(differing) == 1:
            a, b = differing[0]
            if min(len(a), len(b)) >= 3 and (a.startswith(b) or b.startswith(a)):
                return known
    return None


def check_variables(comm_env: Mapping[str, str]) -> list[Check]:
    """One row per problem variable in ``comm_env``, or one ``ok`` row when there is none."""
    rows: list[Check] = []
    for name in sorted(comm_env):
        row = _check_one(name, str(comm_env[name]))
        if row is not None:
            rows.append(row)
    if not rows:
        rows.append(ok("env.variables", f"NCCL/FI/gloo variables all known and valid ({_listed(sorted(comm_env))})"))
    return rows


def _listed(names: list[str], most: int = 6) -> str:
    if not names:
        return "none set"
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"


def _check_one(name: str, value: str) -> Check | None:
    row = f"env.{name}"
    shown = f"{name}={value}"
    upper = name.upper()
    if upper != name and is_known(upper):
        return fail(row, f"{shown}: variable names are case-sensitive; only {upper} is read",
                    f"write {upper}={value}")
    family = family_of(name)
    if family is None:
        meant = misspelt_prefix(upper)
        if meant is None:
            return None
        guess = _guess(meant.prefix + upper.partition("_")[2], meant)
        hint = f"did you mean {guess}?" if guess else f"{meant.library} variables start with {meant.prefix}"
        return fail(row, f"{shown}: no library reads this name (prefix {upper.partition('_')[0]}_ is not "
                    f"{meant.prefix})", hint)
    if not is_known(name):
        strong = near_miss(name, family) or abbreviation_of(name, family)
        what = f"{shown}: not {family.article} {family.library} variable; {family.library} ignores it without a word"
        if strong:
            return fail(row, what, f"did you mean {strong}?")
        loose = difflib.get_close_matches(name, sorted(family.known), n=1, cutoff=_LOOSE_CUTOFF)
        hint = (f"did you mean {loose[0]}?" if loose else
                f"fine if your {family.library} version is newer than nodescale's list; else check the spelling")
        return warn(row, f"{shown}: not {family.article} {family.library} variable nodescale knows", hint)
    if name in RENAMED:
        return warn(row, f"{shown}: old name of {RENAMED[name]}, still read for now", f"use {RENAMED[name]}")
    rule = VALUE_RULES.get(name)
    problem = rule(value) if rule else None
    if problem:
        broken, hint = problem
        return fail(row, f"{shown}: {broken}", hint)
    return None


def _guess(name: str, family: Family) -> str | None:
    """A known name for ``name`` once its prefix is corrected: exact, a near miss, or an abbreviation."""
    if name in family.known:
        return name
    return near_miss(name, family) or abbreviation_of(name, family)
