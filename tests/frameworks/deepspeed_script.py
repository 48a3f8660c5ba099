"""A DeepSpeed user's training script: ZeRO stage 1 over gloo, in each process the launcher
started (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set, so no MPI discovery). Prints
one JSON line per rank; writes nothing else.
"""

import gc
import json
import os
import sys

sys.modules["mlflow"] = None  # only DeepSpeed's autotuner uses MLflow: importing it costs seconds
import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

del sys.modules["mlflow"]
# On CPU, DeepSpeed JIT-builds a shared-memory all-reduce (inference only) on first use: a minute of
# compiling. nodescale's own DeepSpeed strategy turns it off the same way.
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "steps_per_print": 1000,
}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)

    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    high, low = weights.clone(), weights.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    print(json.dumps({
        "framework": "deepspeed",
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": total.item(),
        "steps": engine.global_steps,
        "weight_spread": (high - low).abs().max().item(),
        "zero_stage": engine.zero_optimization_stage(),
        "pid": os.getpid(),
    }), flush=True)
    del engine, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
