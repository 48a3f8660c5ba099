"""nodescale's own local launcher: torchrun's environment without torch, and how a group ends.

Real processes throughout: workers are small Python scripts, the launcher runs in a
subprocess where its signals or its death are under test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import cli_env, read_summary
from nodescale.distributed import ports
from nodescale.distributed.accelerators import gpu_driver_present
from nodescale.launch.schedulers.local_worker_group import run_worker_group

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_USE_AGENT_STORE")


def _script(tmp_path: Path, name: str, body: str) -> list[str]:
    """``python -m NAME`` for a module in ``tmp_path`` (the current directory): the form the fork server runs."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return [sys.executable, "-m", name]


@pytest.fixture(params=["exec", "fork"])
def preload(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """Each worker started fresh, or forked from a fork server that imported ``preloaded`` (which notes its pid)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "preloaded.py").write_text("import os\nPID = os.getpid()\n")
    return ("preloaded",) if request.param == "fork" else ()


def _wait_for(path: Path, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(list(path.parent.glob(path.name))) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path} ({count}) did not appear within {timeout} s")


def _trained_two_ranks(out: Path) -> bool:
    summary = read_summary(out)
    return summary["world_size"] == 2 and summary["global_steps"] == 3


def _benchmarked_two_ranks(out: Path) -> bool:
    rows = json.loads((out / "results.json").read_text())
    return [(row["world_size"], row["correct"]) for row in rows] == [(2, True), (2, True)]  # out- and in-place


LAUNCHED = {  # a whole run under each launching subcommand; the check of what it wrote
    "train": (["train", "--strategy", "ddp", "--max-steps", "3", "--epochs", "1", "--set", "checkpoint.at_end=false"],
              _trained_two_ranks),
    "bench comm": (["bench", "comm", "--sizes", "4K", "--ops", "all_reduce", "--iters", "2", "--no-plot"],
                   _benchmarked_two_ranks),
}


@pytest.mark.parametrize("subcommand", list(LAUNCHED))
def test_the_launcher_never_imports_torch(subcommand: str, tmp_path: Path) -> None:
    """A run with --nproc 2 from start to end, the launcher process without torch (only the workers load it)."""
    out = tmp_path / "run"
    argv, wrote_it = LAUNCHED[subcommand]
    code = textwrap.dedent(f"""
        import sys
        from nodescale.cli.main import main
        code = main({[*argv, "--nproc", "2", "--out", str(out)]!r})
        print("LAUNCHER", code, "torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=240)
    assert "LAUNCHER 0 False" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert wrote_it(out)


def test_workers_see_torchruns_variables_and_run_in_their_own_sessions(tmp_path: Path,
                                                                        preload: tuple[str, ...]) -> None:
    command = _script(tmp_path, "env", f"""
        import json, os, sys
        names = {TORCHRUN_VARIABLES!r}
        record = {{name: os.environ.get(name) for name in names}}
        record["own_session"] = os.getsid(0) == os.getpid()
        record["extra"] = os.environ.get("EXTRA_FOR_TEST")
        record["pid"] = os.getpid()
        record["preloaded_in"] = getattr(sys.modules.get("preloaded"), "PID", None)
        record["argv"] = sys.argv[1:]
        record["name"] = open("/proc/self/comm").read().strip()
        with open(os.path.join({str(tmp_path)!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
            json.dump(record, f)
    """)
    result = run_worker_group([*command, "--an-argument"], 3, {"EXTRA_FOR_TEST": "yes"}, preload=preload)
    assert result.codes == {0: 0, 1: 0, 2: 0} and result.stopped_by is None and not result.failures
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    for rank, record in enumerate(records):
        assert record["RANK"] == record["LOCAL_RANK"] == record["ROLE_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == record["ROLE_WORLD_SIZE"] == "3"
        assert (record["GROUP_RANK"], record["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert record["MASTER_ADDR"] == "127.0.0.1"
        assert record["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert record["own_session"] and record["extra"] == "yes" and record["argv"] == ["--an-argument"]
    # Forked: all ranks share one import of the preloaded module, made in another process.
    preloaded_in = {r["preloaded_in"] for r in records}
    assert preloaded_in == ({None} if not preload else preloaded_in - {r["pid"] for r in records} - {None})
    assert len(preloaded_in) == 1
    assert [r["name"] == f"nodescale-r{rank}" for rank, r in enumerate(records)] == [bool(preload)] * 3
    assert len({r["MASTER_PORT"] for r in records}) == 1 and len({r["TORCHELASTIC_RUN_ID"] for r in records}) == 1
    low, _ = ports.ephemeral_range()
    assert ports.LOWEST_PORT <= int(records[0]["MASTER_PORT"]) < low


def test_a_failed_worker_stops_the_others_with_sigterm(tmp_path: Path, preload: tuple[str, ...]) -> None:
    command = _script(tmp_path, "fail", f"""
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            time.sleep(0.5)
            sys.exit(3)
        def stopped(signum, frame):
            open(os.path.join({str(tmp_path)!r}, "stopped" + os.environ["RANK"]), "w").close()
            sys.exit(143)
        signal.signal(signal.SIGTERM, stopped)
        time.sleep(120)
    """)
    began = time.monotonic()
    result = run_worker_group(command, 3, preload=preload)
    assert time.monotonic() - began < 30
    assert result.codes == {0: 3, 1: 143, 2: 143}
    assert (tmp_path / "stopped1").exists() and (tmp_path / "stopped2").exists()


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path,
                                                                         preload: tuple[str, ...]) -> None:
    command = _script(tmp_path, "stubborn", """
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            time.sleep(0.5)
            sys.exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
    """)
    began = time.monotonic()
    result = run_worker_group(command, 2, grace_seconds=1.0, preload=preload)
    assert 1.0 <= time.monotonic() - began < 20
    assert result.codes == {0: 1, 1: -signal.SIGKILL}


RANK_ENDINGS = {  # the last statement of a rank's module: the exit code ``python -m`` gives it
    "falls off the end": ("pass", 0),
    "sys.exit(7)": ("sys.exit(7)", 7),
    "sys.exit(message)": ("sys.exit('a message')", 1),
    "an exception": ("raise ValueError('boom')", 1),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", -signal.SIGINT),
}


@pytest.mark.parametrize("ending", list(RANK_ENDINGS))
def test_a_worker_ends_as_python_would(ending: str, tmp_path: Path, preload: tuple[str, ...],
                                       capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit code, unflushed output, atexit and a traceback: the same whether the rank was forked or not."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    statement, code = RANK_ENDINGS[ending]
    command = _script(tmp_path, "ends", f"""
        import atexit, os, sys
        atexit.register(lambda: open("atexit-" + os.environ["RANK"], "w").close())
        sys.stdout.write("unflushed output")  # a file, so block-buffered: lost without python's own exit
        {statement}
    """)
    result = run_worker_group(command, 1, preload=preload)
    out, err = capfd.readouterr()
    assert result.codes == {0: code}, err
    assert (tmp_path / "atexit-0").exists() and "unflushed output" in out
    assert ("ValueError: boom" in err) == (ending == "an exception")
    assert ("a message" in err) == (ending == "sys.exit(message)")


def test_ranks_forked_after_nodescales_imports_can_use_several_threads(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """GNU OpenMP hangs in a forked child whose parent ran a parallel region: the preloaded imports must run none."""
    monkeypatch.chdir(tmp_path)
    launcher = _launcher(tmp_path, """
        import torch
        torch.set_num_threads(2)
        assert float((torch.ones(8_000_000) * 2).sum()) == 16e6  # large enough to run in parallel
    """, ("nodescale.train.run", "torch._dynamo", "deepspeed", "transformers"))
    try:
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, stderr[-3000:]


def _launcher(tmp_path: Path, worker_body: str, preload: tuple[str, ...], nproc: int = 2) -> subprocess.Popen[str]:
    worker = _script(tmp_path, "worker", worker_body)
    code = ("import sys; from nodescale.launch.schedulers.local_launcher import launch_local; "
            f"sys.exit(launch_local({worker!r}, {nproc}, preload={preload!r}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


WAITING_WORKER = """
    import os, signal, sys, time
    here = {here!r}
    def note(signum, frame):
        open(os.path.join(here, f"got-{{signal.Signals(signum).name}}-{{os.environ['RANK']}}"), "w").close()
        if signum == signal.SIGTERM:
            sys.exit(0)
    signal.signal(signal.SIGTERM, note)
    signal.signal(signal.SIGUSR1, note)
    open(os.path.join(here, f"pid-{{os.getpid()}}"), "w").close()
    time.sleep(120)
"""


def test_signals_to_the_launcher_reach_every_worker(tmp_path: Path, preload: tuple[str, ...]) -> None:
    launcher = _launcher(tmp_path, WAITING_WORKER.format(here=str(tmp_path)), preload)
    try:
        _wait_for(tmp_path / "pid-*", count=2)
        launcher.send_signal(signal.SIGUSR1)  # a scheduler's warning: passed on as it is
        _wait_for(tmp_path / "got-SIGUSR1-*", count=2)
        launcher.send_signal(signal.SIGTERM)  # a stop: the workers are told, and the launcher reports it
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in stderr
    assert len(list(tmp_path.glob("got-SIGTERM-*"))) == 2


def test_workers_do_not_outlive_a_killed_launcher(tmp_path: Path, preload: tuple[str, ...]) -> None:
    launcher = _launcher(tmp_path, WAITING_WORKER.format(here=str(tmp_path)), preload)
    _wait_for(tmp_path / "pid-*", count=2)
    pids = [int(path.name.split("-")[1]) for path in tmp_path.glob("pid-*")]
    launcher.kill()  # SIGKILL: the launcher can pass nothing on
    launcher.wait(timeout=30)
    _wait_for(tmp_path / "got-SIGTERM-*", count=2)  # the kernel's parent-death signal
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers; its state says it has exited.
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path: Path) -> None:
    low, _ = ports.ephemeral_range()
    port = ports.free_port("127.0.0.1")
    assert ports.LOWEST_PORT <= port < low
    range_file = tmp_path / "range"
    range_file.write_text("30000\t60999\n")
    assert ports.ephemeral_range(range_file) == (30000, 60999)
    range_file.write_text("garbage")
    assert ports.ephemeral_range(range_file) == (32768, 60999)


def test_free_port_falls_back_to_the_kernel_when_nothing_below_the_range_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    low, high = ports.ephemeral_range()
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST_PORT, 60999))  # no candidate left
    assert low <= ports.free_port("127.0.0.1") <= high  # the kernel's pick comes from its own range


def test_gpu_driver_detection_reads_the_driver_paths(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the driver paths are Linux's")
    missing = (tmp_path / "proc-driver-nvidia", tmp_path / "dev-kfd")
    assert gpu_driver_present(missing) is False
    missing[1].touch()
    assert gpu_driver_present(missing) is True


def test_the_failure_named_is_the_first_one_not_its_consequences() -> None:
    from nodescale.launch.schedulers.local_launcher import describe_failure

    # Rank 1 killed by the OOM killer; rank 0 lost its peer and exited 1 a moment later.
    assert describe_failure({0: 1, 1: -9}) == "rank 1 exited with -9 (SIGKILL)"
    # A deliberate exit code (4: the watchdog's hang report) is kept beside the crash.
    assert describe_failure({0: 4, 1: -9}) == "rank 0 exited with 4, rank 1 exited with -9 (SIGKILL)"
    # Rank 0 failed by itself; rank 1 ignored the launcher's SIGTERM and got its SIGKILL.
    assert describe_failure({0: 1, 1: -9}, stopped={1}) == "rank 0 exited with 1"
    # Two ranks failed by themselves: both named; the stopped ones only when nothing else failed.
    assert describe_failure({0: 1, 1: 1, 2: -15}, stopped={2}) == "ranks 0 and 1 exited with 1"
    assert describe_failure({0: -15, 1: -15}, stopped={0, 1}) == "ranks 0 and 1 exited with -15 (SIGTERM)"
    assert describe_failure({0: 1, 1: 4, 2: 1, 3: 1}) == "ranks 0, 2 and 3 exited with 1, rank 1 exited with 4"


def test_a_rank_already_failing_when_the_others_are_stopped_is_named(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 fails by itself, but is still on its way out when rank 0's exit is seen: the launcher's SIGTERM
    finds it running, yet it exits with its own code, so it failed of its own accord, not by the stop."""
    from nodescale.launch.schedulers.local_launcher import launch_local

    monkeypatch.chdir(tmp_path)
    command = _script(tmp_path, "both_fail", """
        import os, pathlib, signal, sys, time
        if os.environ["RANK"] == "1":
            # Its way out must not be cut short (a last line to write, a file to close): a SIGTERM waits for
            # it. Here the way out lasts until the launcher has sent one, whatever the machine's speed.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            pathlib.Path("rank1-failing").touch()
            signal.sigwait({signal.SIGTERM})
            sys.exit(1)
        while not pathlib.Path("rank1-failing").exists():
            time.sleep(0.01)
        sys.exit(1)
    """)
    assert launch_local(command, 2) == 1
    assert "nodescale: worker processes failed: ranks 0 and 1 exited with 1" in capfd.readouterr().err.splitlines()


def test_every_worker_that_ended_is_reported_with_the_failure() -> None:
    """Workers found ended at the same poll: all their codes come back, so the first failure can be told."""
    from nodescale.launch.schedulers.local_worker_group import _wait_for_all_or_a_failure

    workers = {
        0: subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"]),
        1: subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
        2: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
    }
    try:
        workers[0].wait(timeout=30)
        workers[1].wait(timeout=30)
        assert _wait_for_all_or_a_failure(workers) == {0: 1, 1: -signal.SIGKILL}
    finally:
        workers[2].kill()
        workers[2].wait()


def test_a_missing_program_is_a_user_error(tmp_path: Path) -> None:
    """``launch --scheduler local -- no-such-program``: exit 2 with the rule and a hint, no traceback, nothing left."""
    result = subprocess.run([sys.executable, "-m", "nodescale", "launch", "--scheduler", "local", "--nproc-per-node",
                             "2", "--", "no-such-program-here"], cwd=tmp_path, env=cli_env(), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "'no-such-program-here': is not a program on PATH" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_user_error_on_one_rank_is_not_restarted_when_the_others_lost_their_peer(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 stops on a user error (a full disk, say) and rank 1 exits 1 having lost it: exit 2, no restart."""
    from nodescale.launch.schedulers.local_launcher import launch_local

    monkeypatch.chdir(tmp_path)
    command = _script(tmp_path, "user_error", """
        import os, sys, time
        from nodescale.launch.schedulers.local_launcher import hand_over_user_error
        open("started-" + os.environ["RANK"] + "-" + os.environ.get("NODESCALE_RESTART_COUNT", "0"), "w").close()
        if os.environ["RANK"] == "0":
            hand_over_user_error("checkpoint step 30: no space left on device")
            time.sleep(1)  # still leaving when the launcher stops it: it ends by SIGTERM, not with 2
            sys.exit(2)
        while not os.listdir(os.environ["NODESCALE_ERROR_DIR"]):
            time.sleep(0.01)
        sys.exit(1)  # "lost its connection to another rank", before rank 0 has exited
    """)
    assert launch_local(command, 2, max_restarts=2) == 2
    assert sorted(path.name for path in tmp_path.glob("started-*")) == ["started-0-0", "started-1-0"]
    assert "nodescale: error (rank 0): checkpoint step 30: no space left on device" in capfd.readouterr().err


def test_hundreds_of_ranks_fork_from_one_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """300 ranks' torchrun variables (~180 KB) exceed what one command-line argument may hold (128 KiB)."""
    monkeypatch.chdir(tmp_path)
    command = _script(tmp_path, "quick", "import os\nassert os.environ['WORLD_SIZE'] == '300'\n")
    result = run_worker_group(command, 300, preload=("json",))
    assert result.codes == dict.fromkeys(range(300), 0)
