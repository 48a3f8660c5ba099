"""The library engine in this process (a job of one): accumulation, precision, compile, checkpoints, mistakes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import nodescale
from nodescale.errors import UserError


def data(size: int = 53) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, 6, generator=generator)
    return TensorDataset(x, (x[:, 0] > 0).long())


def train(epochs: int = 1, batch_size: int = 8, out: Path | None = None, **options) -> tuple[nn.Module, dict]:
    """An MLP trained by SGD through the API; its plain model and what the run returned."""
    ctx = nodescale.init(seed=0, out=out, **options)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    loader = ctx.loader(data(), batch_size=batch_size)
    stepped = 0
    for _ in range(epochs):
        for x, y in loader:
            with ctx.autocast():
                loss = F.cross_entropy(model(x), y)
            ctx.backward(loss)
            ctx.clip_grad_norm(model, 10.0)
            stepped += ctx.step(optimizer)
            ctx.log({"loss": loss})
    plain = ctx.unwrap(model)
    summary = ctx.close()
    return plain, {"steps": stepped, "summary": summary}


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_accumulating_two_micro_batches_equals_one_batch_of_both() -> None:
    # 53 samples: windows of 2 x 8 against batches of 16, and a short last window (5) against a batch of 5.
    accumulated, run = train(batch_size=8, grad_accum=2)
    whole, whole_run = train(batch_size=16)
    assert run["steps"] == whole_run["steps"] == 4
    for name, tensor in weights(whole).items():  # float32 sums in another order: rounding only
        assert torch.allclose(weights(accumulated)[name], tensor, atol=1e-6), name


def test_bf16_autocast_trains_and_compile_gives_the_same_weights(tmp_path: Path) -> None:
    plain, _ = train(batch_size=16)
    compiled, run = train(batch_size=16, compile=True, out=tmp_path / "compiled")
    for name, tensor in weights(plain).items():  # Inductor fuses and reorders: rounding only
        assert torch.allclose(weights(compiled)[name], tensor, atol=1e-5), name
    assert run["summary"]["global_steps"] == 4
    bf16, _ = train(batch_size=16, precision="bf16")
    assert all(t.dtype == torch.float32 for t in weights(bf16).values())  # autocast keeps fp32 weights
    differences = [float((weights(bf16)[n] - t).abs().max()) for n, t in weights(plain).items()]
    assert 0 < max(differences) < 0.05  # bf16 matmuls: close, not equal


def test_checkpoint_values_come_back_and_nothing_is_loaded_without_one(tmp_path: Path) -> None:
    ctx = nodescale.init(seed=0, out=tmp_path)
    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    assert ctx.load_checkpoint(state) is None
    optimizer.step()
    scheduler.step()
    ctx.save_checkpoint({**state, "best": 0.75, "note": "first"}, step=7)
    scheduler.step()
    loaded = ctx.load_checkpoint(state)
    assert loaded is not None and loaded["best"] == 0.75 and loaded["note"] == "first" and loaded["step"] == 7
    assert scheduler.get_last_lr() == [0.05]  # the scheduler's state as saved, not as stepped after
    assert ctx.global_step == 7
    ctx.close()
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000007.manifest.json").read_text())
    assert "step-00000007.pt" in json.dumps(manifest)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: nodescale.init(precison="bf16"), "did you mean 'precision'"),
    (lambda: nodescale.init(strategy="fsdb"), "did you mean 'fsdp'"),
    (lambda: nodescale.init(sharding="grad-op"), "--sharding applies to --strategy fsdp"),
])
def test_bad_options_name_the_value_and_a_hint(call, message: str) -> None:  # noqa: ANN001
    with pytest.raises(UserError, match=message):
        call()


def test_mistakes_in_a_loop_are_explained(tmp_path: Path) -> None:
    ctx = nodescale.init()
    model = nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UserError, match="needs the optimiser"):
        ctx.backward(model(torch.zeros(1, 6)).sum())
    model, optimizer = ctx.prepare(model, optimizer)
    with pytest.raises(UserError, match="needs a run directory"):
        ctx.save_checkpoint({"model": model, "optimizer": optimizer})
    with pytest.raises(UserError, match="called twice"):
        ctx.prepare(model, optimizer)
    ctx.close()
    ctx = nodescale.init(out=tmp_path)
    with pytest.raises(UserError, match="a parameter the model does not"):
        ctx.prepare(nn.Linear(6, 2), torch.optim.SGD(nn.Linear(6, 2).parameters(), lr=0.1))
    model = nn.Linear(6, 2)
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match="does not name the optimizer"):
        ctx.save_checkpoint({"model": model})
    ctx.close()


def test_log_reduces_as_asked_and_refuses_an_unknown_reduction(tmp_path: Path) -> None:
    with nodescale.init(out=tmp_path) as ctx:
        assert ctx.log({"loss": torch.tensor([1.0, 3.0])}) == {"loss": 2.0}  # a tensor: its mean
        assert ctx.log({"accuracy": None}, reduce=None, kind="epoch") == {"accuracy": None}  # as given
        with pytest.raises(UserError, match="is not a reduction"):
            ctx.log({"loss": 1.0}, reduce="median")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["step", "epoch"]
