from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker_lib.store.copy import CopyEngine

_CASTOR_ENV = (
    "CASTOR_SHM_DIR",
    "CASTOR_JOB",
    "CASTOR_AGENT_NOTIFY",
    "CASTOR_RESTORE_ITERATION",
    "CASTOR_STORE_TEST_PAUSE_AT",
    "CASTOR_CUDA_DIRECT",
    "RANK",
    "WORLD_SIZE",
)


@pytest.fixture(autouse=True)
def clean_castor_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start without the variables a worker agent would set."""
    for name in _CASTOR_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh store directory in /dev/shm, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="castor-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def engine() -> Iterator[CopyEngine]:
    copy_engine = CopyEngine(threads=2)
    yield copy_engine
    copy_engine.close()
