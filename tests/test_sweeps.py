"""``nodescale launch --sweep``: members from the flags (pure), bad input (exit 2), the array scripts (golden
files), a PBS array member run under the real mpiexec, and a sweep run here with ``--resubmit-failed``.

The Slurm array on the local cluster is tests/test_sweep_slurm.py.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import golden_files
from conftest import run_cli
from nodescale.errors import UserError
from nodescale.launch import job_array, sweep_manifest
from nodescale.launch.render_pbs import render_pbs
from nodescale.launch.render_slurm import render_slurm
from nodescale.launch.schedulers.pbs_version import has_max_run_subjobs, parse_version
from nodescale.launch.spec import JobArray
from nodescale.launch.sweep import check_size, check_trials, env_name, expand, member_command, parse_axes, yaml_value
from nodescale.launch.sweep_manifest import Member, Sweep
from nodescale.launch.sweep_member import resolve
from scheduler_fixtures import search_path
from test_hostile_input import run_main
from test_render import PRESETS, golden_spec

GOLDEN = golden_files.GOLDEN_ROOT / "sweep"


# --- members from the flags -----------------------------------------------------------------------


def test_grid_keys_cross_first_key_slowest() -> None:
    members = expand(parse_axes(["optim.lr=0.1,0.01", "batch-size=32,64,128"]), None, 0)
    assert len(members) == 6
    assert members[:3] == [{"optim.lr": "0.1", "batch-size": b} for b in ("32", "64", "128")]
    assert members[3] == {"optim.lr": "0.01", "batch-size": "32"}


def test_trials_are_seeded_reproducible_within_range_and_cross_the_grid() -> None:
    axes = parse_axes(["optim.lr=log:1e-4:1e-1", "batch-size=32,64", "train.seed=int:1:5"])
    first, again, other = expand(axes, 8, 0), expand(axes, 8, 0), expand(axes, 8, 1)
    assert first == again and first != other
    assert len(first) == 16
    assert all(1e-4 <= m["optim.lr"] <= 1e-1 and 1 <= m["train.seed"] <= 5 for m in first)
    assert isinstance(first[0]["train.seed"], int)
    # The same eight draws for each batch size: the grid crosses with the trials.
    assert [m["optim.lr"] for m in first[:8]] == [m["optim.lr"] for m in first[8:]]
    assert len({m["optim.lr"] for m in first[:8]}) == 8
    assert list(first[0]) == ["optim.lr", "batch-size", "train.seed"]  # the keys in the order given


def test_lin_draws_and_member_limits() -> None:
    drawn = expand(parse_axes(["x=lin:-1:1"]), 50, 3)
    assert all(-1 <= m["x"] <= 1 for m in drawn) and min(m["x"] for m in drawn) < 0
    axes = parse_axes(["a=" + ",".join(map(str, range(40))), "b=" + ",".join(map(str, range(30)))])
    with pytest.raises(UserError, match=r"40 a x 30 b = 1200 members.*limit of 1000"):
        check_size(axes, None, None, "local")
    with pytest.raises(UserError, match=r"2 a x 3 trials = 6 members.*array limit of 5"):
        check_size(parse_axes(["a=1,2", "b=log:1:2"]), 3, 5, "tiny")
    assert check_size(parse_axes(["a=1,2", "b=log:1:2"]), 3, 6, "tiny") == 6


@pytest.mark.parametrize(("flags", "trials", "says"), [
    (["optim.lr="], None, "must look like KEY=V1,V2"),
    (["=1,2"], None, "must look like KEY=V1,V2"),
    (["optim.lr=0.1,,0.2"], None, "empty value"),
    (["a=1,2", "a=3"], None, "given twice"),
    (["a=log:0:1"], 4, "LO must be above 0"),
    (["a=lin:2:1"], 4, "LO below HI"),
    (["a=int:1.5:3"], 4, "whole numbers"),
    (["a=log:x:1"], 4, "needs two numbers"),
    (["a=log:1e-4:1e-1"], None, "needs --trials"),
    (["a=1,2"], 4, "no --sweep key is a range"),
])
def test_bad_sweep_flags(flags: list[str], trials: int | None, says: str) -> None:
    with pytest.raises(UserError, match=says) as raised:
        check_trials(parse_axes(flags), trials)
    assert raised.value.hint


def test_member_command_for_train_and_for_any_other_command(tmp_path: Path) -> None:
    sweep = Sweep("s", tmp_path, ["x"], [], ["optim.lr", "data.name"],
                  [Member(2, {"optim.lr": 1e-05, "data.name": "yes"}, str(tmp_path / "m002"))])
    argv, env = member_command(sweep, sweep.members[0], ["nodescale", "train", "--max-steps", "3"], resume=True)
    assert argv == ["nodescale", "train", "--max-steps", "3", "--set", "optim.lr=1.0e-05", "--set",
                    "data.name='yes'", "--out", str(tmp_path / "m002"), "--resume"]
    assert env["NODESCALE_SWEEP_INDEX"] == "2" and env["NODESCALE_RUN_DIR"] == str(tmp_path / "m002")
    argv, env = member_command(sweep, sweep.members[0], ["python3", "run.py"])
    assert argv == ["python3", "run.py"]
    assert env["NODESCALE_SWEEP_OPTIM_LR"] == "1e-05" and env["NODESCALE_SWEEP_DATA_NAME"] == "yes"
    assert env["NODESCALE_SWEEP_DIR"] == str(tmp_path) and "NODESCALE_SWEEP_RESUME" not in env
    assert env_name("batch-size") == "NODESCALE_SWEEP_BATCH_SIZE"
    assert yaml_value(0.1) == "0.1" and yaml_value(32) == "32"


def test_the_wrapper_finds_its_member_from_the_array_index(tmp_path: Path) -> None:
    sweep = Sweep("s", tmp_path, ["echo"], [], ["w"], [Member(i, {"w": f"v{i}"}, str(tmp_path / f"m{i:03d}"))
                                                      for i in range(3)])
    sweep_manifest.write(sweep)
    for env in ({"SLURM_ARRAY_TASK_ID": "1"}, {"PBS_ARRAY_INDEX": "1"}, {"NODESCALE_SWEEP_INDEX": "1",
                                                                          "SLURM_ARRAY_TASK_ID": "0"}):
        argv, member_env = resolve([str(tmp_path), "--", "echo", "hi"], env)
        assert argv == ["echo", "hi"] and member_env["NODESCALE_SWEEP_W"] == "v1", env
    with pytest.raises(UserError, match="no index"):
        resolve([str(tmp_path), "--", "echo"], {})
    with pytest.raises(UserError, match="not one of the 3 members"):
        resolve([str(tmp_path), "--", "echo"], {"NODESCALE_SWEEP_INDEX": "7"})


def test_array_ranges_and_pbs_runs() -> None:
    assert job_array.ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert job_array.pbs_runs([1, 3]) == [[1, 3]]
    assert job_array.pbs_runs([1, 2, 5]) == [[1, 2], [5]]
    assert job_array.pbs_directives([1, 3], 2) == ["-J 1-3:2", "-W max_run_subjobs=2", "-r y"]
    assert job_array.pbs_directives([4], None) == []  # one member: a plain job
    assert job_array.index_lines([4], "pbs")[-1] == "export NODESCALE_SWEEP_INDEX=4"


# --- the CLI: bad input, the dry run ----------------------------------------------------------------


def launch(*argv: str) -> tuple[int, str, str]:
    return run_main(["launch", *argv])


TRAIN = ["--", "nodescale", "train", "--max-steps", "2"]


@pytest.mark.parametrize(("argv", "says"), [
    (["--sweep", "", *TRAIN], "must look like KEY=V1,V2"),
    (["--sweep", "optim.lrr=0.1,0.2", *TRAIN], "unknown key 'optim.lrr'"),
    (["--sweep", "lrate=0.1,0.2", *TRAIN], "neither a configuration key"),
    (["--sweep", "batch-size=32,64", "--sweep", "train.batch_size=8", *TRAIN], "name the same setting"),
    (["--sweep", "optim.lr=0.1,-1", *TRAIN], "sweep member 1 (optim.lr=-1)"),
    (["--sweep", "optim.lr=0.1", "--trials", "4", *TRAIN], "no --sweep key is a range"),
    (["--sweep", "optim.lr=log:1e-4:1", *TRAIN], "needs --trials"),
    (["--sweep", "out=a,b", *TRAIN], "set by the sweep itself"),
    (["--sweep", "a=1,2", "--max-concurrent", "many", "--", "true"], "--max-concurrent many"),
    (["--max-concurrent", "2", "--", "true"], "without --sweep"),
    (["--sweep", "a.b=1,2", "--sweep", "a_b=3", "--", "true"], "given twice"),
    (["--scheduler", "pbs", "--sweep", "a=1", "--", "true"], "-J needs at least 2"),
    (["--sweep", "batch-size=32,64", "--", "nodescale", "train", "--batch", "16"], "would override"),
    (["--plan", "--sweep", "optim.lr=0.1,0.2", *TRAIN], "a sweep runs several"),
])
def test_bad_sweeps_exit_2_with_a_hint(argv: list[str], says: str, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, stderr = launch("--dry-run", *argv)
    assert code == 2 and says in stderr and "hint:" in stderr, stderr
    assert "Traceback" not in stderr and not list(tmp_path.iterdir())


def test_dry_run_shows_members_the_override_and_the_array_script(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = launch("--scheduler", "slurm", "--dry-run", "--sweep", "optim.lr=0.1,0.03", "--sweep",
                            "batch-size=32,64", "--max-concurrent", "3", "--", "nodescale", "train", "--lr", "0.5",
                            "--out", "lrs")
    assert code == 0, err
    assert "the command's --lr 0.5 gives way to each member's optim.lr" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"^  \d ", line)]
    assert rows == [[str(i), lr, bs, str(tmp_path / "lrs" / f"m00{i}")]
                    for i, (lr, bs) in enumerate([("0.1", "32"), ("0.1", "64"), ("0.03", "32"), ("0.03", "64")])]
    assert "#SBATCH --array=0-3%3" in out and "slurm-%A_%a.out" in out
    assert 'scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in out
    assert f"nodescale sweep-member {tmp_path / 'lrs'} -- nodescale train --out lrs" in out
    assert not list(tmp_path.iterdir())


# `qstat -B -f -F json` as PBS prints it (shortened): the client's version at the top, the server's below.
QSTAT_SERVER = ('{"timestamp":1700000000,"pbs_version":"%s","pbs_server":"pbs1",'
                '"Server":{"pbs1":{"server_state":"Active","pbs_version":"%s"}}}')


def test_pbs_versions_with_and_without_max_run_subjobs() -> None:
    assert parse_version(QSTAT_SERVER % ("2022.1.1", "19.1.3")) == "19.1.3"  # the server's decides
    assert parse_version("pbs_version = 20.0.1\n") == "20.0.1"  # qstat --version
    assert parse_version('{"Server": {}}') is None and parse_version("Version: 6.1.2") is None
    assert [has_max_run_subjobs(v) for v in ("13.1.0", "19.1.3", "2020.1.0", "2022.1.3", "20.0.1", "23.06.06")] \
        == [False, False, True, True, True, True]


@pytest.mark.parametrize(("qstat", "refused"), [
    (f"echo '{QSTAT_SERVER % ('19.1.3', '19.1.3')}'", True),
    (f"echo '{QSTAT_SERVER % ('2021.1.3', '2021.1.3')}'", False),
    ("echo 'Connection refused' >&2; exit 1", False),  # unreachable: rendered as today
])
def test_max_concurrent_is_refused_on_a_pbs_without_max_run_subjobs(qstat: str, refused: bool, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "qstat").write_text(f"#!/bin/sh\n{qstat}\n")
    (tmp_path / "bin" / "qstat").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    code, out, err = launch("--scheduler", "pbs", "--dry-run", "--sweep", "a=1,2,3", "--max-concurrent", "2",
                            "--", "true")
    if refused:
        assert code == 2 and "--max-concurrent 2: becomes qsub -W max_run_subjobs" in err, err
        assert "PBS server is version 19.1.3" in err and "hint: drop --max-concurrent" in err and "Traceback" not in err
    else:
        assert code == 0 and "#PBS -W max_run_subjobs=2" in out, err


# --- array scripts: golden files ----------------------------------------------------------------------


@pytest.mark.parametrize(("preset", "mode", "indices", "limit"), [
    ("pbs-pals", "torchrun", [0, 1, 2, 3, 4, 5], 4), ("pbs-openmpi", "per-gpu", [1, 3], None),
    ("slurm-gres", "torchrun", [0, 1, 2, 3, 4, 5], 4),
])
def test_array_script_golden(preset: str, mode: str, indices: list[int], limit: int | None) -> None:
    spec = golden_spec(PRESETS[preset], mode)
    spec = spec.model_copy(update={
        "command": ["nodescale", "sweep-member", "/home/user/project/sweep", "--",
                    *spec.command],
        "array": JobArray(indices=indices, max_concurrent=limit, sweep_dir=Path("/home/user/project/sweep"))})
    text = (render_slurm if preset.startswith("slurm") else render_pbs)(spec, PRESETS[preset])
    golden_files.check_golden(GOLDEN / f"{preset}-{mode}.sh", text)


# --- a PBS member under the real mpiexec, and a sweep run here --------------------------------------------

PROBE = ("import json, os; print('MEMBER ' + json.dumps({k: os.environ.get(k) for k in "
         "('RANK', 'NODESCALE_SWEEP_INDEX', 'NODESCALE_SWEEP_WORD', 'NODESCALE_RUN_DIR')}), flush=True)")


@pytest.mark.multiproc
@pytest.mark.parametrize("flavour", ["mpich", "openmpi"])
def test_pbs_array_member_reaches_every_rank(flavour: str, tmp_path: Path, pbs_run,  # noqa: F811
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted through a stand-in qsub (no PBS server here), then run as PBS runs subjob 1 of the array."""
    bin_dir, presets = tmp_path / "bin", tmp_path / "presets"
    bin_dir.mkdir()
    presets.mkdir()
    (bin_dir / "qsub").write_text("#!/bin/sh\necho 4242[].pbsserver\n")
    (bin_dir / "qsub").chmod(0o755)
    (presets / "ci-pbs.yaml").write_text(f"extends: generic-pbs\nmpiexec: {flavour}\n")
    monkeypatch.setenv("NODESCALE_PRESET_DIR", str(presets))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{search_path()}")
    result = run_cli(["launch", "--cluster", "ci-pbs", "--nodes", "2", "--gpus-per-node", "1", "--nproc-per-node",
                      "1", "--mode", "per-gpu", "--job-dir", "jobs", "--sweep", "word=plain,$(touch pwned) 'q'",
                      "--stop-handler", "nodescale", "--", "python3", "-c", PROBE], cwd=tmp_path)
    script = Path(re.search(r"^  script: (.+)$", result.stdout, re.M).group(1))
    assert "#PBS -J 0-1" in script.read_text() and 'qrerun "$PBS_JOBID"' in script.read_text()
    sweep = sweep_manifest.read(tmp_path / "jobs" / "sweeps" / next(os.walk(tmp_path / "jobs" / "sweeps"))[1][0])
    assert [s.job_id for s in sweep.submissions] == ["4242[].pbsserver"]
    assert sweep.submissions[0].log.endswith("pbs-4242[{index}].log")

    job = pbs_run(script, 2, mpiexec=flavour, workdir=tmp_path, job_id="4242[1].pbsserver",
                  env={"PBS_ARRAY_INDEX": "1", "PBS_ARRAY_ID": "4242[].pbsserver",  # as PBS sets them
                       **{name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ}})
    assert job.returncode == 0, job.output
    seen = [json.loads(line.split("MEMBER ", 1)[1]) for line in job.output.splitlines() if "MEMBER " in line]
    assert sorted(s["RANK"] for s in seen) == ["0", "1"], job.output  # every rank is member 1
    assert all(s["NODESCALE_SWEEP_WORD"] == "$(touch pwned) 'q'" and s["NODESCALE_SWEEP_INDEX"] == "1"
               and s["NODESCALE_RUN_DIR"] == sweep.members[1].run_dir for s in seen), seen
    assert sweep_manifest.exit_code(sweep.directory, 1) == 0 and sweep_manifest.exit_code(sweep.directory, 0) is None
    assert not list(tmp_path.rglob("pwned"))


