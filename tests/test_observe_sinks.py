"""The TensorBoard, MLflow and W&B sinks, driven directly and read back with each library's own reader."""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodescale.errors import UserError
from nodescale.observe.sink import final_scalars, flat_params, scalars_of

T0 = 1_795_263_000.0

CONFIG: dict[str, Any] = {
    "model": {"name": "cnn", "dropout": 0.1, "patch_size": None},
    "optim": {"lr": 0.003, "betas": [0.9, 0.99], "a:b": 1},  # a colon: fine for MLflow on POSIX only
    "train": {"epochs": 2, "compile": False, "notes": "x" * 7000},  # longer than MLflow's 6000-character limit
    "checkpoint": {"resume": False},
}
RESUMED_CONFIG: dict[str, Any] = {**CONFIG, "checkpoint": {"resume": True}}
SUMMARY: dict[str, Any] = {"samples_per_second": 1234.5, "val_loss": 0.25, "val_accuracy": 0.9, "wall_seconds": 12.0,
                           "energy_joules": None, "world_size": 2, "strategy": "ddp", "backend": "gloo"}


def records(first: int, last: int, part: int = 1, epoch_every: int = 3) -> list[dict[str, Any]]:
    """Step records first..last (values differ by ``part``), an epoch and a checkpoint record every ``epoch_every``."""
    out: list[dict[str, Any]] = []
    for step in range(first, last + 1):
        out.append({"time": T0 + step + part / 10, "kind": "step", "step": step, "epoch": (step - 1) // epoch_every,
                    "loss": part + 1 / step, "accuracy": step / 100, "lr": 0.003, "samples_per_second": 1000.0 + step,
                    "step_seconds": 0.01, "data_wait_seconds": 0.001, "compute_seconds": 0.009,
                    "memory_bytes": 123456 + step})
        if step % epoch_every == 0:
            out.append({"time": T0 + step + 0.5, "kind": "epoch", "epoch": step // epoch_every - 1, "step": step,
                        "epoch_seconds": 1.5, "val_loss": 0.5 - step / 100, "val_accuracy": 0.8, "val_samples": 397})
            out.append({"time": T0 + step + 0.6, "kind": "checkpoint", "step": step, "path": f"ckpt/{step}"})
    return out


