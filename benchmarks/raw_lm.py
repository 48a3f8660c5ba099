"""A hand-written nanoGPT-style training loop of nodescale's GPT: the language-model baseline.

One loop, the two ways nanoGPT's ``train.py`` runs: under torchrun it is DDP (gloo on the
CPU, NCCL on GPUs), started with plain ``python`` it is one process::

    # overhead.py's gpt-nano-pydoc case: 2 processes on gloo
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/raw_lm.py \\
        --model gpt_nano --dataset pydoc --batch-size 32 --steps 40 --warmup-steps 5
    # throughput.py's gpt2_small case: one GPU, the fast settings
    python benchmarks/raw_lm.py --model gpt2_small --data-dir DIR --seq-len 1024 --batch-size 32 \\
        --precision bf16 --compile --tf32

Why a file of its own: ``raw_ddp.py`` is an image classifier's loop (normalised pixels, one
label per sample, per-epoch validation) at 371 lines; a language model's data (token
windows), loss (every next token) and single-GPU mode would take it past 400 lines and mix
two loops in one file. Its helpers (the sampler's shard, the cross-rank timing) and
``raw_throughput.py``'s (device facts, peak memory, compiled graphs) are imported, not copied.

The model is nodescale's own ``GPT`` (``nodescale.models.gpt``), built after
``torch.manual_seed(seed)`` with the preset's shape, tied embeddings and no dropout, exactly
as ``nodescale train`` builds it: only the loops differ. The same holds for the data: the
``pydoc`` bytes split where nodescale splits them (``nodescale.data.pydoc``), or a
``train.bin`` of uint16 ids (``--data-dir``), cut into windows of ``seq_len + 1`` tokens at
stride ``seq_len``, in nodescale's order (one permutation per epoch from ``seed + epoch``,
rank ``r`` taking positions ``r, r + W, ...``). The rest is written here:

* DDP with gradients as bucket views and DDP's default bucketing, as raw_ddp.py;
* the step: forward and nanoGPT's loss, ``cross_entropy(logits.view(-1, V), targets.view(-1))``,
  under bf16 autocast with ``--precision bf16`` (autocast computes it in fp32), backward,
  AdamW (lr 3e-3, weight decay 0, constant: nodescale's defaults; fused on CUDA, foreach on
  the CPU), ``zero_grad(set_to_none=True)``; ``--compile`` compiles the model only, as
  nodescale does (nanoGPT's forward also holds the loss), ``--tf32`` turns on TF32 matmuls;
* the data on the device once (it is small), a batch cut by indexing the windows;
* the loss summed on the device and reduced every ``--log-every`` steps (and at the last),
  as nodescale's metrics are: the logged losses let the harness check that both sides
  trained the same model on the same data;
* timing: the first ``--warmup-steps`` steps are timed one by one (compilation) and excluded;
  then the device is synchronised and the ranks meet at a barrier before the clock starts
  and before it stops; tokens/s counts the tokens every rank processed in the timed steps,
  over the slowest rank's time.

Rank 0 prints one ``RESULT`` JSON line (``--json-out`` writes it to a file too).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from raw_ddp import shard, sync, timing, write_result
from raw_throughput import peak_memory, pick_device, unique_graphs, versions
from torch.nn.parallel import DistributedDataParallel

from nodescale.data.pydoc import VOCAB as PYDOC_VOCAB
from nodescale.data.pydoc import corpus_bytes, split_point
from nodescale.models import gpt

SHAPES = {"gpt_nano": gpt.NANO, "gpt2_small": gpt.GPT2_SMALL, "gpt2_medium": gpt.GPT2_MEDIUM,
          "llama_1b": gpt.LLAMA_1B}
GPT2_VOCAB = 50257  # a --data-dir's vocabulary unless --vocab-size says otherwise (nodescale's default for uint16)
VAL_FRACTION = 0.2  # nodescale's data.val_fraction: where the pydoc text is cut


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", choices=sorted(SHAPES), default="gpt_nano")
    add("--dataset", choices=("pydoc", "tokens"), default="pydoc", help="tokens: DIR/train.bin (--data-dir)")
    add("--data-dir", type=Path, default=None, help="holds train.bin, uint16 token ids (implies --dataset tokens)")
    add("--vocab-size", type=int, default=GPT2_VOCAB, help="the token files' vocabulary (pydoc: 256, bytes)")
    add("--seq-len", type=int, default=64, help="tokens per window (nodescale's data.seq_len; pydoc's default 64)")
    add("--batch-size", type=int, default=32, help="windows per process per step")
    add("--steps", type=int, default=40, help="optimiser steps in total, warm-up included")
    add("--warmup-steps", type=int, default=5, help="first steps excluded from the timing")
    add("--precision", choices=("fp32", "bf16"), default="fp32")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--tf32", action="store_true", help="TF32 matmuls and convolutions on CUDA")
    add("--lr", type=float, default=3e-3)
    add("--weight-decay", type=float, default=0.0)
    add("--seed", type=int, default=0)
    add("--log-every", type=int, default=10, help="steps between loss reductions (nodescale's train.log_every)")
    add("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    add("--json-out", type=Path, default=None, help="rank 0 writes the result here")
    args = parser.parse_args(argv)
    if args.data_dir is not None:
        args.dataset = "tokens"
    if args.dataset == "tokens" and args.data_dir is None:
        parser.error("--dataset tokens needs --data-dir")
    if args.steps <= args.warmup_steps or args.warmup_steps < 1:
        parser.error("--warmup-steps must be at least 1 and --steps more than it")
    return args


def train_tokens(args: argparse.Namespace) -> tuple[torch.Tensor, int]:
    """The training split's token ids (int64) and the vocabulary, as nodescale reads them."""
    if args.dataset == "pydoc":
        data = corpus_bytes()
        cut = split_point(len(data), args.seq_len, VAL_FRACTION)
        return torch.frombuffer(bytearray(data[:cut + 1]), dtype=torch.uint8).long(), PYDOC_VOCAB
    return torch.from_numpy(np.fromfile(args.data_dir / "train.bin", dtype=np.uint16).astype(np.int64)), args.vocab_size


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    distributed = "RANK" in os.environ  # nanoGPT's test: launched by torchrun
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if distributed else (0, 1)
    device = (pick_device(args.device) if not distributed or args.device == "cpu" or not torch.cuda.is_available()
              else torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                **({"device_id": device} if device.type == "cuda" else {}))

    tokens, vocab = train_tokens(args)
    windows = tokens[:(len(tokens) - 1) // args.seq_len * args.seq_len + 1].unfold(0, args.seq_len + 1, args.seq_len)
    windows = windows.contiguous().to(device)  # (windows, seq_len + 1), resident: a batch is one index
    torch.manual_seed(args.seed)  # nodescale seeds, then builds: the same initial weights
    model = gpt.GPT(SHAPES[args.model], vocab, args.seq_len).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    runner = torch.compile(model) if args.compile else model
    if distributed:
        runner = DistributedDataParallel(runner, device_ids=[device.index] if device.type == "cuda" else None,
                                         gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  **({"fused": True} if device.type == "cuda" else {}))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    def batches() -> Any:
        """This rank's batches, epoch after epoch, in nodescale's order (the sampler's padding trains)."""
        for epoch in range(sys.maxsize):
            order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed + epoch))
            mine = shard(len(windows), rank, world, order)[0].to(device)
            for first in range(0, len(mine), args.batch_size):
                batch = windows[mine[first:first + args.batch_size]]
                yield batch[:, :-1], batch[:, 1:]

    losses: dict[str, float] = {}
    interval_loss = torch.zeros((), dtype=torch.float64, device=device)
    interval_steps = timed_tokens = 0
    warmup_step_seconds: list[float] = []
    graphs_before = None
    runner.train()
    data = batches()
    sync(device)
    setup_seconds = time.perf_counter() - began
    if distributed:
        dist.barrier()
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        with autocast:
            logits = runner(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        interval_loss += loss.detach()
        interval_steps += 1
        if step > args.warmup_steps:
            timed_tokens += y.numel()
        if step % args.log_every == 0 or step == args.steps:
            reduced = interval_loss / interval_steps
            if distributed:
                dist.all_reduce(reduced)
            losses[str(step)] = reduced.item() / world
            if rank == 0:
                print(f"step {step:>6}  loss {losses[str(step)]:.4f}", flush=True)
            interval_loss.zero_()
            interval_steps = 0
        if step <= args.warmup_steps:  # compilation and the allocator's first blocks: timed apart, excluded
            sync(device)
            warmup_step_seconds.append(time.perf_counter() - started)
            if step == args.warmup_steps:
                if distributed:
                    dist.barrier()
                graphs_before = unique_graphs()
            started = time.perf_counter()
    sync(device)
    if distributed:
        dist.barrier()
    elapsed = time.perf_counter() - started
    graphs_after = unique_graphs()

    timed_steps = args.steps - args.warmup_steps
    if distributed:
        timed = timing(elapsed, timed_tokens // args.seq_len, timed_steps, device)
    else:
        timed = {"timed_steps": timed_steps, "timed_samples": timed_tokens // args.seq_len, "timed_seconds": elapsed,
                 "step_seconds": elapsed / timed_steps, "samples_per_second": timed_tokens / args.seq_len / elapsed}
    memory, memory_kind = peak_memory(device)
    final_loss = losses[str(args.steps)]
    if rank == 0:
        write_result(args.json_out, {
            "side": "raw", "model": args.model, "dataset": args.dataset, "parameters": parameters,
            "world_size": world, "batch_size_per_process": args.batch_size, "seq_len": args.seq_len,
            "vocab_size": vocab, "precision": args.precision, "compile": args.compile, "tf32": args.tf32,
            "steps": args.steps, "timing_warmup_steps": args.warmup_steps, **timed,
            "timed_tokens": timed["timed_samples"] * args.seq_len,
            "tokens_per_second": timed["samples_per_second"] * args.seq_len,
            "losses": losses, "final_loss": final_loss, "finite_loss": math.isfinite(final_loss),
            "setup_seconds": setup_seconds, "warmup_step_seconds": [round(s, 6) for s in warmup_step_seconds],
            "graphs_compiled_during_timing": (None if graphs_before is None or graphs_after is None
                                              else graphs_after - graphs_before),
            "peak_memory_bytes": memory, "peak_memory_kind": memory_kind,
            "data_bytes": windows.numel() * windows.element_size(), "device": str(device),
            "backend": dist.get_backend() if distributed else None, **versions(device),
            "wall_seconds": time.perf_counter() - began,
        })
    if distributed:  # gloo's pending work goes while the group exists (see raw_ddp.py)
        del runner, model, optimizer
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
