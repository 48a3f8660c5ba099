"""A Lightning user's script that relies on Lightning's own Slurm requeue (its SLURMEnvironment, auto_requeue).

First run: after step 5 each rank writes ``ready-RANK`` and waits there, so that the test's stop signal
finds every rank outside a collective (Lightning saves its checkpoint inside the signal handler, with a
barrier). Lightning then writes ``hpc_ckpt_1.ckpt`` and requeues the job itself; the requeued run
resumes from it, trains 3 more steps and prints one JSON line per rank. Each rank also prints how it
found SIGUSR1 at start: Lightning installs its handler only where it is the default action.
"""

import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

AT_START = signal.getsignal(signal.SIGUSR1)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Gate(L.Callback):
    """Waits at step 5 of a first run; ends a resumed run 3 steps after where it resumed."""

    def on_train_start(self, trainer, module) -> None:
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.start and trainer.global_step >= self.start + 3:
            trainer.should_stop = True
        elif not self.start and trainer.global_step == 5:
            Path(f"ready-{trainer.global_rank}").write_text("")
            while True:  # until the stop signal's handler requeues the job and Slurm ends it
                time.sleep(0.05)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    gate = Gate()
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("SLURM_JOB_NUM_NODES", "1")), max_epochs=1000, default_root_dir=".",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[gate],
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=8))
    print(json.dumps({"rank": trainer.global_rank, "resumed_from": gate.start, "steps": trainer.global_step,
                      "usr1_at_start": str(AT_START),
                      "environment": type(trainer.strategy.cluster_environment).__name__}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
