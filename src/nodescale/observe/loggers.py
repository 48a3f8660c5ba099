"""The sinks a run's ``observe.log`` asks for; each library is imported only when chosen."""

from __future__ import annotations

from pathlib import Path

from nodescale.config.schema import ObserveSection
from nodescale.observe.csv_sink import CsvSink
from nodescale.observe.sink import Sink


def make_sinks(observe: ObserveSection, run_dir: Path) -> list[Sink]:
    """metrics.csv always, then the chosen loggers in the order given."""
    sinks: list[Sink] = [CsvSink(run_dir / "metrics.csv")]
    for name in observe.log:
        if name == "tensorboard":
            from nodescale.observe.tensorboard_sink import TensorBoardSink

            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        elif name == "mlflow":
            from nodescale.observe.mlflow_sink import MlflowSink

            sinks.append(MlflowSink(run_dir, observe.mlflow_uri, observe.experiment))
        elif name == "wandb":
            from nodescale.observe.wandb_sink import WandbSink

            sinks.append(WandbSink(run_dir, observe.experiment, observe.wandb_mode))
    return sinks
