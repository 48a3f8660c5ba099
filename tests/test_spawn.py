"""``nodescale.spawn``: a notebook executed in a real Jupyter kernel, plain scripts, and the refusals.

Real forked processes on gloo throughout. The notebook (tests/notebooks/spawn.ipynb) and the
script each run several spawns in one interpreter, so torch is imported twice, not per case.
"""

from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import REPO, cli_env
from nodescale.errors import UserError
from nodescale.spawning import spawn

NOTEBOOK = REPO / "tests" / "notebooks" / "spawn.ipynb"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _kernelspec(root: Path) -> str:
    """A kernelspec for this interpreter under ``root`` (a JUPYTER_PATH entry), whatever ``python3`` means here."""
    name = "nodescale-test"
    spec = root / "kernels" / name
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"nodescale test ({sys.executable})", "language": "python",
    }))
    return name


def _text(cell: dict) -> str:
    """Everything a cell showed: streams, results and the error with its traceback, without colours."""
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
        parts.extend(output.get("traceback", []))
        parts.append(output.get("evalue", ""))
    return ANSI.sub("", "\n".join(parts))


@pytest.mark.multiproc
def test_notebook_trains_with_ddp_and_shows_a_failing_ranks_traceback(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    for name, value in cli_env().items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    kernel = _kernelspec(tmp_path / "jupyter")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # allow_errors: the failing cell must show its error, and the cell after it must still run.
    client = NotebookClient(notebook, timeout=120, kernel_name=kernel, allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    setup, trained, failed, after = (_text(cell) for cell in code)
    errors = [output for cell in code for output in cell.outputs if output.output_type == "error"]

    assert "Error" not in setup, setup
    assert "RESULT {'losses'" in trained and "Error" not in trained, trained
    assert "hello from rank 0 of 2" in trained  # a child's print reaches the cell
    # Only the failing cell raised, with rank 1's own traceback: the user's frame and message.
    assert [error.ename for error in errors] == ["SpawnError"], errors
    assert "rank 1 of 2 raised ValueError: boom on rank 1" in failed, failed
    assert "in fails_on_rank_1" in failed and 'raise ValueError("boom on rank 1")' in failed, failed
    assert "AFTER FAILURE (1, 'torchrun')" in after, after


SCRIPT = textwrap.dedent("""
    import json, multiprocessing, os, signal, sys, threading, time
    import nodescale, torch
    from nodescale.spawning import SpawnError

    def report(**fields):
        print("CASE " + json.dumps(fields), flush=True)

    def total(ctx, base):  # defined in __main__: forked children can run it
        return {"sum": ctx.sum(base + ctx.rank), "rank": ctx.rank, "world": ctx.world_size,
                "source": ctx.env.source, "port": os.environ["MASTER_PORT"]}

    def dies(ctx, how):
        ctx.barrier()
        if ctx.rank == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        ctx.barrier()  # rank 0 would wait here forever

    def sleeps_on_rank_0(ctx):
        if ctx.rank == 1:
            raise ValueError("rank 1 gives up")
        time.sleep(600)  # not in a collective: nothing but spawn can end it

    before = dict(os.environ)
    report(case="two", value=nodescale.spawn(total, 10, nproc=2))
    report(case="one", value=nodescale.spawn(total, 10, nproc=1, seed=1))
    report(case="environ", same=dict(os.environ) == before)
    tensors = nodescale.spawn(lambda ctx: {"w": torch.ones(2) * ctx.world_size}, nproc=2)
    report(case="tensor", value=tensors["w"].tolist())
    for how in ("kill", "exit"):
        try:
            nodescale.spawn(dies, how, nproc=2)
        except SpawnError as error:
            report(case=how, message=str(error), rank=error.rank, exitcode=error.exitcode)
    started = time.monotonic()
    try:
        nodescale.spawn(sleeps_on_rank_0, nproc=2)
    except SpawnError as error:
        report(case="stopped", rank=error.rank, seconds=time.monotonic() - started,
               left=[child.pid for child in multiprocessing.active_children()])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel: Ctrl-C raises
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        nodescale.spawn(sleeps_on_rank_0, nproc=1)
    except KeyboardInterrupt:
        report(case="interrupted", left=[child.pid for child in multiprocessing.active_children()])
""")


@pytest.mark.multiproc
def test_script_spawns_main_functions_and_names_a_killed_rank(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    run = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=cli_env(), capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    cases = {case.pop("case"): case for case in (json.loads(line[5:]) for line in run.stdout.splitlines()
                                                 if line.startswith("CASE "))}
    two, one = cases["two"]["value"], cases["one"]["value"]
    assert (two["sum"], two["rank"], two["world"], two["source"]) == (21.0, 0, 2, "torchrun"), two
    assert (one["sum"], one["rank"], one["world"]) == (10.0, 0, 1), one
    assert cases["environ"]["same"], "spawn changed the caller's os.environ"
    assert cases["tensor"]["value"] == [2.0, 2.0]  # a tensor comes back whole, after its process exited
    assert cases["kill"]["rank"] == 1 and cases["kill"]["exitcode"] == -9
    assert "rank 1 exited with -9 (SIGKILL) before its function returned" in cases["kill"]["message"]
    assert cases["exit"]["rank"] == 1 and "rank 1 exited with 3" in cases["exit"]["message"]
    # The rank still running when another failed was ended, within the grace period.
    stopped = cases["stopped"]
    assert stopped["rank"] == 1 and stopped["left"] == [] and stopped["seconds"] < 20, stopped
    assert cases["interrupted"]["left"] == []  # Ctrl-C (a kernel's Interrupt) ends every rank


def test_refuses_what_a_forked_child_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError, match="nproc=0: must be a whole number"):
        spawn(print, nproc=0)
    with pytest.raises(UserError, match=r"init\(sede=\.\.\.\): is not an option of init\n  hint: did you mean 'seed'"):
        spawn(print, nproc=1, sede=0)  # refused by init in the child, raised here as it is
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(UserError, match="a process group is already up in this process"):
            spawn(print, nproc=1)
    finally:
        dist.destroy_process_group()
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(UserError, match="needs the fork start method"):
        spawn(print, nproc=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_in_the_caller_is_refused_and_children_use_the_gpus(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import torch, nodescale
        from nodescale.errors import UserError
        nproc = min(2, torch.cuda.device_count())
        print("DEVICES", nodescale.spawn(lambda ctx: [str(ctx.device), ctx.sum(1)], nproc=nproc))
        torch.zeros(1, device="cuda")
        try:
            nodescale.spawn(lambda ctx: 0, nproc=1)
        except UserError as error:
            print("REFUSED", error)
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=cli_env(), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "DEVICES ['cuda:0', " in run.stdout, run.stdout
    assert "REFUSED CUDA is already initialised in this process" in run.stdout, run.stdout
