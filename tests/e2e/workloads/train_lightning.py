"""A tiny randomly initialised model trained by PyTorch Lightning with Castor's callback (the README's
"PyTorch Lightning and Hugging Face Trainer" example, with a way to die): dropout draws from torch's
global generator, AdamW with a per-step LR schedule, epochs of 6 batches, so a resumed run is bit-exact
only if the model, optimizer, scheduler, loop progress and generators all come back. --accumulate N
accumulates the gradients of N batches an optimizer step; --blocking saves with Checkpointer(blocking=True)
(each save committed when it returns).

Standalone (the Checkpointer's directory is --shm). --die-at N kills this process with SIGKILL at the end
of the first batch with global step N: right after step N's save() returned (its copy may still be in
flight), or for N=0 with --accumulate, partway through the first optimizer step, before any save. At the
end it writes the model's, optimizer's and scheduler's states and the step count to --out, and the step it
resumed from (or None). --ddp N trains with DDP over N processes instead (see ddp())."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import WeightAveraging
from torch.utils.data import DataLoader

from worker_lib import Checkpointer
from worker_lib.integrations.lightning import CastorCallback

BATCHES_PER_EPOCH = 6


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 16)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # The data is a function of the step: where the batches come from is the dataloader's business
        # (README), not the callback's.
        generator = torch.Generator().manual_seed(int(self.global_step))
        x = torch.randn(8, 16, generator=generator)
        return F.mse_loss(self.net(x), x.flip(1))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[int]:
        return DataLoader(range(BATCHES_PER_EPOCH), batch_size=1)


def cpu_trainer(callbacks: list[pl.Callback], **options: Any) -> pl.Trainer:
    """A Trainer on the CPU (one device unless `options` say otherwise) that prints nothing of its own: no
    logger, progress bar or model summary."""
    return pl.Trainer(
        callbacks=callbacks,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"devices": 1, **options},
    )


class DieAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shm", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument("--ema", action="store_true", help="average the weights (WeightAveraging)")
    parser.add_argument("--ddp", type=int, default=0, help="DDP over N processes, the callback's own stores")
    args = parser.parse_args()
    if args.ddp:
        ddp(args.ddp, args.steps)
        return

    torch.manual_seed(0)
    model = Regression()
    with Checkpointer(args.shm, blocking=args.blocking) as checkpointer:
        castor = CastorCallback(checkpointer)
        # WeightAveraging updates the average in on_train_batch_end: listed first, a save has this step's.
        callbacks: list[pl.Callback] = [WeightAveraging()] if args.ema else []
        callbacks.append(castor)
        if args.die_at is not None:
            callbacks.append(DieAt(args.die_at))  # after Castor's: step N's save() has returned
        trainer = cpu_trainer(
            callbacks,
            max_steps=args.steps,
            enable_checkpointing=False,
            accumulate_grad_batches=args.accumulate,
        )
        torch.manual_seed(1)  # the generators training starts from
        trainer.fit(model)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "restored_step": castor.restored_step,
        },
        args.out,
    )


def ddp(processes: int, steps: int) -> None:
    """`strategy="ddp"` run as a script, as Lightning's docs run it: its launcher starts the other ranks by
    running this command again, with LOCAL_RANK, NODE_RANK and WORLD_SIZE set, not RANK. The callback opens
    each rank's store itself (in /dev/shm/castor-<uid>/$CASTOR_JOB/rank-<rank>)."""
    torch.manual_seed(0)
    trainer = cpu_trainer(
        [CastorCallback()], max_steps=steps, devices=processes, strategy="ddp", enable_checkpointing=False
    )
    trainer.fit(Regression())


if __name__ == "__main__":
    main()
