"""``nodescale plan --calibrate``: fitted to one world size of ``bench scaling``, how well it predicts the others.

For each model: ``nodescale bench comm`` measures gloo's all-reduce bus bandwidth on this machine
(``--comm`` for every plan), ``nodescale bench scaling`` trains at world sizes 1, 2 and 4 with the
same batch per process (weak scaling: each rank's compute is the same, communication grows), one
thread per process; then, for every world size C as the calibration run and every world size T,
``nodescale plan --calibrate ws-C --gpus-per-node T --strategy ddp --json`` predicts T's step time,
compared with T's measured ``step_seconds``. The target is within 30% of the measured step.

    python benchmarks/plan_calibration.py                       # cnn and resnet18, world sizes 1,2,4 (~10 min)
    python benchmarks/plan_calibration.py --models vit_tiny --world-sizes 1,2

This machine has few cores: world sizes above its core count are oversubscribed (the ranks share
cores), which the plan does not model; those rows are marked and left out of the verdict. The
peak is nominal (``--peak-tflops``: one AVX2 core, 2 FMA x 8 fp32 lanes x ~3 GHz ~ 0.1 TFLOP/s),
so the fitted efficiency is relative to it; the prediction does not depend on it. Results go to
``benchmarks/results/plan_calibration.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import HERE, child_env, machine, run_logged, wide_console, write_results
from rich.table import Table

DEFAULT_OUT = HERE / "results" / "plan_calibration.json"
TARGET = 0.30
DATA = ["--dataset", "synthetic", "--set", "data.image_size=32", "--set", "data.samples=4096"]


def nodescale(*args: str) -> list[str]:
    return [sys.executable, "-m", "nodescale", *args]


def measure_comm(work: Path) -> Path:
    """gloo's all-reduce bus bandwidth between 2 local ranks, as ``bench comm`` writes it."""
    out = work / "comm"
    run_logged(nodescale("bench", "comm", "--nproc", "2", "--backend", "gloo", "--ops", "all_reduce",
                         "--sizes", "1M:64M", "--iters", "10", "--no-plot", "--out", str(out)),
               child_env(1), work / "comm.log").check()
    return out / "results.json"


def measure_scaling(model: str, args: argparse.Namespace, work: Path) -> Path:
    out = work / f"scaling-{model}"
    run_logged(nodescale("bench", "scaling", "--out", str(out), "--world-sizes", args.world_sizes, "--mode", "weak",
                         "--batch-size", str(args.batch_size), "--max-steps", str(args.max_steps),
                         "--warmup-steps", str(args.warmup_steps), "--model", model, *DATA[:2], "--", *DATA[2:]),
               child_env(1), work / f"scaling-{model}.log").check()
    return out


def predict(model: str, calibration_run: Path, world_size: int, comm: Path, args: argparse.Namespace,
            work: Path) -> dict[str, Any]:
    """The plan's DDP row on one node of ``world_size`` ranks, calibrated on ``calibration_run``."""
    argv = nodescale("plan", "--model", model, *DATA, "--batch-size", str(args.batch_size), "--strategy", "ddp",
                     "--nodes", "1", "--gpus-per-node", str(world_size), "--gpu-memory", "100",
                     "--peak-tflops", str(args.peak_tflops), "--comm", str(comm), "--max-steps", "100",
                     "--calibrate", str(calibration_run), "--json")
    done = subprocess.run(argv, env=child_env(1), capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"nodescale plan failed ({done.returncode}): {done.stderr}")
    plan = json.loads(done.stdout)
    row = next(row for row in plan["rows"] if row["strategy"] == "ddp")
    return {"step": row["step"], "efficiency": plan["calibration"]["efficiency"]}


def one_model(model: str, comm: Path, args: argparse.Namespace, work: Path, cores: int) -> list[dict[str, Any]]:
    out = work / f"scaling-{model}"
    if not (out / "scaling.json").is_file():  # a --work folder keeps the runs: predictions are redone alone
        measure_scaling(model, args, work)
    scaling = json.loads((out / "scaling.json").read_text())
    measured = {row["world_size"]: row["step_ms"] / 1e3 for row in scaling["rows"]}
    rows = []
    for source in measured:
        for target, step in measured.items():
            guess = predict(model, out / f"ws-{source}", target, comm, args, work)
            error = guess["step"]["total_s"] / step - 1
            rows.append({"model": model, "calibrated_on": source, "world_size": target, "measured_step_s": step,
                         "predicted_step_s": guess["step"]["total_s"], "predicted_comm_s": guess["step"]["comm_s"],
                         "efficiency": guess["efficiency"], "error": error,
                         "oversubscribed": max(source, target) > cores})
    return rows


def results_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="step time: plan calibrated on one world size / measured (weak scaling, DDP, gloo, 1 thread "
                  "per rank)", title_justify="left")
    for header in ("model", "calibrated on", "world size", "measured ms", "predicted ms", "of which comm", "error",
                   "within 30%"):
        table.add_column(header, justify="left" if header == "model" else "right")
    for row in rows:
        verdict = "(oversubscribed)" if row["oversubscribed"] else ("yes" if abs(row["error"]) <= TARGET else "NO")
        table.add_row(row["model"], str(row["calibrated_on"]), str(row["world_size"]),
                      f"{row['measured_step_s'] * 1e3:.1f}", f"{row['predicted_step_s'] * 1e3:.1f}",
                      f"{(row['predicted_comm_s'] or 0) * 1e3:.1f}", f"{row['error']:+.0%}", verdict)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn,resnet18")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=0.1, help="nominal peak of one core")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    console = wide_console(130)
    cores = len(os.sched_getaffinity(0))
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nodescale-plan-calibration-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        comm = work / "comm" / "results.json"
        if not comm.is_file():
            comm = measure_comm(work)
        bandwidth = json.loads(comm.read_text())
        for model in filter(None, args.models.split(",")):
            rows += one_model(model, comm, args, work, cores)
            console.print(f"{model}: done at {time.perf_counter() - started:.0f} s")
    console.print(results_table(rows))
    judged = [row for row in rows if not row["oversubscribed"]]
    write_results(args.out, machine(), {
        "settings": {**vars(args), "out": str(args.out), "work": None, "cores": cores, "target": TARGET, "mode": "weak",
                     "strategy": "ddp", "backend": "gloo", "omp_num_threads": 1},
        "all_reduce_busbw_GBps": {row["bytes"]: row["busbw_GBps"] for row in bandwidth if row["op"] == "all_reduce"},
        "results": rows, "within_target": all(abs(row["error"]) <= TARGET for row in judged),
        "total_seconds": time.perf_counter() - started}, console)
    return 0 if all(abs(row["error"]) <= TARGET for row in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
