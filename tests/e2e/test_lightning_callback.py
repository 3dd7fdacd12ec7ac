"""PyTorch Lightning with `worker_lib.integrations.lightning.CastorCallback`: a tiny randomly initialised
model (dropout, AdamW, a per-step LR schedule, epochs of 6 batches) trained by the real Trainer, killed with
SIGKILL in the middle of its second epoch, resumes from Castor's newest checkpoint by itself and ends bit
for bit where an uninterrupted run ends (parameters, optimizer and scheduler states); with gradient
accumulation, killed before its first optimizer step, it starts over and ends there too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.framework_runs import REPO, TIMEOUT_S, check_resumes_bit_exact, environment, log_tail
from worker_lib.store.slots import SlotStore

pytestmark = pytest.mark.slow


def test_a_killed_lightning_fit_resumes_bit_exact(tmp_path: Path) -> None:
    check_resumes_bit_exact("train_lightning.py", tmp_path, steps=15, die_at=8)


def test_a_lightning_fit_killed_at_the_end_of_an_epoch_resumes_bit_exact(tmp_path: Path) -> None:
    """Step 6 ends the first epoch. The next epoch's dataloader iterator draws a seed from torch's
    generator; a resumed fit makes it before on_train_start, where the generators used to be set back, so
    the resumed run's dropout diverged from the first batch on. (Saves block: the resume is from step 6.)"""
    check_resumes_bit_exact("train_lightning.py", tmp_path, steps=9, die_at=6, restored=(6,), blocking="")


def test_a_lightning_fit_with_weight_averaging_resumes_its_average_bit_exact(tmp_path: Path) -> None:
    """WeightAveraging's on_save_checkpoint puts the averaged weights in the checkpoint's state_dict (the
    live ones under current_model_state); before, the callback replaced them with the live module, the
    resume reset the average to the live weights, and the model the fit ends with (the average) differed."""
    check_resumes_bit_exact(
        "train_lightning.py", tmp_path, steps=15, die_at=8, restored=(8,), blocking="", ema=""
    )


def test_a_lightning_fit_killed_before_its_first_optimizer_step_starts_over(tmp_path: Path) -> None:
    """Accumulating 2 batches a step, global_step is still 0 after the first batch: a checkpoint taken
    there would resume at the second batch with the first one's gradient lost. None is taken before the
    first optimizer step, so the killed run starts over and ends where the uninterrupted one does. (Saves
    block, so that one taken there would be committed before the kill.)"""
    check_resumes_bit_exact(
        "train_lightning.py", tmp_path, steps=6, die_at=0, restored=(None,), accumulate="2", blocking=""
    )


def test_each_ddp_rank_of_a_lightning_script_saves_into_its_own_store(tmp_path: Path) -> None:
    """Lightning's launcher sets no RANK: before, every rank's callback opened rank 0's store, the ranks
    raced for its two slots, and a resume restored whichever rank's checkpoint was newest."""
    job = f"castor-test-{uuid.uuid4().hex[:8]}"
    stores = Path("/dev/shm") / f"castor-{os.getuid()}" / job
    env = {**environment(), "CASTOR_JOB": job}
    env.pop("RANK", None)
    command = [sys.executable, str(REPO / "tests/e2e/workloads/train_lightning.py"), "--shm=-", "--out=-"]
    try:
        with (tmp_path / "ddp.log").open("wb") as log:
            finished = subprocess.run(
                [*command, "--ddp=2", "--steps=3"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=TIMEOUT_S,
            )
        assert finished.returncode == 0, log_tail(tmp_path, "ddp")
        held = {
            path.name: sorted((m.iteration, m.meta["rank"]) for m in SlotStore(path).committed())
            for path in stores.iterdir()
        }
        assert held == {"rank-0": [(2, 0), (3, 0)], "rank-1": [(2, 1), (3, 1)]}, held
    finally:
        shutil.rmtree(stores, ignore_errors=True)
