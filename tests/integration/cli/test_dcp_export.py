"""`castor checkpoints export`: a persisted checkpoint of a real root service (its local persistent tier),
downloaded rank by rank and written as a DCP directory that plain `dcp.load` reads in this one process."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.integration.cli.conftest import Root, castor, castor_on_tty, create_job, unique
from worker_lib import Checkpointer
from worker_lib.persistent import LocalDirStore
from worker_lib.persistent_keys import shard_key
from worker_lib.store.slots import SlotStore

ITERATION = 12


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


@pytest.fixture(scope="module")
def persisted(root: Root) -> Iterator[tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """A 2-machine job whose ranks (a replicated, DDP-like state) persisted iteration ITERATION."""
    job = create_job(root, unique("export"), machines=2)
    worker = {"Authorization": f"Bearer {job['worker_token']}"}
    trained = model(1)
    expected = {key: value.clone() for key, value in trained.state_dict().items()}
    tier = LocalDirStore(root.state_dir / "persistent")
    scratch = Path(tempfile.mkdtemp(prefix="castor-export-test-", dir="/dev/shm"))
    try:
        for rank in range(2):
            response = httpx.post(
                f"{root.url}/api/v1/worker/jobs/{job['id']}/machines",
                json={"instance_id": f"i-{rank}", "address": "127.0.0.1", "data_port": 7000 + rank},
                headers=worker,
                timeout=10,
            )
            assert response.status_code == 200 and response.json()["rank"] == rank, response.text
            with Checkpointer(scratch / f"rank-{rank}") as checkpointer:
                checkpointer.save(ITERATION, {"model": trained, "epoch": 3})
            key = shard_key("castor", job["id"], ITERATION, rank)
            with SlotStore(scratch / f"rank-{rank}").open_read(ITERATION) as (manifest, data):
                asyncio.run(tier.put(key, manifest, data))
            report = {
                "instance_id": f"i-{rank}",
                "rank": rank,
                "iteration": ITERATION,
                "digest": manifest.digest,
                "nbytes": manifest.data_bytes,
            }
            response = httpx.post(
                f"{root.url}/api/v1/worker/jobs/{job['id']}/machines/{rank}/persisted",
                json=report,
                headers=worker,
                timeout=10,
            )
            assert response.status_code == 204, response.text
        yield job, expected
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load(directory: Path) -> tuple[dict[str, torch.Tensor], Any]:
    fresh = model(2)
    state = {"model": fresh.state_dict(), "epoch": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))
    return fresh.state_dict(), state["epoch"]


def test_export_writes_a_directory_plain_dcp_load_reads(root: Root, persisted: Any, tmp_path: Path) -> None:
    job, expected = persisted
    out = tmp_path / "exported"
    # Without --iteration: the newest complete persisted checkpoint.
    result = castor(root, "checkpoints", "export", job["name"], "--to", str(out), "--json", timeout=240)
    assert result.returncode == 0, result.stderr
    # Its scratch stores sit next to the target (on storage, as meant): no warning about that.
    assert "SlotsOnDiskWarning" not in result.stderr, result.stderr
    document = result.json()
    assert (document["iteration"], document["ranks"], document["directory"]) == (ITERATION, 2, str(out))
    loaded, epoch = load(out)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)
    assert epoch == 3
    assert not list(tmp_path.glob(".castor-export-*")), "the downloaded shards are removed"


def test_export_shows_a_progress_bar_on_a_terminal(root: Root, persisted: Any, tmp_path: Path) -> None:
    job, _ = persisted
    args = ("checkpoints", "export", job["id"], "--iteration", str(ITERATION), "--to", str(tmp_path / "out"))
    code, screen = castor_on_tty(root, *args, timeout=240)  # imports torch: slow on a loaded machine
    assert code == 0, screen
    assert "downloading 2/2 ranks" in screen and "writing" in screen and "100%" in screen
    assert f"Exported iteration {ITERATION} of {job['name']} (2 ranks" in screen
    assert "FileSystemReader" in screen


def test_export_refuses_an_iteration_not_persisted_and_a_used_directory(
    root: Root, persisted: Any, tmp_path: Path
) -> None:
    job, _ = persisted
    missing = castor(root, "checkpoints", "export", job["name"], "--iteration", "13", "--to", str(tmp_path))
    assert missing.returncode == 1
    assert f"no persisted checkpoint of iteration 13 (persisted: {ITERATION})" in missing.stderr
    assert "worker_lib.export_dcp" in missing.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    used = castor(root, "checkpoints", "export", job["name"], "--to", str(tmp_path / "used"))
    assert used.returncode == 1 and "is not an empty directory" in used.stderr
    # A directory that cannot be made (its parent is a file): before, a traceback.
    unmade = castor(root, "checkpoints", "export", job["name"], "--to", str(tmp_path / "used" / "file" / "x"))
    assert unmade.returncode == 1 and "cannot write the export to" in unmade.stderr
    assert "Traceback" not in unmade.stderr
