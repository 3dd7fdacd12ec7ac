"""PyTorch Lightning: checkpoint into Castor every N optimizer steps and resume from its newest checkpoint.

    from worker_lib.integrations.lightning import CastorCallback

    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[CastorCallback()])
    trainer.fit(model, datamodule)   # resumes by itself when Castor holds a checkpoint of this rank

Each save stores what Lightning's own `ModelCheckpoint` writes to a file (the checkpoint dictionary that
`trainer.fit(ckpt_path=...)` restores: model, optimizers, LR schedulers, loop progress, callback and
datamodule states, precision plugin), plus the random number generators (the state of this callback), and
the restore hands that dictionary to Lightning's own resume path, so a resumed fit goes on as one resumed
from a file would. Works with `lightning` (`lightning.pytorch`) or `pytorch_lightning`, whichever is
installed (the first one if both are: pass the callback to a Trainer of the same package).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import torch

from worker_lib.checkpointer import Checkpointer
from worker_lib.integrations._state import decode, encode
from worker_lib.rng import restore_rng_state, rng_state


def _lightning() -> Any:
    try:
        return importlib.import_module("lightning.pytorch")
    except ImportError:  # the older package name
        return importlib.import_module("pytorch_lightning")


pl = _lightning()
if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    Callback = pl.Callback

__all__ = ["CastorCallback"]


class CastorCallback(Callback):
    """Saves Lightning's checkpoint dictionary into Castor after every `every_n_steps`-th optimizer step
    (in `on_train_batch_end`, where `ModelCheckpoint(every_n_train_steps=...)` saves), as Castor iteration
    `trainer.global_step`; at the start of `fit`, restores the newest checkpoint Castor picks (the recovery
    plan's iteration under the agent) through Lightning's own resume path.

    `checkpointer`: a Checkpointer you own (and close); by default the callback opens one
    (`Checkpointer(directory)`, the agent's or /dev/shm/castor-<uid>/... without one) in `setup` and closes
    it in `teardown`. `resume=False` never restores. `restored_step` tells what a fit resumed from.
    """

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        every_n_steps: int = 1,
        directory: str | os.PathLike[str] | None = None,
        resume: bool = True,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, not {every_n_steps}")
        self._checkpointer = checkpointer
        self._owned = checkpointer is None
        self._directory = directory
        self.every_n_steps = every_n_steps
        self.resume = resume
        self.restored_step: int | None = None
        self._step_at_batch_start: int | None = None
        self._rng_to_restore: dict[str, Any] | None = None
        self._trainer: Any = None

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self._directory)
        return self._checkpointer

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        self._rng_to_restore = None  # a state loaded by another stage's checkpoint (see load_state_dict)
        if stage != "fit":
            return  # validate, test, predict: nothing saved, nothing opened (teardown closes after fit only)
        self._check_rank(trainer)
        if not self.resume:
            return
        restored = self.checkpointer.restore()
        if restored is None:
            return
        connector = getattr(trainer, "_checkpoint_connector", None)
        if connector is None or not hasattr(connector, "_loaded_checkpoint"):
            raise RuntimeError(
                f"CastorCallback cannot resume with Lightning {pl.__version__}: its Trainer has no "
                "_checkpoint_connector._loaded_checkpoint (tested with Lightning 2.6)"
            )
        # Lightning restores the modules, callbacks, loops, optimizers and schedulers from this dictionary
        # right after `setup` (`_restore_modules_and_callbacks`, then `restore_training_state`), exactly as
        # for `fit(ckpt_path=...)`; with no ckpt_path, `resume_start` leaves it in place. An explicit
        # ckpt_path replaces it: the file wins.
        connector._loaded_checkpoint = decode(restored.state)
        self.restored_step = restored.iteration

    def _check_rank(self, trainer: Any) -> None:
        """Each rank saves into its own store, named by $RANK (Checkpointer). Lightning's own launchers
        (`strategy="ddp"` run as `python train.py`, `ddp_spawn`) set LOCAL_RANK, NODE_RANK and WORLD_SIZE
        but not RANK: every rank then wrote into rank 0's store, racing for its slots, and restored whichever
        rank's checkpoint was newest."""
        if int(trainer.world_size) <= 1:
            return
        rank = int(trainer.global_rank)
        if self._checkpointer is None:
            os.environ.setdefault("RANK", str(rank))
        checkpointer_rank = int(self.checkpointer._rank)
        if checkpointer_rank != rank:
            raise ValueError(
                f"CastorCallback on global rank {rank} got a Checkpointer of rank {checkpointer_rank} "
                f"($RANK={os.environ.get('RANK')!r} when it was made): every rank needs its own. Let the "
                "callback open it (CastorCallback() without a checkpointer), or make it once RANK is set"
            )

    def state_dict(self) -> dict[str, Any]:
        # Part of every checkpoint Lightning dumps (this one's and ModelCheckpoint's files): the generators
        # as they stand after the step, which Lightning itself does not save, and whether the step ended
        # its epoch (see load_state_dict).
        trainer = self._trainer
        epoch_end = trainer is not None and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return {"rng": rng_state(), "epoch_end": epoch_end}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        if trainer is None or trainer.state.fn != "fit":
            # trainer.test(ckpt_path=...) restores callback states too: a test must not set the process's
            # generators back to a training-time state, nor leave one for a later fit to apply.
            self._rng_to_restore = None
            return
        self._rng_to_restore = state_dict.get("rng")
        if state_dict.get("epoch_end") and self._rng_to_restore is not None:
            # After an epoch's last step, the uninterrupted run next makes the new epoch's dataloader
            # iterator, which draws a seed from torch's generator. A resumed fit makes it before
            # on_train_start (and draws nothing again), so the generators go back now, before it: set
            # only in on_train_start, the resumed run's dropout and shuffling diverged from the first batch.
            # (The sanity check in between runs with the generators isolated.)
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Mid-epoch, as late as possible: after the sanity check and the train dataloader's iterator (which
        # draws a seed from torch's generator) and right before the first batch, as in the uninterrupted run.
        if self._rng_to_restore is not None:
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = int(trainer.global_step)
        # Only on a batch that stepped the optimizer: with gradient accumulation, global_step moves on every
        # accumulate_grad_batches batches only, and a checkpoint taken partway through a step (the first
        # batch, at global_step 0, or the first one after a resume) would resume with the gradient of the
        # step's earlier batches lost.
        if step == self._step_at_batch_start or step % self.every_n_steps != 0:
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        if type(trainer.strategy) not in (pl.strategies.SingleDeviceStrategy, pl.strategies.DDPStrategy):
            self.checkpointer.save(step, encode(checkpoint))
        elif _live_state_dict(checkpoint["state_dict"], trainer.lightning_module):
            # The module itself rather than its state_dict: save() then captures its buffers before it
            # returns, so a forward that changes them in place (BatchNorm) never races the copy.
            checkpoint["state_dict"] = trainer.lightning_module
            self.checkpointer.save(step, encode(checkpoint))
        else:
            # An on_save_checkpoint hook put something else there (WeightAveraging: the averaged weights,
            # the live ones moved to "current_model_state"): saved as it is (before, the live module replaced
            # it, and a resume reset the average to the live weights). Every tensor that is not a parameter
            # or an optimizer's state is snapshotted inside the call, as a module's buffers are.
            self.checkpointer._save_detached(step, encode(checkpoint))

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._owned and self._checkpointer is not None:
            self._checkpointer.close(finished=False)
            self._checkpointer = None

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and self._owned and self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
        elif stage == "fit" and self._checkpointer is not None:
            self._checkpointer.wait()


def _live_state_dict(saved: Any, module: Any) -> bool:
    """Whether `saved` is still the module's own state_dict (its tensors, by storage), as Lightning dumped it
    before any on_save_checkpoint hook changed it."""
    live = module.state_dict()
    if not isinstance(saved, dict) or saved.keys() != live.keys():
        return False
    return all(
        torch.is_tensor(value)
        and torch.is_tensor(live[key])
        and value.data_ptr() == live[key].data_ptr()
        and value.shape == live[key].shape
        for key, value in saved.items()
    )
