"""User-facing errors: what was wrong, the rule it broke, and how to fix it.

Every mistake a user can make (a bad flag, a missing file, an impossible
combination) is raised as :class:`UserError`. The CLI prints it without a
traceback and exits with status 2; everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input, reported as value + rule + hint."""

    # Said once already (launch.schedulers.local_launcher.report_user_error): a rank of a job
    # says it before leaving the process group, as its peers' launcher may end it right after.
    reported = False

    def __init__(self, what: str, rule: str, hint: str | None = None) -> None:
        self.what = what
        self.rule = rule
        self.hint = hint
        super().__init__(self.render())

    def __reduce__(self) -> tuple[type[UserError], tuple[str, str, str | None]]:
        # DataLoader workers and multiprocessing pickle exceptions to re-raise
        # them in the parent; keep all three parts, not just the message.
        return (type(self), (self.what, self.rule, self.hint))

    def render(self) -> str:
        text = f"{self.what}: {self.rule}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


def one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                     line: str | None = None) -> str:
    """``warnings.formatwarning`` for nodescale's processes: users need the message, not nodescale's source line."""
    return f"nodescale: warning: {message}\n"


def did_you_mean(value: str, choices: Iterable[str]) -> str | None:
    """The closest of ``choices`` to ``value``, if any is close enough to suggest."""
    matches = difflib.get_close_matches(str(value), list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_choice(kind: str, value: str, choices: Iterable[str]) -> UserError:
    """The error for a name that is not one of the known ``choices``.

    >>> str(unknown_choice("strategy", "fsdb", ["ddp", "fsdp"])).splitlines()[0]
    "strategy 'fsdb': not one of ddp, fsdp"
    """
    options = sorted(choices)
    guess = did_you_mean(value, options)
    hint = f"did you mean {guess!r}?" if guess else f"choose one of: {', '.join(options)}"
    return UserError(f"{kind} {value!r}", f"not one of {', '.join(options)}", hint)


def program_not_found(program: str) -> UserError:
    """The error for a command whose program cannot be started (no such file on PATH)."""
    return UserError(f"command {program!r}", "is not a program on PATH", "check the spelling, or give its path")
