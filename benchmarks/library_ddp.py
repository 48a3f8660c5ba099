"""``raw_ddp.py``'s loop written with nodescale's library calls: what the library face costs a step.

The same model, data, order, optimiser, logging interval and timing as ``raw_ddp.py`` in its
timing form (its flags, ``--steps`` required, its result line; constant learning rate, no
validation): only the process group, DDP wrapper, data loading, backward and step
go through ``nodescale.init``, ``ctx.prepare``, ``ctx.loader``, ``ctx.backward`` and
``ctx.step``. It is ``overhead.py``'s ``library`` side, against ``raw_ddp.py``::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/library_ddp.py --model cnn --dataset digits --batch-size 32 --steps 300 --warmup-steps 5
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_parts import make_optimizer, parse_args, sync, timing, write_result  # noqa: E402

import nodescale  # noqa: E402
from nodescale.config.schema import DataSection, ModelSection  # noqa: E402
from nodescale.data.registry import get_format  # noqa: E402
from nodescale.models.registry import build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, need_steps=True)
    ctx = nodescale.init(seed=args.seed, bucket_cap_mb=args.bucket_cap_mb)
    splits = get_format(args.dataset).load(DataSection(name=args.dataset, image_size=args.image_size,
                                                       samples=args.samples, channels=args.channels), args.seed)
    torch.manual_seed(args.seed)
    model = build_model(ModelSection(name=args.model), splits.spec)
    optimizer = make_optimizer(args, model.parameters(), ctx.device)
    model, optimizer = ctx.prepare(model, optimizer)
    loader = ctx.loader(splits.train, batch_size=args.batch_size, seed=args.seed)

    step = timed_samples = 0
    model.train()
    ctx.barrier()
    started = time.perf_counter()
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            ctx.backward(loss)
            ctx.step(optimizer)
            step += 1
            if step > args.warmup_steps:
                timed_samples += loader.real_count
            if args.log_every and step % args.log_every == 0:
                ctx.print(f"step {step:>6}  loss {ctx.mean(loss):.4f}")
            if step == args.warmup_steps:
                sync(ctx.device)
                ctx.barrier()
                started = time.perf_counter()
            if step == args.steps:
                break
    sync(ctx.device)
    ctx.barrier()
    timed = timing(time.perf_counter() - started, timed_samples, args.steps - args.warmup_steps, ctx.device)
    if ctx.rank == 0:
        write_result(args.json_out, {"side": "library", "model": args.model, "dataset": args.dataset,
                                     "world_size": ctx.world_size, "steps": step, **timed})
    del model, optimizer
    gc.collect()
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
