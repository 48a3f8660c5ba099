"""A user's own DDP script, torchrun-style (rank and rendezvous from the environment), that checkpoints and
requeues at the stop signal with ``nodescale.preemption``.

The first run trains until the job is told to stop: every rank agrees on a step, rank 0 saves it, and
``preemption.requeue`` exits for requeue. A run that finds the checkpoint resumes from it, trains
``EXTRA_STEPS`` more steps and prints one JSON line per rank.
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import nodescale.preemption as preemption

CHECKPOINT = Path("checkpoint.pt")


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if CHECKPOINT.exists():
        state = torch.load(CHECKPOINT, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    step = start
    preemption.requested()  # the handlers, before the first step
    while not start or step < start + int(os.environ.get("EXTRA_STEPS", "3")):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0:
            Path("progress").write_text(str(step))
        if preemption.requested():
            if rank == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save(state, "checkpoint.tmp")
                os.replace("checkpoint.tmp", CHECKPOINT)
            preemption.requeue(step)
        time.sleep(0.02)  # a slower step: less of the shared CPU while the test waits for progress
    print(json.dumps({"rank": rank, "resumed_from": start, "steps": step}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
