"""The Lightning callback outside fit: `trainer.test(ckpt_path=...)` restores every callback's state from the
file, this one's included (the generators as they stood at a training step). The real Trainer, in-process:
a tiny model fitted for one epoch with Lightning's own ModelCheckpoint beside Castor's callback."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

pl = pytest.importorskip("lightning.pytorch")

from tests.e2e.workloads.train_lightning import BATCHES_PER_EPOCH, Regression, cpu_trainer  # noqa: E402
from worker_lib import Checkpointer  # noqa: E402
from worker_lib.integrations.lightning import CastorCallback  # noqa: E402


class WithTestStep(Regression):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.net(torch.randn(8, 16))

    def test_dataloader(self) -> DataLoader[int]:
        return DataLoader(range(2), batch_size=1)


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def trainer(callbacks: list[Any], root: Path, **options: Any) -> Any:
    return cpu_trainer(callbacks, default_root_dir=root, **options)


def test_a_test_from_a_file_checkpoint_leaves_the_generators_alone(tmp_path: Path, shm_dir: Path) -> None:
    """Before, the callback set the process's generators back to the training step's state whenever the
    file was saved at an epoch's end: a test (or validate) from a checkpoint file rewound torch's, numpy's
    and Python's generators."""
    files = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "files", save_on_train_epoch_end=True)
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        fitting = trainer(
            [CastorCallback(checkpointer), files], tmp_path, max_steps=BATCHES_PER_EPOCH, max_epochs=1
        )
        fitting.fit(WithTestStep())
        checkpoint = files.best_model_path
        assert checkpoint

        after_test = []
        for callbacks in ([CastorCallback(checkpointer)], []):  # with Castor's callback, and without
            torch.manual_seed(123)
            trainer(callbacks, tmp_path).test(WithTestStep(), ckpt_path=checkpoint)
            after_test.append(torch.get_rng_state())
    assert torch.equal(after_test[0], after_test[1])
