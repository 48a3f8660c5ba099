"""A script that saves checkpoints in the background, driven by tests/test_checkpoint_async.py.

``python background_saves.py OUT STRATEGY MODE``: 6 AdamW steps of an MLP, a checkpoint at steps 2, 4 and 6.

* ``sync``: every save waits (the reference); ``async``: every save in the background.
* ``kill``: background saves; the step-4 save's files stall in ``os.fsync`` (as on a busy parallel
  file system); two more steps are taken, then the process SIGKILLs itself.
* ``resume``: background saves, after loading the newest whole checkpoint.
"""

import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import nodescale

out, strategy, mode = sys.argv[1], sys.argv[2], sys.argv[3]
real_fsync = os.fsync


def stalled_fsync(fd: int) -> None:
    if "step-00000004" in os.readlink(f"/proc/self/fd/{fd}"):  # not the step-2 save, maybe still in flight
        time.sleep(120)
    real_fsync(fd)


ctx = nodescale.init(strategy=strategy, seed=0, out=out, checkpoint_async=mode != "sync", keep_last=3)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
model, optimizer = ctx.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
state = {"model": model, "optimizer": optimizer}
if mode == "resume":
    ctx.load_checkpoint(state)
while ctx.global_step < 6:
    step = ctx.global_step + 1
    generator = torch.Generator().manual_seed(step * 10 + ctx.rank)  # the same batch whenever the step runs
    x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
    ctx.backward(F.cross_entropy(model(x), y))
    ctx.step(optimizer)
    if mode == "kill" and step == 6:  # before its save, which would wait for step 4's
        print(f"rank {ctx.rank}: step 6 taken while step 4 was being written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if step % 2 == 0:
        if mode == "kill":
            os.fsync = stalled_fsync
        ctx.save_checkpoint(state)
ctx.close()