def expected(recs: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Tag -> {step: value} as the sinks should log them (a later value at the same step wins)."""
    series: dict[str, dict[int, float]] = {}
    for record in recs:
        for name, value in scalars_of(record).items():
            series.setdefault(name, {})[record["step"]] = value
    return series


def _unset(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Remove ``name`` now and have the test's teardown remove it again if the code under test sets it."""
    monkeypatch.setenv(name, "unset")
    monkeypatch.delenv(name)


# ---------------------------------------------------------------- TensorBoard


def _accumulator(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def _tb_series(accumulator: Any) -> dict[str, dict[int, float]]:
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_writes_scalars_config_and_hparams(tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    from nodescale.observe.tensorboard_sink import TensorBoardSink

    log_dir = tmp_path / "tensorboard"
    recs = records(1, 6)
    sink = TensorBoardSink(log_dir)
    sink.start(CONFIG, resumed=False)
    for record in recs:
        sink.write(record)
    sink.finish(SUMMARY, "finished")

    accumulator = _accumulator(log_dir)
    want = expected(recs)
    want.update({name: {6: value} for name, value in final_scalars(SUMMARY).items()})  # at the last step
    got = _tb_series(accumulator)
    assert got.keys() == want.keys()
    for tag, points in want.items():
        assert got[tag] == pytest.approx(points, rel=1e-6), tag  # event files hold float32
    assert [event.wall_time for event in accumulator.Scalars("val/loss")] == pytest.approx([T0 + 3.5, T0 + 6.5])

    text = accumulator.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == CONFIG

    content = accumulator.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["model.dropout"].number_value == pytest.approx(0.1)
    assert start.hparams["train.epochs"].number_value == 2
    assert start.hparams["optim.betas"].string_value == "0.9,0.99"
    assert start.hparams["train.compile"].string_value == "false"
    assert start.hparams.keys() == flat_params(CONFIG).keys()
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert "val/loss" in [info.name.tag for info in experiment.metric_infos]
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS
    assert [path.name for path in log_dir.iterdir() if path.is_dir()] == []  # no add_hparams sub-run


def test_tensorboard_resume_appends_and_replaces_replayed_steps(tmp_path: Path) -> None:
    from nodescale.observe.tensorboard_sink import TensorBoardSink

    log_dir = tmp_path / "tensorboard"
    # The first part logged up to step 7 (val/loss at 3 and 6); the second resumed from the checkpoint at step 3.
    first, second = records(1, 7, part=1), records(4, 8, part=2)
    sink = TensorBoardSink(log_dir)
    sink.start(CONFIG, resumed=False)
    for record in first:
        sink.write(record)
    sink.finish(None, "stopped")
    assert "_hparams_/session_end_info" not in _accumulator(log_dir).PluginTagToContent("hparams")  # not ended
    time.sleep(1.1)  # event file names carry whole seconds: keep the parts' files in order
    sink = TensorBoardSink(log_dir)
    sink.start(RESUMED_CONFIG, resumed=True)
    for record in second:
        sink.write(record)
    sink.finish(SUMMARY, "finished")

    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    accumulator = _accumulator(log_dir)
    steps = {tag: [event.step for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    values = {tag: [event.value for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
    # Steps 4 to 7 once each, from the second part: its first step restarted the run there for every tag.
    assert steps["train/loss"] == list(range(1, 9))
    assert values["train/loss"] == pytest.approx([(1 if step < 4 else 2) + 1 / step for step in range(1, 9)])
    assert steps["val/loss"] == [3, 6]
    assert values["val/loss"] == pytest.approx([0.47, 0.44])
    assert (steps["final/val_loss"], values["final/val_loss"]) == ([8], [0.25])


# ---------------------------------------------------------------- MLflow


def _mlflow_series(client: Any, run_id: str, key: str) -> tuple[list[int], list[float]]:
    history = client.get_metric_history(run_id, key)
    return [metric.step for metric in history], [metric.value for metric in history]


def test_mlflow_run_params_metrics_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from nodescale.observe.mlflow_sink import MlflowSink, param_key

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _unset(monkeypatch, "MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "cnn-digits-1"
    run_dir.mkdir()
    first, second = records(1, 5, part=1), records(4, 8, part=2)

    sink = MlflowSink(run_dir, None, "nodescale-test")
    sink.start(CONFIG, resumed=False)
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # our own file store: allowed
    for record in first:
        sink.write(record)
    sink.finish(None, "stopped")

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert run.info.run_name == "cnn-digits-1"
    assert client.get_experiment(run.info.experiment_id).name == "nodescale-test"
    want_params = {param_key(key): str(value)[:6000] for key, value in flat_params(CONFIG).items()}
    assert run.data.params == want_params
    assert run.data.params["optim.a_b"] == "1" and len(run.data.params["train.notes"]) == 6000
    assert set(run.data.metrics) == set(expected(first))  # exactly scalars_of's names
    assert _mlflow_series(client, run_id, "val/loss") == ([3], [pytest.approx(0.47)])
    assert [m.timestamp for m in client.get_metric_history(run_id, "val/loss")] == [int((T0 + 3.5) * 1000)]

    sink = MlflowSink(run_dir, None, "nodescale-test")
    sink.start(RESUMED_CONFIG, resumed=True)
    assert sink.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    for record in second:
        sink.write(record)
    sink.finish(SUMMARY, "finished")

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert run.data.params["checkpoint.resume"] == "False"  # params are immutable: the first part's value
    steps, values = _mlflow_series(client, run_id, "train/loss")  # both parts, the replayed steps 4 and 5 twice
    assert steps == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    assert values == pytest.approx([1 + 1 / step for step in range(1, 6)] + [2 + 1 / step for step in range(4, 9)])
    assert _mlflow_series(client, run_id, "final/val_loss") == ([8], [0.25])
    assert set(run.data.metrics) == set(expected(first + second)) | set(final_scalars(SUMMARY))
    assert {key: run.data.tags.get(key) for key in ("world_size", "strategy", "backend")} == {
        "world_size": "2", "strategy": "ddp", "backend": "gloo"}


def test_mlflow_uri_from_environment_and_failed_status(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    from nodescale.observe.mlflow_sink import MlflowSink

    store = tmp_path / "shared-store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(store))  # a plain path is a file store too
    _unset(monkeypatch, "MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    sink = MlflowSink(run_dir, None, "nodescale-test")
    sink.start(CONFIG, resumed=False)
    sink.write(records(1, 1)[0])
    sink.finish(None, "failed")

    assert not (run_dir / "mlruns").exists()
    run = MlflowClient(tracking_uri=store.as_uri()).get_run(sink.run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics["train/loss"] == pytest.approx(2.0)


def test_mlflow_unreachable_server_is_a_user_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nodescale.observe.mlflow_sink import MlflowSink

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _unset(monkeypatch, "MLFLOW_ALLOW_FILE_STORE")
    # MLflow retries for minutes by default; one try with a short timeout is what this test needs.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    sink = MlflowSink(tmp_path, "http://127.0.0.1:9", "nodescale-test")  # port 9 (discard): nothing listens
    began = time.monotonic()
    with pytest.raises(UserError) as raised:
        sink.start(CONFIG, resumed=False)
    assert time.monotonic() - began < 15
    assert "'http://127.0.0.1:9'" in raised.value.what
    assert "reachable" in raised.value.rule
    assert raised.value.hint is not None and "--mlflow-uri" in raised.value.hint
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # a server is no file store
    assert not (tmp_path / "mlflow_run.json").exists()


def test_mlflow_param_keys_are_valid() -> None:
    from mlflow.utils.validation import _validate_param_name

    from nodescale.observe.mlflow_sink import param_key

    for key in ("a:b", "model.kwargs.x[0]", "/abs", "a//b", "..", "a/../b", "é ü", "k" * 300):
        cleaned = param_key(key)
        _validate_param_name(cleaned)  # MLflow's own check raises on an invalid name
        assert len(cleaned) <= 250
    assert param_key("train.lr") == "train.lr"


# ---------------------------------------------------------------- W&B

_HEADER = struct.Struct("<4sHB")  # ':W&B', 0xBEE1, version 0
_BLOCK = 32768
_RECORD = struct.Struct("<IHB")  # crc32, length, type (1 full, 2 first, 3 middle, 4 last)


def wandb_records(path: Path) -> list[Any]:
    """The protobuf records of a ``run-*.wandb`` transaction log.

    wandb 0.31 ships no Python reader any more (``wandb.sdk.internal.datastore``
    is gone; wandb-core writes the file), so this reads its LevelDB-style log
    format (32 KiB blocks, records split into fragments with a CRC each) and
    parses each record with wandb's own ``Record`` message.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = _HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0)
    out, pending, offset = [], b"", _HEADER.size
    while offset + _RECORD.size <= len(data):
        if _BLOCK - offset % _BLOCK < _RECORD.size:  # no room for a header: the block's tail is padding
            offset += _BLOCK - offset % _BLOCK
            continue
        checksum, length, kind = _RECORD.unpack_from(data, offset)
        if kind == 0:  # zero-filled: the end of what was written
            break
        fragment = data[offset + _RECORD.size:offset + _RECORD.size + length]
        assert zlib.crc32(fragment, zlib.crc32(bytes([kind]))) == checksum
        offset += _RECORD.size + length
        pending += fragment
        if kind in (1, 4):
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def wandb_part(run_dir: Path) -> dict[str, Any]:
    """History rows, config, summary, run id and exit code of the newest offline run directory of ``run_dir``."""
    newest = max((run_dir / "wandb").glob("offline-run-*"), key=lambda path: path.stat().st_mtime_ns)
    (log,) = newest.glob("run-*.wandb")
    # run.finish() returns once wandb-core has the run's last messages; it writes the file a moment later,
    # and a record caught half-written fails its CRC: read again until the exit record is there, whole.
    deadline = time.monotonic() + 20
    while True:
        try:
            records = wandb_records(log)
            if any(record.HasField("exit") for record in records):
                break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, f"{log} has no exit record"
        time.sleep(0.05)
    part: dict[str, Any] = {"dir": newest, "rows": {}, "config": {}, "summary": {}}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            part["id"] = record.run.run_id
            part["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            part["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            part["rows"][row["_step"]] = {key: value for key, value in row.items() if not key.startswith("_")}
        elif kind == "summary":
            part["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                    for item in record.summary.update})
        elif kind == "exit":
            part["exit_code"] = record.exit.exit_code
    return part


@pytest.fixture(scope="module")
def wandb_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """W&B's directories under a temporary home, no credentials, no inherited mode; torn down at the end."""
    home = tmp_path_factory.mktemp("wandb-home")
    (home / "netrc").write_text("")
    with pytest.MonkeyPatch.context() as patch:
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            (home / name.lower()).mkdir()
            patch.setenv(name, str(home / name.lower()))
        patch.setenv("NETRC", str(home / "netrc"))
        for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_PROJECT"):
            patch.delenv(name, raising=False)
        yield home
        import wandb

        wandb.teardown()  # stop wandb-core, so later tests in this process start from nothing


@pytest.fixture(scope="module")
def wandb_parts(wandb_env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run in two parts: steps 1..5 (stopped), then resumed from step 3 with steps 4..8 (finished).

    The second part is asked for online mode while WANDB_MODE=offline, which must win.
    """
    from nodescale.observe.wandb_sink import WandbSink

    run_dir = tmp_path_factory.mktemp("runs") / "cnn-digits-2"
    run_dir.mkdir()
    sink = WandbSink(run_dir, "nodescale-test", "offline")
    sink.start(CONFIG, resumed=False)
    for record in records(1, 5, part=1):
        sink.write(record)
    sink.finish(None, "stopped")
    first = wandb_part(run_dir)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        sink = WandbSink(run_dir, "nodescale-test", "online")
        sink.start(RESUMED_CONFIG, resumed=True)
    for record in records(4, 8, part=2):
        sink.write(record)
    sink.finish(SUMMARY, "finished")
    return {"run_dir": run_dir, "first": first, "second": wandb_part(run_dir)}


def test_wandb_offline_history_config_and_exit(wandb_parts: dict[str, Any]) -> None:
    first = wandb_parts["first"]
    assert first["dir"].parent == wandb_parts["run_dir"] / "wandb"
    want_rows: dict[int, dict[str, float]] = {}
    for name, points in expected(records(1, 5, part=1)).items():
        for step, value in points.items():
            want_rows.setdefault(step, {})[name] = value
    assert sorted(first["rows"]) == sorted(want_rows)
    for step, row in want_rows.items():
        assert first["rows"][step] == pytest.approx(row), step  # the epoch record at step 3 joins step 3's row
    assert set().union(*first["rows"].values()) == set(expected(records(1, 5)))  # scalars_of's names, no more
    assert {key: first["config"][key] for key in CONFIG} == CONFIG
    assert first["exit_code"] == 1  # stopped: not finished


def test_wandb_resume_continues_the_same_run(wandb_parts: dict[str, Any]) -> None:
    first, second = wandb_parts["first"], wandb_parts["second"]
    assert second["dir"] != first["dir"]
    assert second["id"] == first["id"]
    saved = json.loads((wandb_parts["run_dir"] / "wandb_run.json").read_text())
    assert saved == {"id": first["id"], "project": "nodescale-test", "last_step": 8}
    # Steps 4 and 5 were logged by the first part: W&B steps only increase, so the second part starts at 6.
    assert sorted(second["rows"]) == [6, 7, 8]
    assert second["rows"][6]["train/loss"] == pytest.approx(2 + 1 / 6)
    assert second["rows"][6]["val/loss"] == pytest.approx(0.44)
    assert second["config"]["checkpoint"] == {"resume": True}
    assert {key: second["summary"][key] for key in final_scalars(SUMMARY)} == pytest.approx(final_scalars(SUMMARY))
    assert second["summary"]["train/loss"] == pytest.approx(2 + 1 / 8)
    assert second["exit_code"] == 0


def test_wandb_online_without_credentials_is_a_user_error(wandb_env: Path, tmp_path: Path) -> None:
    from nodescale.observe.wandb_sink import WandbSink

    began = time.monotonic()
    with pytest.raises(UserError) as raised:
        WandbSink(tmp_path, "nodescale-test", "online").start(CONFIG, resumed=False)
    assert time.monotonic() - began < 10
    assert "API key" in raised.value.rule
    assert raised.value.hint is not None
    assert "wandb login" in raised.value.hint and "--wandb-mode offline" in raised.value.hint
    assert not (tmp_path / "wandb").exists()


def test_a_failing_logger_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    from nodescale.engine.metrics_log import MetricsLog
    from nodescale.observe.csv_sink import CsvSink

    class FullDisk:  # a logger whose writes fail, as on a full disk or a vanished server
        name = "full-disk"
        finished: list[str] = []

        def start(self, config: dict[str, Any], resumed: bool) -> None:
            pass

        def write(self, record: dict[str, Any]) -> None:
            raise OSError(28, "No space left on device")

        def finish(self, summary: dict[str, Any] | None, status: str) -> None:
            self.finished.append(status)

    broken = FullDisk()
    log = MetricsLog(tmp_path / "metrics.jsonl", True, [broken, CsvSink(tmp_path / "metrics.csv")])
    log.start({}, resumed=False)
    with pytest.warns(UserWarning, match="full-disk failed .*No space left"):
        log.write({"kind": "step", "step": 1, "loss": 0.5})
    log.write({"kind": "step", "step": 2, "loss": 0.25})
    log.close({}, "finished")
    assert broken.finished == ["failed"]  # closed once, when it was dropped
    assert [line.split(",")[1:3] for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]] == [
        ["step", "1"], ["step", "2"]]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_resumed_metrics_csv_keeps_the_header_it_was_begun_with(tmp_path: Path) -> None:
    """A run begun by another version (other columns) gets rows under its own header, lined up."""
    import csv

    from nodescale.observe.csv_sink import CsvSink

    path = tmp_path / "metrics.csv"
    path.write_text("time,kind,step,loss\n1.0,step,10,2.5\n")
    sink = CsvSink(path)
    sink.start({}, resumed=True)
    sink.write({"time": 2.0, "kind": "step", "step": 20, "loss": 2.25, "tokens_per_second": 99.0})
    sink.finish(None, "finished")
    rows = list(csv.DictReader(path.open()))
    assert list(rows[1]) == ["time", "kind", "step", "loss"]
    assert rows[1] == {"time": "2.0", "kind": "step", "step": "20", "loss": "2.25"}
