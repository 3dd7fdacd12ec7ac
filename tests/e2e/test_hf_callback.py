"""The Hugging Face Trainer with `worker_lib.integrations.transformers.CastorCallback`: a tiny randomly
initialised GPT-2 built from a config (no hub access: HF_HUB_OFFLINE=1), trained by the real Trainer with
dropout, AdamW, a linear schedule and a shuffled dataset of 6 batches an epoch, killed with SIGKILL in the
middle of its second epoch, resumes through `trainer.train(resume_from_checkpoint=
castor.resume_from_checkpoint())` and ends bit for bit where an uninterrupted run ends (parameters,
optimizer and scheduler states); with an evaluation after every step or epoch too (and the same eval losses
and best metric)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.framework_runs import check_resumes_bit_exact

pytestmark = pytest.mark.slow


def test_a_killed_hf_trainer_resumes_bit_exact(tmp_path: Path) -> None:
    check_resumes_bit_exact("train_hf.py", tmp_path, steps=15, die_at=8, output_dir=str(tmp_path))


@pytest.mark.parametrize(("strategy", "die_at"), [("steps", 8), ("epoch", 6)])
def test_a_hf_trainer_killed_after_an_evaluation_resumes_bit_exact(
    tmp_path: Path, strategy: str, die_at: int
) -> None:
    """Evaluating after every step (or epoch: step 6 ends the first) draws from torch's generator (the eval
    DataLoader's iterator) and adds to the TrainerState (log_history, best_metric), after on_step_end (or
    on_epoch_end): a checkpoint of step die_at taken before that evaluation resumes one draw early and
    without it."""
    check_resumes_bit_exact(
        "train_hf.py", tmp_path, steps=15, die_at=die_at, output_dir=str(tmp_path), eval=strategy
    )
