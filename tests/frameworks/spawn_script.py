"""An ``mp.spawn`` user's script: run once (``--mode spawn``), it starts its own two processes.

Each process joins a gloo group at an address of the script's own choosing, all-reduces its
rank + 1, trains three DDP steps and prints one JSON line.
"""

import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(rank)  # different data on each rank; DDP keeps the weights equal
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        optimizer.step()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    low, high = weights.clone(), weights.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    print(json.dumps({"rank": rank, "world_size": world_size, "sum": total.item(), "steps": 3,
                      "weight_spread": (high - low).abs().max().item(), "pid": os.getpid()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    mp.spawn(worker, args=(2, free), nprocs=2)
