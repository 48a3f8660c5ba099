"""Ranks forked by the local launcher's fork server use the GPU (run by scripts/gpu-check.sh on a GPU machine)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from nodescale.cli.train_cmd import _preload
from nodescale.config.schema import RunConfig
from nodescale.launch.schedulers.local_worker_group import run_worker_group

RANK = """
    import json, os, sys
    forked = {preloaded!r} in sys.modules  # a rank started afresh has imported nothing yet
    import torch
    total = float(torch.ones(1000, device="cuda").sum())
    with open("rank" + os.environ["RANK"] + ".json", "w") as f:
        json.dump({{"forked": forked, "total": total}}, f)
"""


@pytest.mark.parametrize("touches_the_driver", [False, True])
def test_forked_ranks_use_the_gpu_or_start_afresh(touches_the_driver: bool, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """nodescale's own imports leave the GPU alone, so ranks fork; an import that probes it makes them exec instead."""
    monkeypatch.chdir(tmp_path)
    preload = _preload(RunConfig(strategy={"name": "ddp"}))
    if touches_the_driver:
        (tmp_path / "probe.py").write_text("import torch\nassert torch.cuda.is_available()\n")
        preload += ("probe",)
    (tmp_path / "rank.py").write_text(textwrap.dedent(RANK.format(preloaded=preload[-1])))
    result = run_worker_group([sys.executable, "-m", "rank"], 2, preload=preload)
    assert result.codes == {0: 0, 1: 0}
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record == {"forked": not touches_the_driver, "total": 1000.0}
