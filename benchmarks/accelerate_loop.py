"""``raw_ddp.py``'s timing job under Hugging Face Accelerate: the ``accelerate`` side of ``overhead.py``.

Launched under torchrun, as the Accelerate documentation allows for several CPU processes
(``accelerate launch`` is a wrapper around the same launcher)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/accelerate_loop.py --model cnn --dataset synthetic --image-size 28 --channels 1 \\
        --samples 60000 --batch-size 64 --steps 300 --warmup-steps 10 --optimizer sgd --lr 0.01 --momentum 0

It takes ``raw_ddp.py``'s flags (``raw_parts.py``) and only times: ``--steps`` is required,
the learning rate is constant and nothing is validated (``raw_ddp.py``'s ``--schedule constant
--no-validate``, whatever those flags say). The same model, built by the same builder after
the same seed, the same training tensors, the same optimiser, batch per process and steps as
the raw loop, and the raw loop's code with Accelerate's wrapping, as its documentation
writes it: ``Accelerator(cpu=True)`` (torchrun's variables make it ``MULTI_CPU``: a gloo
process group), ``accelerator.prepare(model, optimizer, dataloader)`` (DDP, the optimiser's
wrapper, the loader's sharding), ``accelerator.backward(loss)``, ``accelerator.reduce`` of the
loss every ``--log-every`` steps as the raw loop's all-reduce, ``wait_for_everyone`` as its
barrier. The clock runs as the raw loop's: from a barrier after the last warm-up step to a
barrier after the last step, the device synchronised first, the samples of every rank counted.

Differences from the raw loop, all the framework's idioms:

* inputs normalised once before training (the raw loop normalises every batch: two
  element-wise ops, the identity on the synthetic images);
* a ``DataLoader`` over a ``TensorDataset`` collates batches from single samples (the raw loop
  indexes its tensors once per batch) and Accelerate shards it by whole batches (rank r takes
  batches r, r + W, ...) instead of the raw loop's interleaved samples; with its default
  ``even_batches=True`` an epoch's last step is filled from the epoch's start, so on the digits
  it trains on a few more samples per epoch than the raw loop (the samples are counted; the
  synthetic case ends within its first epoch);
* DDP as ``prepare`` sets it up: torch's defaults, so gradients are copied into the buckets
  (the raw loop sets ``gradient_as_bucket_view=True``);
* the wrappers' own work per step: the optimiser's (gradient-accumulation state), the loader's
  (one batch fetched ahead to know the epoch's end, RNG synchronised per epoch).
"""

from __future__ import annotations

import gc
import sys
import time

import accelerate
import torch
import torch.nn.functional as F
from accelerate import Accelerator

# The script's own directory is on sys.path when it is run as a script.
from raw_parts import make_optimizer, make_parser, parse_args, sync, timing, training_tensors, write_result
from torch.utils.data import DataLoader, TensorDataset


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, make_parser(__doc__.split("\n\n")[0]), need_steps=True)
    # cpu=True, as Accelerate's docs write it for CPU processes (without it, torchrun's variables on a machine
    # with no GPU leave it undistributed); --device auto on a GPU machine takes CUDA, as the raw loop does.
    accelerator = Accelerator(cpu=args.device == "cpu" or not torch.cuda.is_available())
    model, x_train, y_train = training_tensors(args)
    optimizer = make_optimizer(args, model.parameters(), accelerator.device)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = timed_samples = 0
    model.train()
    accelerator.wait_for_everyone()
    started = time.perf_counter()  # replaced at the end of warm-up unless there is none
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step > args.warmup_steps:
                timed_samples += len(y)
            if args.log_every and step % args.log_every == 0:
                reduced = accelerator.reduce(loss.detach(), reduction="mean")
                if accelerator.is_main_process:
                    print(f"step {step:>6}  loss {reduced.item():.4f}", flush=True)
            if step == args.warmup_steps:
                sync(accelerator.device)
                accelerator.wait_for_everyone()
                started = time.perf_counter()
            if step == args.steps:
                break
    sync(accelerator.device)
    accelerator.wait_for_everyone()
    timed = timing(time.perf_counter() - started, timed_samples, args.steps - args.warmup_steps, accelerator.device)
    if accelerator.is_main_process:
        write_result(args.json_out, {
            "side": "accelerate", "model": args.model, "dataset": args.dataset,
            "world_size": accelerator.num_processes, "batch_size_per_process": args.batch_size, "steps": step,
            "timing_warmup_steps": args.warmup_steps, **timed, "optimizer": args.optimizer, "lr": args.lr,
            "torch_threads": torch.get_num_threads(), "backend": accelerator.state.backend,
            "distributed_type": str(accelerator.distributed_type), "accelerate_version": accelerate.__version__,
        })
    del model, optimizer
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group
    return 0


if __name__ == "__main__":
    sys.exit(main())
