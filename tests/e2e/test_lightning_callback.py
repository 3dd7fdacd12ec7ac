"""PyTorch Lightning with `worker_lib.integrations.lightning.CastorCallback`: a tiny randomly initialised
model (dropout, AdamW, a per-step LR schedule, epochs of 6 batches) trained by the real Trainer, killed with
SIGKILL in the middle of its second epoch, resumes from Castor's newest checkpoint by itself and ends bit
for bit where an uninterrupted run ends (parameters, optimizer and scheduler states)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.framework_runs import check_resumes_bit_exact

pytestmark = pytest.mark.slow


def test_a_killed_lightning_fit_resumes_bit_exact(tmp_path: Path) -> None:
    check_resumes_bit_exact("train_lightning.py", tmp_path, steps=15, die_at=8)
