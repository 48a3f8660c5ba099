"""nodescale launch without a scheduler: dry runs, local runs and refusals."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, read_summary, run_cli
from nodescale.launch.schedulers.batch import new_script_file


def test_two_launches_in_one_second_get_their_own_script(tmp_path: Path) -> None:
    first = new_script_file(tmp_path, "job-20260101-000000", "echo first\n")
    second = new_script_file(tmp_path, "job-20260101-000000", "echo second\n")
    assert first != second
    assert first.read_text() == "echo first\n" and second.read_text() == "echo second\n"


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path: Path) -> None:
    result = run_cli(["launch", "--cluster", "puhti", "--nodes", "2", "--account", "project_2001234",
                      "--job-dir", "jobs", "--dry-run", "--", "nodescale", "train", "--model", "resnet50"],
                     cwd=tmp_path)
    submit, _, script = result.stdout.partition("\n")
    assert submit.startswith("# sbatch --parsable ") and str(tmp_path / "jobs") in submit
    assert "#SBATCH --gres=gpu:v100:4" in script and "#SBATCH --account=project_2001234" in script
    assert "nodescale-node nodescale train --model resnet50" in script
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("argv, expected", [
    (["--cluster", "puhti", "--nodes", "2", "--", "true"], "without --account"),
    (["--cluster", "derecho", "--account", "A", "--gpus-per-node", "8", "--", "true"], "derecho nodes have 4 GPUs"),
    (["--cluster", "derecho", "--account", "A", "--env", "NCCL_DISABLE_IB=1", "--", "true"], "NCCL_IB_DISABLE"),
    (["--cluster", "derecho", "--account", "A", "--env", "NCCL_NET_GDR_LEVEL=PBH", "--", "true"], "PBH"),
    (["--cluster", "derecho", "--scheduler", "slurm", "--account", "A", "--", "true"], "pbs"),
    (["--cluster", "lumi", "--account", "A", "--nproc-per-node", "16", "--", "true"], "16"),
    (["--cluster", "hipergaitor", "--", "true"], "did you mean 'hipergator'"),
    (["--nodes", "2", "--", "true"], "a local run has one node"),
    (["--nodes", "0", "--", "true"], "at least 1"),
    (["--time", "1h", "--", "true"], "HH:MM:SS"),
    (["--cluster", "puhti", "--account", "p", "--time", "10:75:00", "--", "true"], "below 60"),
    (["--scheduler", "local", "--cluster", "puhti", "--", "true"], "drop --cluster"),
    (["--cluster", "generic-slurm", "--mode", "spawn", "--nproc-per-node", "4", "--", "nodescale", "train"],
     "would run 1 process"),
    (["--env", "NCCL_DISABLE_IB=1", "--", "true"], "NCCL_IB_DISABLE"),
    (["--mode", "mpi", "--", "true"], "torchrun"),
    (["--env", "1BAD=x", "--", "true"], "KEY=VALUE"),
    ([], "needs the program to run"),
])
def test_bad_launches_exit_2_before_anything_runs(argv: list[str], expected: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # In this process (`python -m nodescale` is sys.exit(main())): a subprocess each cost ~1-10 s of imports.
    # An exception other than the UserError that main turns into exit 2 fails the test here, as a traceback would.
    from nodescale.cli.main import main

    def exec_instead_of_refusing(program: str, *_: object) -> None:  # a local launch execs its command
        raise AssertionError(f"launched {program} instead of refusing")

    monkeypatch.setattr(os, "execvpe", exec_instead_of_refusing)
    monkeypatch.chdir(tmp_path)
    code = main(["launch", "--job-dir", "jobs", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and "hint:" in err
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_missing_program_exits_2(nproc: str, tmp_path: Path) -> None:
    # Found missing when `nodescale launch` execs it (1) or the launcher it execs (2): only a command can tell.
    result = run_cli(["launch", "--job-dir", "jobs", "--gpus-per-node", "0", "--nproc-per-node", nproc, "--",
                      "no-such-program-here"], cwd=tmp_path, check=False)
    assert result.returncode == 2, result.stderr
    assert "not a program on PATH" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "jobs").exists()


@pytest.mark.multiproc
def test_local_launch_runs_any_command_on_n_processes(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text("import json, os\nprint(json.dumps({k: os.environ[k] for k in "
                      "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_PORT')}))\n")
    result = run_cli(["launch", "--nproc-per-node", "2", "--env", "NODESCALE_TEST=1", "--", "python", str(script)],
                     cwd=tmp_path)
    lines = result.stdout.splitlines()  # rank 0's as it printed them, the others' labelled
    seen = [json.loads(line.removeprefix("[rank1]: ")) for line in lines if "{" in line]
    assert sorted(int(s["RANK"]) for s in seen) == [0, 1]
    assert [line[:9] for line in lines if "{" in line and '"RANK": "1"' in line] == ["[rank1]: "]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"}
    run_cli(["launch", "--nproc-per-node", "2", "--", "nodescale", "train", "--max-steps", "3", "--no-progress",
             "--out", "run"], cwd=tmp_path)
    assert read_summary(tmp_path / "run")["world_size"] == 2


# A user's plain DDP script, as torchrun runs it: env:// rendezvous, its device from LOCAL_RANK.
ENV_RENDEZVOUS = """import json, os
import torch, torch.distributed as dist
dist.init_process_group(backend="gloo")
total = torch.tensor([int(os.environ["LOCAL_RANK"]) + 1.0])
dist.all_reduce(total)
print(json.dumps({"sum": total.item(), "world": dist.get_world_size(),
                  **{name: os.environ[name] for name in ("RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                                                         "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}}))
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_one_local_process_gets_torchruns_variables(tmp_path: Path) -> None:
    """`launch --nproc-per-node 1` runs a script that `torchrun --standalone --nproc-per-node 1` runs (it failed:
    "environment variable RANK expected, but not set"); no agent store is claimed, so its rank 0 serves one."""
    (tmp_path / "ddp.py").write_text(ENV_RENDEZVOUS)
    result = run_cli(["launch", "--nproc-per-node", "1", "--", sys.executable, "ddp.py"], cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert (seen.pop("sum"), seen.pop("world"), seen.pop("MASTER_ADDR")) == (1.0, 1, "127.0.0.1")
    assert len(seen.pop("TORCHELASTIC_RUN_ID")) > 0
    assert seen == {"RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "ROLE_RANK": "0"}


# Rank 1 raises once both joined: torch's excepthook labels the traceback's lines "[rank1]: " itself.
RANK_1_RAISES = """import os, sys
import torch.distributed as dist
dist.init_process_group(backend="gloo")
if os.environ["RANK"] == "1":
    print("[rank0]: a line that names another rank", file=sys.stderr, flush=True)
    raise RuntimeError("rank 1 gave up")
"""


@pytest.mark.multiproc
def test_a_line_torch_labelled_already_gets_no_second_label(tmp_path: Path) -> None:
    """On the terminal and in ranks.log a traceback's line reads "[rank1]: ...", not "[rank1]: [rank1]: ...";
    `nodescale logs` and its failure summary still read that rank's lines."""
    (tmp_path / "raise.py").write_text(RANK_1_RAISES)
    result = run_cli(["launch", "--nproc-per-node", "2", "--job-dir", "jobs", "--", sys.executable, "raise.py"],
                     cwd=tmp_path, check=False)
    assert result.returncode == 1, result.stderr[-2000:]
    log = (tmp_path / "jobs" / "ranks.log").read_text().splitlines()
    for lines in (result.stderr.splitlines(), log):
        assert "[rank1]: RuntimeError: rank 1 gave up" in lines, lines
        assert not any("[rank1]: [rank1]:" in line for line in lines), lines
        assert "[rank1]: [rank0]: a line that names another rank" in lines, lines  # another rank's label stays
    own = run_cli(["logs", "jobs", "--rank", "1"], cwd=tmp_path).stdout.splitlines()
    assert "RuntimeError: rank 1 gave up" in own and "Traceback (most recent call last):" in own, own
    failure = run_cli(["logs", "jobs", "--failure"], cwd=tmp_path).stdout.splitlines()
    assert failure[-1].startswith("nodescale: the job failed: rank 1 on "), failure
    assert "nodescale: | RuntimeError: rank 1 gave up" in failure, failure


# Each process says its own command line, its parent's (the launcher's), its rank and a variable from --env.
WHO_RUNS_ME = """import json, os
def argv(pid): return open(f"/proc/{pid}/cmdline").read().split(chr(0))[:-1]
print(json.dumps({"own": argv("self"), "parent": argv(os.getppid()), "rank": os.environ.get("RANK"),
                  "note": os.environ["NODESCALE_NOTE"]}))
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("nproc", [1, 2])
def test_local_dry_run_prints_the_command_that_runs(nproc: int, tmp_path: Path) -> None:
    """The printed line is the process that runs (the command with torchrun's variables, or the launcher of
    its ranks), with the printed variables; run in a shell, it does the same. One process: a CPU's default."""
    (tmp_path / "who.py").write_text(WHO_RUNS_ME)
    flags = ["--gpus-per-node", "0", *(["--nproc-per-node", "2"] if nproc == 2 else []),
             "--env", "NODESCALE_NOTE=a 'b' c"]
    printed = run_cli(["launch", "--dry-run", *flags, "--", sys.executable, "who.py"], cwd=tmp_path).stdout
    words = shlex.split(printed)
    command = words[words.index(sys.executable):]
    assignments = dict(word.split("=", 1) for word in words[:words.index(sys.executable)])
    assert assignments.pop("NODESCALE_NOTE") == "a 'b' c"
    assert assignments.get("RANK") == ("0" if nproc == 1 else None)
    real = run_cli(["launch", *flags, "--", sys.executable, "who.py"], cwd=tmp_path)
    shell = subprocess.run(["bash", "-c", printed], cwd=tmp_path, env=cli_env(), capture_output=True, text=True,
                           timeout=240, check=True)
    for result in (real, shell):
        seen = [json.loads(line.removeprefix("[rank1]: ")) for line in result.stdout.splitlines() if "{" in line]
        assert sorted(s["rank"] for s in seen) == [str(rank) for rank in range(nproc)], result.stderr
        assert all(s["own" if nproc == 1 else "parent"] == command for s in seen), (command, seen)
        assert {s["note"] for s in seen} == {"a 'b' c"}


def test_fewer_gpus_than_a_node_has_ask_for_their_share_of_cores(tmp_path: Path) -> None:
    result = run_cli(["launch", "--cluster", "puhti", "--account", "p", "--gpus-per-node", "1", "--dry-run", "--",
                      "true"], cwd=tmp_path)
    assert "#SBATCH --cpus-per-task=10" in result.stdout and "#SBATCH --gres=gpu:v100:1" in result.stdout


def test_pbs_job_states_match_the_ids_nodescale_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodescale.launch.schedulers.pbs import Pbs

    qstat = tmp_path / "qstat"
    # qstat -x as PBS Pro prints it, the id shortened to fit its column.
    qstat.write_text("#!/bin/sh\ncat <<'EOF'\nJob id            Name             User              Time Use S Queue\n"
                     "----------------  ---------------- ----------------  -------- - -----\n"
                     "3456789.desched*  resnet50         alice             00:01:02 R main\n"
                     "3456790.desched*  other            alice             00:00:00 F main\nEOF\n")
    qstat.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    states = Pbs().status(["3456789.desched1", "3456790.desched1"])
    assert states == {"3456789.desched1": "RUNNING", "3456790.desched1": "FINISHED"}


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from nodescale.cli.main import main

    code = main(["launch", "--dry-run", *argv, "--", "nodescale", "train"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("scheduler, signal_line, argv", [
    ("slurm", "#SBATCH --signal=B:USR1@300", ["--time", "00:10:00", "--stop-warning", "300"]),
    ("pbs", "( sleep 400 && kill -USR1 $$ )", ["--time", "00:10:00", "--stop-warning", "200"]),
])
def test_stop_warning_sets_when_the_ranks_are_signalled(scheduler: str, signal_line: str, argv: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _dry_run(["--scheduler", scheduler, *argv], capsys)
    assert code == 0 and signal_line in out


@pytest.mark.parametrize("scheduler, requeue_line", [("slurm", "#SBATCH --requeue"), ("pbs", "qrerun")])
def test_no_requeue_leaves_out_the_signal_and_the_requeue(scheduler: str, requeue_line: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _dry_run(["--scheduler", scheduler], capsys)
    assert code == 0 and requeue_line in out and "USR1" in out
    code, out, _ = _dry_run(["--scheduler", scheduler, "--no-requeue"], capsys)
    assert code == 0 and requeue_line not in out and "USR1" not in out


def test_a_job_shorter_than_the_default_warning_is_not_requeued(capsys: pytest.CaptureFixture[str]) -> None:
    # Signalled as soon as it starts, it would checkpoint and requeue forever.
    with pytest.warns(UserWarning, match="no stop signal and no requeue"):
        code, out, _ = _dry_run(["--scheduler", "slurm", "--time", "00:01:00"], capsys)
    assert code == 0 and "--signal" not in out and "#SBATCH --requeue" not in out


@pytest.mark.parametrize("argv, expected", [
    (["--time", "00:05:00", "--stop-warning", "300"], "300 s is not less than 300 s"),
    (["--stop-warning", "2m"], "whole number"),
])
def test_bad_stop_warnings_are_refused(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _dry_run(["--scheduler", "slurm", *argv], capsys)
    assert code == 2 and expected in err and "hint:" in err
