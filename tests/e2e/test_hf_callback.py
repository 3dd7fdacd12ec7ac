"""The Hugging Face Trainer with `worker_lib.integrations.transformers.CastorCallback`: a tiny randomly
initialised GPT-2 built from a config (no hub access: HF_HUB_OFFLINE=1), trained by the real Trainer with
dropout, AdamW, a linear schedule and a shuffled dataset of 6 batches an epoch, killed with SIGKILL in the
middle of its second epoch, resumes through `trainer.train(resume_from_checkpoint=
castor.resume_from_checkpoint())` and ends bit for bit where an uninterrupted run ends (parameters,
optimizer and scheduler states)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.framework_runs import check_resumes_bit_exact

pytestmark = pytest.mark.slow


def test_a_killed_hf_trainer_resumes_bit_exact(tmp_path: Path) -> None:
    check_resumes_bit_exact("train_hf.py", tmp_path, steps=15, die_at=8, output_dir=str(tmp_path))
