"""PyTorch Lightning with `worker_lib.integrations.lightning.CastorCallback`: a tiny randomly initialised
model (dropout, AdamW, a per-step LR schedule, epochs of 6 batches) trained by the real Trainer, killed with
SIGKILL in the middle of its second epoch, resumes from Castor's newest checkpoint by itself and ends bit
for bit where an uninterrupted run ends (parameters, optimizer and scheduler states); with gradient
accumulation, killed before its first optimizer step, it starts over and ends there too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.framework_runs import check_resumes_bit_exact

pytestmark = pytest.mark.slow


def test_a_killed_lightning_fit_resumes_bit_exact(tmp_path: Path) -> None:
    check_resumes_bit_exact("train_lightning.py", tmp_path, steps=15, die_at=8)


def test_a_lightning_fit_killed_before_its_first_optimizer_step_starts_over(tmp_path: Path) -> None:
    """Accumulating 2 batches a step, global_step is still 0 after the first batch: a checkpoint taken
    there would resume at the second batch with the first one's gradient lost. None is taken before the
    first optimizer step, so the killed run starts over and ends where the uninterrupted one does. (Saves
    block, so that one taken there would be committed before the kill.)"""
    check_resumes_bit_exact(
        "train_lightning.py", tmp_path, steps=6, die_at=0, restored=(None,), accumulate="2", blocking=""
    )
