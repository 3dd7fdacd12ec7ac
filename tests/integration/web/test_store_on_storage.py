"""A machine whose checkpoint directory is on storage (ext4, NFS) instead of memory says so in its heartbeats
(worker_lib.agent.services): the job's page, its API, /metrics and `castor jobs show` name the machines,
since the training processes' own warning reaches only their stderr."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from services.cli import jobs
from tests.integration.api.test_jobs import assert_error
from tests.integration.web.scenario import running_job
from tests.integration.web.test_metrics import Samples, scrape
from tests.integration.web.test_pages import text_of
from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.store import slots as slots_module


async def test_machines_whose_checkpoints_are_on_storage_are_named_on_the_page_api_and_cli(
    signed_in: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await running_job(signed_in)
    # Machine 1's agent: its directory on an ext4 root (as the kernel's mountinfo would say).
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    monkeypatch.setattr(slots_module, "_MOUNTINFO", mountinfo)
    agent = MachineServices(
        SimpleNamespace(job_id=job.id),  # type: ignore[arg-type]
        str(job.job["worker_token"]),
        MachineIdentity(job.instances[1]),
        tmp_path / "shm",
    )

    async def heartbeat(rank: int, **extra: Any) -> httpx.Response:
        summary = {"local": {str(rank): 30}, "committed": 31, **extra}
        body = {"instance_id": job.instances[rank], "summary": summary}
        return await signed_in.post(
            f"/api/v1/worker/jobs/{job.id}/machines/{rank}/heartbeat", json=body, headers=job.worker
        )

    page = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert "Checkpoints on storage" not in page and "on ext4" not in page
    assert (await heartbeat(1, **agent.summary())).status_code == 200
    assert (await heartbeat(3, store_filesystem="nfs4")).status_code == 200
    page = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert "Checkpoints on storage, not in memory on 2 machines: machine 1 (ext4), machine 3 (nfs4)." in page
    assert "checkpoints on ext4" in page and "checkpoints on nfs4" in page  # the machines' boxes
    machines = await job.api("/machines")
    assert [m["summary"].get("store_filesystem") for m in machines] == [None, "ext4", None, "nfs4"]
    name = str(job.job["name"])
    assert on_storage(await scrape(signed_in), name) == {("1", "ext4"), ("3", "nfs4")}
    fields = dict(jobs._job_fields(await job.api(""), datetime.now(UTC), machines))
    assert fields["checkpoint store"] == (
        "on storage, not memory: machine 1 (ext4), machine 3 (nfs4) (give --shm-dir a tmpfs)"
    )

    # Machine 1's agent restarted with its directory in memory: it is no longer named.
    assert (await heartbeat(1)).status_code == 200
    page = text_of((await signed_in.get(f"/jobs/{job.id}")).text)
    assert "on 1 machine: machine 3 (nfs4)." in page and "checkpoints on ext4" not in page
    assert on_storage(await scrape(signed_in), name) == {("3", "nfs4")}
    machines = await job.api("/machines")
    fields = dict(jobs._job_fields(await job.api(""), datetime.now(UTC), machines))
    assert fields["checkpoint store"] == "on storage, not memory: machine 3 (nfs4) (give --shm-dir a tmpfs)"

    # Not a filesystem's name: refused with the API's error shape, and the machine's last summary kept.
    for bad in ("x" * 65, 4, "ext4\x00"):
        error = assert_error(await heartbeat(3, store_filesystem=bad), 422, "validation_error")
        assert "store_filesystem" in str(error)
    machines = await job.api("/machines")
    assert machines[3]["summary"]["store_filesystem"] == "nfs4"


def on_storage(samples: Samples, job: str) -> set[tuple[str, str]]:
    """(machine, filesystem) of the job's castor_machine_checkpoints_on_storage samples, each 1."""
    found = set()
    for (name, labels), sample in samples.items():
        label = dict(labels)
        if name == "castor_machine_checkpoints_on_storage" and label["job"] == job:
            assert sample == 1
            found.add((label["machine"], label["filesystem"]))
    return found
