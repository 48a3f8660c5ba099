"""An Accelerate user's training script: ``Accelerator(cpu=True)`` in each process the launcher
started, reading RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as under torchrun. Prints one JSON line
per rank; writes nothing else.
"""

import gc
import json
import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8, shuffle=True)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)

    steps = 0
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps == 3:
            break

    total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
    weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(weights.unsqueeze(0))
    print(json.dumps({
        "framework": "accelerate",
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "sum": total.item(),
        "steps": steps,
        "weight_spread": (gathered.max(0).values - gathered.min(0).values).abs().max().item(),
        "distributed_type": str(accelerator.distributed_type),
        "pid": os.getpid(),
    }), flush=True)
    del model, optimizer, data
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
