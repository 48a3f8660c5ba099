"""``nodescale bench comm`` against the plainest all_reduce timing loop, at one size (default 64 MB).

One ``torchrun`` job of N processes alternates, ``--repeats`` times, between

* a raw loop: ``dist.all_reduce`` of a float32 tensor ``--warmup`` times, a barrier, then
  ``--iters`` timed calls; the slowest rank's mean time per call (no nodescale code at all), and
* ``nodescale bench comm --ops all_reduce --sizes SIZE`` with the same warm-up and iterations,
  in the same processes and process group (its in-place row: the raw loop is in place too),

and converts both to bus bandwidth with nccl-tests' arithmetic (busbw = bytes / time x 2(n-1)/n,
GB/s = 1e9 bytes/s). The order alternates per repeat. Target: median busbw ratio
bench/raw >= 0.95, i.e. the command's timing adds no more than 5% to what it measures.

    python benchmarks/comm_overhead.py                       # 2 processes, 64 MB, 8 repeats
    python benchmarks/comm_overhead.py --nproc 2 --size 16M --repeats 10

On a GPU machine the same job runs on NCCL (the command picks it); the raw loop then
synchronises the device before reading the clock. Results: ``benchmarks/results/comm_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import HERE, PAIRS, child_env, machine, run_logged, wide_console, write_results  # noqa: E402

DEFAULT_OUT = HERE / "results" / "comm_overhead.json"
TARGET_RATIO = 0.95

# Runs in every rank. The raw loop and the command alternate; rank 0 writes the paired figures.
PAIRED = r"""
import json, sys, time
import torch, torch.distributed as dist
from nodescale.cli.main import main

size, warmup, iters, repeats, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
backend = "nccl" if torch.cuda.is_available() else "gloo"
if backend == "nccl":
    torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
dist.init_process_group(backend)
device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
tensor = torch.ones(size // 4, dtype=torch.float32, device=device)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def raw_loop():
    for _ in range(warmup):
        dist.all_reduce(tensor)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


pairs = []
for repeat in range(repeats):
    flags = ["--ops", "all_reduce", "--sizes", str(size), "--warmup", str(warmup), "--iters", str(iters),
             "--no-plot", "--out", f"{out}/bench-{repeat}"]
    raw_first = repeat % 2 == 0
    raw = raw_loop() if raw_first else None
    code = main(["bench", "comm", *flags])
    if code:
        sys.exit(code)
    if not raw_first:
        raw = raw_loop()
    if dist.get_rank() == 0:
        rows = json.load(open(f"{out}/bench-{repeat}/results.json"))
        row = next(r for r in rows if r["in_place"])
        pairs.append({"repeat": repeat, "raw_first": raw_first, "raw_seconds": raw,
                      "bench_seconds": row["time_us"] * 1e-6, "bench_busbw_GBps": row["busbw_GBps"],
                      "bytes": row["bytes"], "correct": row["correct"], "world_size": row["world_size"],
                      "backend": row["backend"]})
if dist.get_rank() == 0:
    json.dump(pairs, open(f"{out}/pairs.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def parse_size(text: str) -> int:
    from nodescale.bench.comm_math import parse_sizes

    sizes = parse_sizes(text)
    if len(sizes) != 1:
        raise SystemExit(f"--size {text}: one size, e.g. 64M")
    return sizes[0]


def busbw(size: int, seconds: float, world: int) -> float:
    """nccl-tests' all_reduce bus bandwidth in GB/s (1e9 bytes/s)."""
    return size / seconds / 1e9 * 2 * (world - 1) / world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--size", default="64M", help="message size (default 64M = 64 MiB)")
    parser.add_argument("--repeats", type=int, default=PAIRS, help=f"alternating raw/bench pairs (default {PAIRS})")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up calls per measurement (default 5)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per measurement (default 20)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process (default 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    console = wide_console(160)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nodescale-comm-overhead-") as tmp:
        script = Path(tmp) / "paired.py"
        script.write_text(PAIRED)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(script), str(size), str(args.warmup), str(args.iters), str(args.repeats), tmp]
        run_logged(cmd, child_env(args.threads), Path(tmp) / "paired.log").check()
        pairs: list[dict[str, Any]] = json.loads((Path(tmp) / "pairs.json").read_text())
    world = pairs[0]["world_size"]
    for pair in pairs:
        pair["raw_busbw_GBps"] = busbw(pair["bytes"], pair["raw_seconds"], world)
        pair["ratio"] = pair["bench_busbw_GBps"] / pair["raw_busbw_GBps"]
    ratio = statistics.median(p["ratio"] for p in pairs)
    raw_median = statistics.median(p["raw_busbw_GBps"] for p in pairs)
    bench_median = statistics.median(p["bench_busbw_GBps"] for p in pairs)
    passed = ratio >= TARGET_RATIO and all(p["correct"] for p in pairs)
    table = Table(title=f"all_reduce, {pairs[0]['bytes']:,} bytes float32, {world} ranks, {pairs[0]['backend']}, "
                        f"{args.warmup} warm-up + {args.iters} timed calls; busbw in GB/s (1e9 bytes/s), "
                        "higher is better")
    for header in ("repeat", "first", "raw busbw", "bench comm busbw", "ratio bench/raw"):
        table.add_column(header, justify="right")
    for p in pairs:
        table.add_row(str(p["repeat"]), "raw" if p["raw_first"] else "bench", f"{p['raw_busbw_GBps']:.3f}",
                      f"{p['bench_busbw_GBps']:.3f}", f"{p['ratio']:.3f}")
    table.add_row("median", "", f"{raw_median:.3f}", f"{bench_median:.3f}", f"{ratio:.3f}", style="bold")
    console.print(table)
    console.print(f"target: median ratio >= {TARGET_RATIO}: " + ("[green]pass[/]" if passed else "[red]fail[/]"))
    write_results(args.out, machine(), {
        "world_size": world,
        "omp_num_threads": args.threads,
        "units": {"busbw_GBps": "GB/s = 1e9 bytes/s, nccl-tests bus bandwidth", "seconds": "per call, slowest rank"},
        "median_ratio": ratio,
        "raw_busbw_GBps_median": raw_median,
        "bench_busbw_GBps_median": bench_median,
        "target_ratio": TARGET_RATIO,
        "passed": passed,
        "pairs": pairs,
        "total_seconds": time.perf_counter() - started,
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
