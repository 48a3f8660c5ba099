"""The report's node-monitor section, from monitor files in the exact format NodeMonitor writes."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from nodescale.observe.monitor import HOST_COLUMNS, device_columns
from nodescale.report.build import build_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _write_monitor_csv(path: Path, node: int, start: float, gpus: int, energy: bool, rows: int) -> None:
    """A monitor file in the exact format NodeMonitor writes, with known numbers (and a last line cut off)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow([*HOST_COLUMNS, *device_columns(gpus)])
        for k in range(rows):
            cpu = "" if k == 0 else f"{10.0 + 7 * k:.1f}"
            procs = "" if k == 0 else f"{90.0 + 11 * k + node:.1f}"
            row = [f"{start + k:.3f}", f"{float(k):.3f}", f"host{node}", node, cpu, procs,
                   1_000_000_000 + 50_000_000 * k, 30_000_000_000, 500_000_000_000]
            for gpu in range(gpus):
                row += [f"{40.0 + 5 * k + gpu:.1f}", 20_000_000_000 + 1_000_000_000 * k + gpu, 80_000_000_000,
                        f"{50.0 + k:.1f}", f"{300.0 + 10 * k + gpu:.2f}", f"{310.5 * k + gpu:.3f}" if energy else ""]
            writer.writerow(row)
    with open(path, "a") as handle:
        handle.write(f"{start + rows:.3f},{float(rows):.3f},host{node}")  # a crash mid-row


def _mean_max(values: list[float]) -> str:
    return f"{sum(values) / len(values):,.1f} / {max(values):,.1f}"


def _table_row(text: str, first: str) -> list[str]:
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells and cells[0] == first:
            return cells[1:]
    raise AssertionError(f"no table row {first!r}")


def test_report_shows_the_monitor_next_to_throughput(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    start = 1_700_000_000.0
    (run / "summary.json").write_text(json.dumps({"world_size": 4, "global_steps": 6, "samples_per_second": 900.0}))
    steps = [{"time": start + 2 * i + 1.5, "kind": "step", "step": 2 * i + 2, "epoch": 0, "loss": 2.0 / (i + 1),
              "samples_per_second": 800.0 + 50 * i} for i in range(3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in steps))
    _write_monitor_csv(run / "monitor" / "node-0.csv", 0, start, gpus=2, energy=True, rows=8)
    _write_monitor_csv(run / "monitor" / "node-1.csv", 1, start + 0.4, gpus=1, energy=False, rows=7)

    report = build_report([run], tmp_path / "report")
    text = report.read_text()
    assert "### Node monitor" in text
    image = re.search(r"!\[node usage of [^\]]*\]\(([^)]+)\)", text)
    assert image and (report.parent / image.group(1)).read_bytes()[:8] == PNG_SIGNATURE

    for node, gpus in ((0, 2), (1, 1)):
        rows = _rows(run / "monitor" / f"node-{node}.csv")
        rows = [row for row in rows if None not in row.values()]
        cells = _table_row(text, f"node {node}")
        cpu = [float(r["cpu_percent"]) for r in rows if r["cpu_percent"]]
        procs = [float(r["procs_cpu_percent"]) for r in rows if r["procs_cpu_percent"]]
        util = [float(r[f"gpu{g}_util_percent"]) for r in rows for g in range(gpus)]
        memory = [int(r[f"gpu{g}_mem_used_bytes"]) for r in rows for g in range(gpus)]
        assert cells[:7] == [f"host{node}", str(len(rows)), _mean_max(cpu), _mean_max(procs),
                             f"{max(int(r['procs_rss_bytes']) for r in rows) / 1e6:,.1f}", _mean_max(util),
                             f"{max(memory) / 1e6:,.1f}"]
        if node == 0:
            energy = sum(float(rows[-1][f"gpu{g}_energy_j"]) for g in range(gpus))
            assert cells[7] == f"{energy:,.1f}"
        else:
            assert cells[7] == "n/a"  # node 1's GPU has no energy counter
    assert "2 row(s) of the monitor files were incomplete" in text
    assert "Device energy over the sampled period, all nodes" not in text  # not every node reported it
