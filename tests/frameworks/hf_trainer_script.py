"""A Hugging Face ``Trainer`` user's script with nodescale's requeue callback.

The first run trains until the job is told to stop: the callback makes every rank save a checkpoint at
the same step and exit for requeue. A run that finds a checkpoint in ``out/`` resumes from it, trains 3
more steps and prints one JSON line per rank.
"""

import json
import os
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import nodescale.preemption


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}


class Progress(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open("progress", "w") as file:
                file.write(str(state.global_step))
        time.sleep(0.02)  # a slower step: less of the shared CPU while the test waits for progress


def main() -> None:
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.randn(1)} for _ in range(64)]
    last = get_last_checkpoint("out") if os.path.isdir("out") else None
    resumed = int(last.rsplit("-", 1)[1]) if last else 0
    args = TrainingArguments(output_dir="out", max_steps=resumed + 3 if last else 1_000_000,
                             per_device_train_batch_size=8, save_strategy="no", logging_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=Tiny(), args=args, train_dataset=data,
                      callbacks=[Progress(), nodescale.preemption.hf_trainer_callback()])
    trainer.train(resume_from_checkpoint=last)
    print(json.dumps({"rank": trainer.args.process_index, "world_size": trainer.args.world_size,
                      "resumed_from": resumed, "steps": trainer.state.global_step}), flush=True)


if __name__ == "__main__":
    main()
