"""The README's promises about the repository itself."""

from __future__ import annotations

import re

from conftest import REPO


def _quickstart_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Quickstart\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md must have a Quickstart section"
    block = re.search(r"```bash\n(.*?)```", section.group(1), re.S)
    assert block, "the Quickstart section must hold a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_quickstart_is_exactly_two_commands_and_ci_runs_the_second() -> None:
    first, second = _quickstart_commands()
    assert first.endswith("nodescale train")
    ci_script = (REPO / ".ci" / "run").read_text()
    assert second in ci_script.splitlines()


def test_readme_is_the_first_section() -> None:
    headings = re.findall(r"^## (.+)$", (REPO / "README.md").read_text(), re.M)
    assert headings[0] == "Quickstart"


def test_torch_is_declared_loosely_and_pinned_by_constraints() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.6"' in pyproject
    assert (REPO / "constraints.txt").read_text().split() == ["torch==2.13.0"]
