"""Hugging Face `Trainer`: checkpoint into Castor every N optimizer steps and resume from its newest one.

    from worker_lib.integrations.transformers import CastorCallback

    castor = CastorCallback()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[castor])
    trainer.train(resume_from_checkpoint=castor.resume_from_checkpoint())   # None: a fresh start

Each save stores the model, the optimizer, the LR scheduler's state, the `TrainerState` and the random number
generators, in memory, as Castor iteration `state.global_step`, once the Trainer is done with that step: after
its logging, evaluation and own checkpoint, which follow `on_step_end` (an evaluation draws from torch's
generator when it creates the eval DataLoader's iterator, and adds its metrics to the `TrainerState`), that
is at the next step's `on_step_begin`, at the next epoch's `on_epoch_begin` (after an end-of-epoch
evaluation), or at `on_train_end` for the last step. `resume_from_checkpoint()` restores Castor's newest
checkpoint (the recovery plan's iteration under the agent) and lays it out as the checkpoint directory the
Trainer itself writes (`pytorch_model.bin`, `optimizer.pt`, `scheduler.pt`, `trainer_state.json`,
`rng_state.pth`), in a temporary directory it removes once training runs again; the Trainer's own resume
then restores everything and skips the batches already trained on, as from one of its own checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from worker_lib.checkpointer import Checkpointer
from worker_lib.integrations._state import decode, encode
from worker_lib.rng import rng_state

__all__ = ["CastorCallback"]


class CastorCallback(TrainerCallback):
    """See the module's docstring. `checkpointer`: a Checkpointer you own (and close); by default the
    callback opens one (`Checkpointer(directory)`) on first use and closes it at the end of training.
    `restored_step` tells what `resume_from_checkpoint()` found."""

    def __init__(
        self,
        checkpointer: Checkpointer | None = None,
        *,
        every_n_steps: int = 1,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, not {every_n_steps}")
        self._checkpointer = checkpointer
        self._owned = checkpointer is None
        self._directory = directory
        self.every_n_steps = every_n_steps
        self.restored_step: int | None = None
        self._resume_dir: Path | None = None
        self._pending: int | None = None  # the step to save once the Trainer is done with it

    @property
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self._directory)
        return self._checkpointer

    def resume_from_checkpoint(self) -> str | None:
        """A Trainer checkpoint directory holding Castor's newest checkpoint of this rank, for
        `trainer.train(resume_from_checkpoint=...)`; None when Castor holds none (start fresh)."""
        restored = self.checkpointer.restore()
        if restored is None:
            return None
        state = decode(restored.state)
        directory = Path(tempfile.mkdtemp(prefix="castor-hf-resume-"))
        # The Trainer's file names and formats (trainer.py: WEIGHTS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME,
        # TRAINER_STATE_NAME, _save_rng_state); it loads them with torch.load(weights_only=True).
        torch.save(state["model"], directory / "pytorch_model.bin")
        torch.save(state["optimizer"], directory / "optimizer.pt")
        torch.save(state["lr_scheduler"], directory / "scheduler.pt")
        (directory / "trainer_state.json").write_text(state["trainer_state"])
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rng_file = f"rng_state_{os.environ.get('RANK', '0')}.pth" if world_size > 1 else "rng_state.pth"
        torch.save(_trainer_rng_state(state["rng"], distributed=world_size > 1), directory / rng_file)
        self._resume_dir = directory
        self.restored_step = restored.iteration
        return str(directory)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pending = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_resume_dir()  # read by now: the Trainer loads the RNG file before the first step
        # Not saved yet: the Trainer logs, evaluates and saves its own checkpoint after on_step_end
        # (`_maybe_log_save_evaluate`, and once more after on_epoch_end), and a resumed run does none of that
        # again for this step. The save waits for the next hook after all of it.
        if int(state.global_step) % self.every_n_steps == 0:
            self._pending = int(state.global_step)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # After the next step's batches were fetched, where the Trainer's resume sets the generators back.
        self._save_pending(state, kwargs)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Before the epoch's DataLoader iterator draws a seed, where the Trainer's resume at an epoch's
        # boundary sets the generators back.
        self._save_pending(state, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove_resume_dir()
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            # The Trainer loaded the best checkpoint's weights into the model (`_finalize_training`): not
            # the last step's. The step before it holds what a run resumed from it needs.
            self._pending = None
        self._save_pending(state, kwargs)
        if self._checkpointer is None:
            return
        if self._owned:
            self._checkpointer.close()
            self._checkpointer = None
        else:
            self._checkpointer.wait()

    def _save_pending(self, state: Any, kwargs: dict[str, Any]) -> None:
        step, self._pending = self._pending, None
        if step is None or step != int(state.global_step):
            return
        scheduler = kwargs.get("lr_scheduler")
        self.checkpointer.save(
            step,
            {
                "model": kwargs["model"],
                "optimizer": kwargs["optimizer"],
                "lr_scheduler": encode(scheduler.state_dict()) if scheduler is not None else None,
                "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
                "rng": rng_state(),
            },
        )

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None


def _trainer_rng_state(saved: dict[str, Any], *, distributed: bool) -> dict[str, Any]:
    """`worker_lib.rng_state()` as the Trainer's rng_state.pth has it (`Trainer._save_rng_state`)."""
    import numpy

    python = saved["python"]
    state: dict[str, Any] = {
        "python": (python["version"], tuple(python["internal"].tolist()), python["gauss_next"]),
        "cpu": saved["torch"].to(torch.uint8),
    }
    if "numpy" in saved:
        kept = saved["numpy"]
        state["numpy"] = (
            kept["kind"],
            kept["keys"].numpy().astype(numpy.uint32),
            kept["position"],
            kept["has_gauss"],
            kept["cached_gaussian"],
        )
    else:
        state["numpy"] = numpy.random.get_state()
    if "cuda" in saved:
        devices = list(saved["cuda"])
        state["cuda"] = devices if distributed else devices[torch.cuda.current_device()]
    return state
