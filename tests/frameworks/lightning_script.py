"""A Lightning user's training script: DDP on the CPU, one process per task the launcher started.

Under ``srun`` Lightning picks its SLURMEnvironment by itself (SLURM_NTASKS is set and the job
is not named ``bash``/``interactive``): ranks from SLURM_PROCID/SLURM_LOCALID/SLURM_NODEID,
the rendezvous from the MASTER_ADDR/MASTER_PORT the job script exported, and it starts no
processes of its own. Prints one JSON line per rank; writes no logs or checkpoints.
"""

import json
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("SLURM_JOB_NUM_NODES", "1")),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    trainer.fit(model, DataLoader(data, batch_size=8))

    strategy = trainer.strategy
    total = strategy.reduce(torch.tensor(float(trainer.global_rank + 1)), reduce_op="sum")
    # DDP keeps the replicas equal: the largest difference of any weight from rank 0's.
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    spread = (strategy.reduce(weights, reduce_op="max") - strategy.reduce(weights, reduce_op="min")).abs().max()
    print(json.dumps({
        "framework": "lightning",
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "sum": total.item(),
        "steps": trainer.global_step,
        "weight_spread": spread.item(),
        "environment": type(strategy.cluster_environment).__name__,
        # True: its launcher leaves the processes to srun instead of starting devices - 1 more.
        "external": strategy.cluster_environment.creates_processes_externally,
        "pid": os.getpid(),
    }), flush=True)
    strategy.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
