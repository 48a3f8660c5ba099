"""``nodescale plan`` without processes: the arithmetic, the model measured without memory, the CLI.

The private torch tools the plan uses (FakeTensorMode, StorageWeakRef) are pinned here by what the
plan relies on, not by torch's version: the GPU machine runs an older torch than this one.
tests/test_plan_state_bytes.py holds the state bytes to real runs.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest
import torch

from nodescale.cli.main import main
from nodescale.config.load import load_config
from nodescale.errors import UserError
from nodescale.models.spec import InputSpec
from nodescale.plan.estimate import Workload, format_walltime, nodes_for_deadline, plan_rows, recommend
from nodescale.plan.fake_model import fake_tensors, on_meta_device, saved_for_backward, storage_key
from nodescale.plan.hardware import Hardware, read_comm_results
from nodescale.plan.model_facts import ModelFacts, measure_model
from nodescale.plan.options import StrategyOption, all_options
from nodescale.plan.state_bytes import Optimiser, state_bytes, zero3_state, zero12_state
from nodescale.plan.step_time import Layout

ADAM = Optimiser.named("adamw")
BASE = ["plan", "--sample-shape", "1,8,8", "--num-classes", "10", "--train-samples", "1797", "--gpus-per-node", "4",
        "--gpu-memory", "40", "--peak-tflops", "100"]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# --- state bytes: the rules of each strategy on hand-made shapes ----------------------------------

def test_fsdp_shards_rows_and_rank_zero_holds_the_most() -> None:
    shapes = [(5, 2), (3,)]  # 3 and 2 rows of 2 on rank 0 of 2; 2 and 1 elements of the bias
    held = state_bytes(StrategyOption("fsdp", "full"), shapes, 2, 2, ADAM)
    assert held.parameter_bytes == 4 * (3 * 2 + 2)
    assert held.optimizer_bytes == 2 * held.parameter_bytes + 4 * 2  # exp_avg, exp_avg_sq; a step per tensor
    ddp = state_bytes(StrategyOption("ddp"), shapes, 2, 2, ADAM)
    assert ddp.parameter_bytes == 4 * 13 and ddp.gradient_bytes == 4 * 13
    hybrid = state_bytes(StrategyOption("fsdp", "hybrid"), shapes, 8, 1, ADAM)
    assert hybrid.total_bytes == ddp.total_bytes  # one rank per node: nothing to shard within it


def test_zero12_keeps_whole_gradients_of_the_parameters_reaching_into_its_slice() -> None:
    # 10 + 5 elements, padded to 16 (a multiple of 2 x 2 ranks): slices [0, 8) and [8, 16).
    held = zero12_state([10, 5], 2, 2, ADAM)
    assert held.parameter_bytes == 4 * 16
    assert held.gradient_bytes == 4 * 16  # rank 1's slice reaches into both parameters, and the padding
    assert held.optimizer_bytes == 4 * 8 * 3 + 4  # fp32 master, two states, one step for the flat group
    assert zero12_state([8, 8], 2, 1, ADAM).gradient_bytes == 4 * 8


def test_zero3_keeps_small_parameters_whole_on_every_rank() -> None:
    held = zero3_state([200_000, 10], 4, ADAM)
    assert held.parameter_bytes == 4 * (50_000 + 3 + 10)
    assert held.gradient_bytes == 4 * (50_000 + 3)
    assert zero3_state([200_000, 10], 4, ADAM, persistence_threshold=0).parameter_bytes == 4 * 50_003


def test_offload_moves_state_off_the_gpu() -> None:
    shapes = [(1000, 1000)]
    fsdp = state_bytes(StrategyOption("fsdp", "full", offload="all"), shapes, 4, 4, ADAM)
    assert fsdp.total_bytes == 0 and fsdp.host_bytes > 0
    zero = state_bytes(StrategyOption("zero", "2", offload="optimizer"), shapes, 4, 4, ADAM)
    assert zero.optimizer_bytes == 0 and zero.parameter_bytes == 4 * 1_000_000


def test_every_option_is_offered_once_with_the_flags_that_choose_it() -> None:
    options = all_options()
    names = [option.name for option in options]
    assert len(names) == len(set(names)) == 26  # ddp x 2, six sharded x 4
    assert "zero-3 +ac +offload" in names and "ddp +offload" not in names
    grad_op = StrategyOption("fsdp", "grad-op", True, "all").train_flags()
    assert grad_op == ["--strategy", "fsdp", "--sharding", "grad-op", "--cpu-offload", "all",
                       "--activation-checkpointing"]


# --- the model, measured without memory -----------------------------------------------------------

def test_fake_tensors_run_a_model_too_large_for_this_machine() -> None:
    started = time.perf_counter()
    with on_meta_device():
        model = torch.nn.Sequential(torch.nn.Linear(100_000, 100_000), torch.nn.ReLU())  # 40 GB of fp32 weights
    with fake_tensors() as make_fake:
        model = make_fake(model)
        with saved_for_backward(model, []) as saved:
            model(torch.zeros(8, 100_000))
    assert saved.total == 2 * 8 * 100_000 * 4  # the input (for the weight's gradient) and ReLU's output
    assert time.perf_counter() - started < 10


def test_views_share_a_storage_key_and_parameters_are_not_activations() -> None:
    base = torch.zeros(4, 4)
    assert storage_key(base[1:]) == storage_key(base) != storage_key(torch.zeros(4, 4))
    layer = torch.nn.Linear(3, 3)
    with saved_for_backward(layer, []) as saved:
        layer(torch.zeros(2, 3, requires_grad=True))
    assert saved.total == 2 * 3 * 4  # the input only, not the weight it saves too (for the input's gradient)


def test_storages_are_told_apart_where_storage_weak_ref_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.multiprocessing.reductions as reductions

    base, other = torch.zeros(4, 4), torch.zeros(4, 4)
    with_weak_ref = (storage_key(base), storage_key(base[1:]), storage_key(other))
    monkeypatch.delattr(reductions, "StorageWeakRef")  # as on a torch without it: the storage's own handle
    assert storage_key(base[2:]) == storage_key(base) != storage_key(other)
    assert (storage_key(base), storage_key(base[1:]), storage_key(other)) == with_weak_ref


def test_the_meta_device_serves_where_fake_tensor_mode_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, {"model.name": "vit_tiny", "model.patch_size": 4, "train.batch_size": 4})
    spec = InputSpec((1, 8, 8), 10)
    with_fake = measure_model(cfg, spec)
    from nodescale.plan import fake_model

    monkeypatch.setattr(fake_model, "fake_tensor_mode", lambda: None)  # as on a torch without it
    on_meta = measure_model(cfg, spec)
    assert (on_meta.shapes, on_meta.forward_flops_per_sample) == (with_fake.shapes, with_fake.forward_flops_per_sample)
    assert on_meta.activation_bytes == pytest.approx(with_fake.activation_bytes, rel=0.01)


def real_saved_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Bytes saved for backward by a real forward, counted here independently of the plan's code."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(batch)
    return sum(seen.values())


@pytest.mark.parametrize(("name", "shape", "extra"), [
    ("cnn", (1, 28, 28), {}),
    ("resnet18", (3, 32, 32), {}),
    ("vit_tiny", (3, 32, 32), {"model.patch_size": 4}),
    ("gpt_nano", (64,), {"data.name": "pydoc"}),
])
def test_activation_estimate_is_within_a_quarter_of_a_real_forward(name: str, shape: tuple[int, ...],
                                                                    extra: dict) -> None:
    from nodescale.models.registry import build_model, model_entry

    task = model_entry(name).task
    spec = InputSpec(shape, 256 if task == "language_modeling" else 10, task)
    cfg = load_config(None, {"model.name": name, "train.batch_size": 8, **extra})
    estimated = measure_model(cfg, spec)
    torch.manual_seed(0)
    model = build_model(cfg.model, spec).train()
    batch = torch.randint(0, 256, (8, *shape)) if task == "language_modeling" else torch.randn(8, *shape)
    real = real_saved_bytes(model, batch)
    assert abs(estimated.activation_bytes - real) <= 0.25 * real, (estimated.activation_bytes, real)
    assert estimated.parameter_count == sum(p.numel() for p in model.parameters())
    assert estimated.checkpointed_activation_bytes < estimated.activation_bytes


# --- hardware, time, the recommendation -----------------------------------------------------------

def facts(parameters: int = 100_000_000, flops: float = 1e10, activations: int = 2_000_000_000) -> ModelFacts:
    shapes = ((parameters // 1000, 1000),)
    return ModelFacts(shapes, (parameters // 10,) * 10, int(flops), 32, activations, activations // 4)


HW = Hardware("test GPU", 40_000_000_000, 100e12, "bf16", {"any": 25.0}, {})
WORK = Workload(1_000_000, 10, None, 1, "bf16", ADAM, 0.4, 0)


def test_the_recommendation_is_the_fastest_option_that_fits() -> None:
    rows = plan_rows(facts(), HW, WORK, Layout(2, 4), all_options())
    best = recommend(rows)
    assert best is not None and best.fits
    assert all(best.step.total_s <= row.step.total_s for row in rows if row.fits)
    huge = plan_rows(facts(parameters=10_000_000_000), HW, WORK, Layout(1, 4), all_options())
    by_name = {row.option.name: row for row in huge}
    assert not by_name["ddp"].fits and by_name["zero-3 +offload"].state.total_bytes < by_name["ddp"].state.total_bytes


def test_the_fewest_nodes_that_meet_the_deadline() -> None:
    options = all_options()
    nodes, row = nodes_for_deadline(3 * 3600, facts(), HW, WORK, 4, options)
    assert row.ask_s <= 3 * 3600
    fewer = recommend(plan_rows(facts(), HW, WORK, Layout(nodes - 1, 4), options)) if nodes > 1 else None
    assert nodes == 1 or fewer is None or fewer.ask_s > 3 * 3600
    with pytest.raises(UserError, match="the best is"):
        nodes_for_deadline(60, facts(), HW, WORK, 4, options, max_nodes=64)


def test_walltimes_round_up_to_the_minute_in_the_schedulers_format() -> None:
    assert format_walltime(61) == "00:02:00"
    assert format_walltime(86400 + 3600) == "1-01:00:00"


def test_bench_comm_results_give_each_collectives_bandwidth(tmp_path: Path) -> None:
    rows = [{"op": "all_reduce", "bytes": 1024, "busbw_GBps": 1.0}, {"op": "all_reduce", "bytes": 2**26,
            "busbw_GBps": 80.0}, {"op": "all_gather", "bytes": 2**26, "busbw_GBps": 60.0}]
    (tmp_path / "results.json").write_text(json.dumps(rows))
    assert read_comm_results(tmp_path / "results.json") == {"all_reduce": 80.0, "all_gather": 60.0}
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="bench comm"):
        read_comm_results(tmp_path / "bad.json")


# --- the command --------------------------------------------------------------------------------

def test_plan_json_has_a_row_per_option_and_the_recommendation() -> None:
    code, out, _ = run_main([*BASE, "--json", "--nodes", "2"])
    assert code == 0
    plan = json.loads(out)
    assert len(plan["rows"]) == 26 and plan["layout"]["world_size"] == 8
    assert plan["recommended"] in {row["strategy"] for row in plan["rows"] if row["fits"]}
    assert plan["model"]["parameters"] == 14634 and plan["rows"][0]["time"].count(":") == 2


def test_plan_prints_the_table_and_the_flags_to_use() -> None:
    code, out, _ = run_main([*BASE, "--strategy", "fsdp", "--sharding", "grad-op"])
    assert code == 0
    assert "fsdp grad-op +ac" in out and "zero-1" not in out
    assert "recommended (*)" in out and "--strategy fsdp --sharding grad-op" in out


def test_the_preset_says_the_gpu() -> None:
    code, out, _ = run_main(["plan", "--cluster", "derecho", "--sample-shape", "1,8,8", "--train-samples", "100",
                             "--json"])
    assert code == 0
    hardware = json.loads(out)["hardware"]
    assert hardware["gpu"] == "NVIDIA A100-SXM4-40GB" and hardware["memory_bytes"] == 40_000_000_000
    assert hardware["bus_gbps"] == {"any": 100.0} and hardware["peak_dtype"] == "fp32"


MODEL_THAT_READS_VALUES = """
import torch

