"""``nodescale bench scaling --nodes``: a study across node counts, one job per count.

Bad input and the PBS scripts run in this process (the PBS server is a stand-in qsub); the real Slurm
study is in tests/test_scaling_study_slurm.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import golden_files
from nodescale.bench import scaling_study
from nodescale.errors import UserError
from scheduler_fixtures import search_path
from test_hostile_input import arg_text, bash_n, check_outcome, few, run_main

GOLDEN = golden_files.GOLDEN_ROOT / "scaling_study"
TRAIN = ["--max-steps", "4", "--warmup-steps", "1", "--batch-size", "8", "--model", "toy", "--dataset",
         "regression"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--scheduler", "slurm", "--nodes", "0,1"], "at least 1 node"),
    (["--scheduler", "slurm", "--nodes", "1,2,2"], "names 2 twice"),
    (["--scheduler", "slurm", "--nodes", "1,two"], "node counts separated by commas"),
    (["--scheduler", "slurm", "--nodes", ""], "node counts separated by commas"),
    (["--nodes", "1,2"], "--nodes without --cluster or --scheduler"),
    (["--scheduler", "slurm", "--sequential"], "--sequential without --nodes"),
    (["--cluster", "generic-slurm"], "--cluster without --nodes"),
    (["--scheduler", "slurm", "--nodes", "1,2", "--world-sizes", "1,2"], "--nodes with --world-sizes"),
    (["--scheduler", "local", "--nodes", "1,2"], "--scheduler local with --nodes"),
    (["--scheduler", "slurm", "--nodes", "1,3", "--batch-size", "8"], "divide evenly"),
])
def test_bad_studies_exit_2_with_a_hint(argv: list[str], says: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, stderr = run_main(["bench", "scaling", "--out", "study", "--gpus-per-node", "0", *argv])
    assert code == 2 and says in stderr and "hint:" in stderr, stderr
    assert "Traceback" not in stderr and not list(tmp_path.iterdir())


def test_node_counts_are_sorted() -> None:
    assert scaling_study.parse_nodes("4, 1,2") == [1, 2, 4]
    with pytest.raises(UserError, match="separated by commas"):
        scaling_study.parse_nodes("-1")


def test_pbs_study_scripts_golden_and_chained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequential 2-size PBS study through a stand-in qsub: each script as a golden file, the second after the
    first (afterany), study.json with both jobs, and --collect saying neither has finished."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qsub").write_text('#!/bin/sh\nn=$(cat "$0.n" 2>/dev/null || echo 4241); n=$((n + 1))\n'
                                  'echo $n > "$0.n"; echo "$1" >> "$0.calls"; echo "$n.pbsserver"\n')
    (bin_dir / "qsub").chmod(0o755)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{search_path()}")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["bench", "scaling", "--scheduler", "pbs", "--nodes", "2,1", "--sequential",
                               "--account", "proj", "--time", "00:20:00", "--gpus-per-node", "2", "--job-dir", "jobs",
                               "--out", "study", *TRAIN, "--", "--precision", "fp32"])
    assert code == 0, err
    assert "submitted pbs job 4243.pbsserver: 2 node(s), world size 4 (after 4242.pbsserver)" in out, out
    study = scaling_study.read(tmp_path / "study")
    assert [(j.nodes, j.world_size, j.job_id) for j in study.jobs] == [(1, 2, "4242.pbsserver"),
                                                                         (2, 4, "4243.pbsserver")]
    assert (bin_dir / "qsub.calls").read_text().split() == [j.script for j in study.jobs]
    for job in study.jobs:
        text = Path(job.script).read_text().replace(str(tmp_path), "/home/user/project")
        golden_files.check_golden(GOLDEN / f"pbs-nodes-{job.nodes}.sh", text)
    first, second = (Path(job.script).read_text() for job in study.jobs)
    assert "#PBS -W depend=afterany:4242.pbsserver" in second and "-W depend" not in first
    assert "--batch-size 4 " in first and "--batch-size 2 " in second  # the global 8 over 2 and 4 processes
    # Neither has run (qstat is not here): each is reported failed, none as a zero row.
    code, out, err = run_main(["bench", "scaling", "--collect", "study"])
    assert code == 0 and "1 node(s), job 4242.pbsserver: failed" in out and "no size has finished" in out, out + err
    assert not (tmp_path / "study" / "scaling.json").exists()
    registry = (tmp_path / "state" / "nodescale" / "jobs.jsonl").read_text().splitlines()
    assert [json.loads(line)["job_id"] for line in registry] == ["4242.pbsserver", "4243.pbsserver"]
    code, _, err = run_main(["bench", "scaling", "--scheduler", "pbs", "--nodes", "1,2", "--out", "study", *TRAIN])
    assert code == 2 and "already holds a scaling study" in err


def test_dry_run_shows_the_jobs_and_the_first_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["bench", "scaling", "--scheduler", "slurm", "--nodes", "1,2", "--gpus-per-node", "0",
                               "--mode", "weak", "--dry-run", "--out", "study", *TRAIN])
    assert code == 0, err
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("#     ")]
    assert rows == [["1", "1", "8", "-", str(tmp_path / "study" / "nodes-1")],
                    ["2", "2", "8", "-", str(tmp_path / "study" / "nodes-2")]], out
    assert out.count("#SBATCH --nodes=") == 1 and "#SBATCH --nodes=1" in out
    assert f"--no-progress --out {tmp_path / 'study' / 'nodes-1'}" in out and "--nproc " not in out
    assert not list(tmp_path.iterdir())


study_flags = st.lists(
    st.tuples(st.sampled_from(["--nodes", "--cluster", "--scheduler", "--account", "--time", "--queue",
                               "--gpus-per-node", "--job-dir", "--out", "--batch-size"]),
              st.one_of(st.sampled_from(["1,2", "1,2,4", "0", "2,2", "-1", "1,,2", "slurm", "pbs", "local",
                                         "generic-slurm", "00:10:00", "99:99:99", "0", "16"]), arg_text))
    .filter(lambda t: t[1] != "--").map(lambda t: f"{t[0]}={t[1]}"), max_size=5)


@few(40)
@given(flags=study_flags, sequential=st.booleans())
def test_cli_study_dry_run_random(flags: list[str], sequential: bool) -> None:
    """Any value of the study's flags: exit 0 or 2 with a reason, nothing written, a script bash can read."""
    argv = ["bench", "scaling", "--out=study", *flags, *(["--sequential"] if sequential else []), "--dry-run",
            "--max-steps=2", "--warmup-steps=1", "--batch-size=8"]
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        code, stdout, stderr = run_main(argv)
        check_outcome(argv, code, stderr)
        assert not list(Path(tmp).iterdir()), "a dry run wrote files"
        _, _, script = stdout.partition("\n#!/bin/bash\n")
        if code == 0 and script:
            bash_n("#!/bin/bash\n" + script, Path(tmp))


def test_gathering_after_the_step_keeps_the_jobs_exit_code(tmp_path: Path) -> None:
    """The lines a study job runs after its step (launch/after_step.py): a failed collect says so, and the job
    still exits with the step's code; in a container preset the collect runs inside it."""
    import subprocess

    from nodescale.launch import after_step
    from nodescale.launch.spec import Container

    run = [["set -euo pipefail", "step_status=5", after_step.EXIT_LINE]]  # strict, as every job script is
    blocks = after_step.before_exit(run, after_step.lines(["false", "it's"], None))
    done = subprocess.run(["bash", "-c", "\n".join(blocks[-1])], capture_output=True, text=True, timeout=10)
    assert done.returncode == 5 and "nodescale: false 'it'\"'\"'s' failed; run it again by hand" in done.stdout
    inside = after_step.lines(["nodescale", "bench"], Container(runtime="apptainer", image="/c.sif"))
    assert inside[1:] == ["apptainer exec /c.sif \\", "    nodescale bench || echo 'nodescale: nodescale bench failed; "
                          "run it again by hand'"]
    unchanged = [[after_step.EXIT_LINE]]
    assert after_step.before_exit(unchanged, after_step.lines([], None)) == unchanged
