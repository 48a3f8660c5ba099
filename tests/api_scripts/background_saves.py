"""A script that saves checkpoints in the background, driven by tests/test_checkpoint_async.py.

``python background_saves.py OUT STRATEGY MODE``: 6 AdamW steps of an MLP, a checkpoint at steps 2, 4 and 6.

* ``sync``: every save waits (the reference); ``async``: every save in the background.
* ``kill`` (a sharded strategy: every rank writes a file): background saves; the step-4 save's files
  stall in ``os.fsync`` (as on a busy parallel file system); two more steps are taken and, once this
  rank's shard file is written and stuck in its fsync, the process SIGKILLs itself.
* ``resume``: background saves, after loading the newest whole checkpoint.
* ``stage-kill``: saves that wait, to ``checkpoint_stage=OUT-stage``; the step-4 copy into OUT stalls in
  ``os.fsync``; once it does, two more steps are taken, then the process SIGKILLs itself.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import nodescale

out, strategy, mode = sys.argv[1], sys.argv[2], sys.argv[3]
real_fsync = os.fsync
staged = mode == "stage-kill"
shard_stalled = threading.Event()  # this rank's step-4 .distcp file is written and stuck in its fsync


def stalled_fsync(fd: int) -> None:
    path = os.readlink(f"/proc/self/fd/{fd}")
    if "step-00000004" in path and not (staged and "-stage/" in path):  # not the step-2 save, nor the local one
        if path.endswith(".distcp"):
            shard_stalled.set()
        time.sleep(120)
    real_fsync(fd)


ctx = nodescale.init(strategy=strategy, seed=0, out=out, checkpoint_async=mode not in ("sync", "stage-kill"),
                     keep_last=3,
                     checkpoint_stage=out + "-stage" if staged else None)
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
    if mode.endswith("kill") and step == 6:  # before its save, which would wait for step 4's
        while staged and not any(Path(out).glob("checkpoints/step-00000004.partial/*")):  # rank 0's copy began
            time.sleep(0.05)
        # The background thread may not have written a byte yet (a busy machine): the kill waits for it.
        # (A save that does not run in the background never gets here before its files are whole.)
        if not staged:
            shard_stalled.wait(timeout=120)
        print(f"rank {ctx.rank}: step 6 taken while step 4 was being written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if step % 2 == 0:
        if mode.endswith("kill"):
            os.fsync = stalled_fsync
        ctx.save_checkpoint(state)
ctx.close()
