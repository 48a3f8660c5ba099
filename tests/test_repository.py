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


def test_no_package_imports_back_a_package_that_imports_it() -> None:
    """Packages form layers (TYPE_CHECKING imports count): a subpackage of src/nodescale, or a top-level module."""
    import ast
    from collections import defaultdict

    root = REPO / "src" / "nodescale"
    imports: dict[str, set[str]] = defaultdict(set)
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        package = parts[0] if len(parts) > 1 else path.stem
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                dotted = name.split(".")
                if dotted[0] == "nodescale" and len(dotted) > 1 and dotted[1] != package:
                    imports[package].add(dotted[1])
    pairs = {tuple(sorted((a, b))) for a in imports for b in imports[a] if a in imports.get(b, set())}
    assert pairs == set(), (
        f"packages that import each other: {sorted(pairs)}; move the shared piece into the lower one (or a "
        "module below both), e.g. a component's config section lives with the component, config/ only assembles")


def _third_party_modules() -> set[str]:
    """Every module src/ imports that is not nodescale's own, with each package above it."""
    import ast

    names: set[str] = set()
    for path in (REPO / "src" / "nodescale").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
    parts = {".".join(name.split(".")[:i]) for name in names for i in range(1, name.count(".") + 2)}
    return {name for name in parts if name.split(".")[0] != "nodescale"}


def test_no_block_of_six_similar_lines_is_repeated_in_src() -> None:
    """pylint's duplicate-code check (imports, docstrings, comments and signatures are boilerplate).

    Stripping imports makes astroid infer through the imported packages; torch alone took 2.5 minutes of the
    check. Only nodescale's own lines are compared, so the others are left out (--ignored-modules).
    """
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pylint", "--disable=all", "--enable=duplicate-code", "--min-similarity-lines=6",
         "--score=n", f"--ignored-modules={','.join(sorted(_third_party_modules()))}", str(REPO / "src" / "nodescale")],
        capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"repeated blocks in src/ (make one piece of code serve both):\n{result.stdout}"


def test_files_sharing_a_session_fixture_run_on_one_xdist_worker() -> None:
    """Else each worker makes the run (or starts the Slurm cluster) again: minutes, not a failure."""
    from worker_groups import group_of

    users: dict[str, set[str]] = {}
    pattern = re.compile(r"\b(ddp_references|uninterrupted_two_rank_run|slurm_cluster|SlurmCluster)\b")
    for path in (REPO / "tests").glob("test_*.py"):
        if path.name == "test_repository.py":  # names them here
            continue
        for name in set(pattern.findall(path.read_text())):
            users.setdefault(name.replace("SlurmCluster", "slurm_cluster"), set()).add(path.name)
    assert users.keys() == {"ddp_references", "uninterrupted_two_rank_run", "slurm_cluster"}
    for fixture, files in users.items():
        assert {group_of(f"tests/{name}::t") for name in files} == {fixture}, (fixture, sorted(files))