FAIL_ON_B = ("import os, sys; w = os.environ['NODESCALE_SWEEP_WORD']; print('word', w); "
             "sys.exit(3 if w == 'b' and os.environ.get('NODESCALE_SWEEP_RESUME') != '1' else 0)")


@pytest.mark.multiproc
def test_local_sweep_runs_every_member_and_resubmits_the_failed_one(tmp_path: Path) -> None:
    result = run_cli(["launch", "--scheduler", "local", "--job-dir", "jobs", "--job-name", "words",
                      "--sweep", "word=a,b", "--", sys.executable, "-c", FAIL_ON_B], cwd=tmp_path, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert "2 members run, 1 failed (1:" in last and "--resubmit-failed" in last, result.stdout
    directory = next((tmp_path / "jobs" / "sweeps").iterdir())
    assert directory.name.startswith("words-")
    assert [sweep_manifest.exit_code(directory, i) for i in (0, 1)] == [0, 3]
    assert (directory / "logs" / "0.log").read_text() == "word a\n"

    again = run_cli(["launch", "--resubmit-failed", str(directory)], cwd=tmp_path)
    assert "1 done, 1 failed" in again.stdout and "1 members run, 0 failed" in again.stdout, again.stdout
    assert [sweep_manifest.exit_code(directory, i) for i in (0, 1)] == [0, 0]
    sweep = sweep_manifest.read(directory)
    assert [(s.members, s.resume) for s in sweep.submissions] == [([0, 1], False), ([1], True)]
    assert "nothing failed (2 done)" in run_cli(["launch", "--resubmit-failed", str(directory)], cwd=tmp_path).stdout


def test_resubmit_failed_keeps_the_software_lines_in_the_order_typed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--resubmit-failed rebuilds the job by parsing the argv sweep.json recorded: `module use` stays before the
    `module load` it serves, and the --container-setup line stays in the container."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "qsub").write_text("#!/bin/sh\necho 4242[].pbsserver\n")  # no PBS server here
    (tmp_path / "bin" / "qsub").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{search_path()}")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    code, _, err = launch("--scheduler", "pbs", "--gpus-per-node", "0", "--job-dir", "jobs", "--sweep", "a=1,2",
                          "--module", "first", "--setup", "module use /appl/local/containers/ai-modules", "--module",
                          "singularity-userfilesystems", "--container", "/i.sif", "--container-setup",
                          "$WITH_CONDA && source venv/bin/activate", "--", "true")
    assert code == 0, err
    directory = next((tmp_path / "jobs" / "sweeps").iterdir())
    code, out, err = launch("--resubmit-failed", str(directory), "--dry-run")
    assert code == 0 and "2 failed; submitting the failed members again" in out, err  # neither ran: no summary
    lines = [line.strip() for line in out.split("\n")]
    assert [line for line in lines if line.startswith("module ")] == [
        "module load first", "module use /appl/local/containers/ai-modules", "module load singularity-userfilesystems"]
    assert lines[lines.index("bash -c '") + 1:][:2] == ["set -e", "$WITH_CONDA && source venv/bin/activate"], out