def build():
    width = int(torch.tensor(3).item())  # a value read while building: no such thing on the meta device
    return torch.nn.Linear(width, 2)
"""


@pytest.mark.parametrize(("args", "said"), [
    (["--cluster", "mahti"], "--gpu-memory GB and --peak-tflops"),  # the preset names no GPU
    (["--gpus-per-node", "4"], "--gpu-memory GB and --peak-tflops"),
    ([*BASE[1:], "--deadline", "00:00:01"], "the best is"),
    ([*BASE[1:], "--deadline", "tomorrow"], "HH:MM:SS"),
    ([*BASE[1:], "--nodes", "0"], "whole number above 0"),
    ([*BASE[1:], "--efficiency", "1.5"], "at most 1"),
    ([*BASE[1:], "--sample-shape", "3x224"], "comma-separated"),
    ([*BASE[1:], "--comm", "/nonexistent/results.json"], "bench comm"),
    ([*BASE[1:], "--strategy", "single"], "--strategy ddp"),
    ([*BASE[1:], "--strategy", "fsdp", "--sharding", "none"], "--strategy ddp for a replicated model"),
])
def test_bad_input_exits_2_with_a_hint(args: list[str], said: str) -> None:
    code, _, err = run_main(["plan", *args])
    assert code == 2 and said in err and "hint:" in err, err


def test_a_model_that_cannot_be_built_on_the_meta_device_is_named(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "reads.py").write_text(MODEL_THAT_READS_VALUES)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main([*BASE, "--model", "reads.py:build"])
    assert code == 2 and "reads.py:build" in err and "--sample-shape" in err, err
