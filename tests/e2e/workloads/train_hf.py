"""A tiny randomly initialised GPT-2 (2 layers, 32 wide, built from a config: nothing is downloaded)
trained by the Hugging Face Trainer with Castor's callback (the README's "PyTorch Lightning and Hugging
Face Trainer" example, with a way to die): dropout, AdamW with a linear warm-up and decay, a shuffled
dataset of 6 batches an epoch, so a resumed run is bit-exact only if the model, optimizer, scheduler,
TrainerState, data position and generators all come back. --eval steps|epoch evaluates after every step or
epoch (creating the eval DataLoader's iterator draws from torch's generator) and keeps the best eval loss.

Standalone (the Checkpointer's directory is --shm). --die-at N kills this process with SIGKILL right
after step N's save() returned (its copy may still be in flight), which is after step N's evaluation. At
the end it writes the model's, optimizer's and scheduler's states, the step count, the evaluations' losses
and the best one to --out, and the step it resumed from (or None)."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from worker_lib import Checkpointer
from worker_lib.integrations.transformers import CastorCallback

SEQUENCES, LENGTH, BATCH = 24, 16, 4  # 6 batches an epoch


class DieAt(TrainerCallback):  # type: ignore[misc]
    """Kills at the first hook after Castor's save of step N (the callback saves a step once the Trainer
    has logged, evaluated and saved after it: at the next step's or epoch's beginning)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_step_begin(args, state, control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shm", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--eval", choices=("no", "steps", "epoch"), default="no")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 64, (SEQUENCES, LENGTH), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=3,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=2,
        disable_tqdm=True,
        dataloader_num_workers=0,
        eval_strategy=args.eval,
        eval_steps=1,
        metric_for_best_model="eval_loss" if args.eval != "no" else None,
    )
    with Checkpointer(args.shm) as checkpointer:
        castor = CastorCallback(checkpointer)
        callbacks: list[TrainerCallback] = [castor]
        if args.die_at is not None:
            callbacks.append(DieAt(args.die_at))  # after Castor's: step N's save() has returned
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=dataset,
            eval_dataset=dataset[: 2 * BATCH] if args.eval != "no" else None,
            callbacks=callbacks,
        )
        trainer.train(resume_from_checkpoint=castor.resume_from_checkpoint())
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict(),
            "global_step": trainer.state.global_step,
            "evaluations": [
                (e["step"], e["eval_loss"]) for e in trainer.state.log_history if "eval_loss" in e
            ],
            "best_metric": trainer.state.best_metric,
            "restored_step": castor.restored_step,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
