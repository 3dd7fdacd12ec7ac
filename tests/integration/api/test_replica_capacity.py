"""A job's per-rank checkpoint capacity, on Postgres and SQLite: stored with the job, handed to every
machine at registration, checked by the agent against its shared memory for its own ranks and the replicas
the placement puts on it, and the bound its data plane holds peers to."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.api.test_jobs import assert_error
from tests.integration.api.test_worker import register
from tests.integration.conftest import admin, create_job
from worker_lib.agent.services import MachineIdentity, MachineServices
from worker_lib.api.worker import RegisterResponse
from worker_lib.client import RootClient
from worker_lib.errors import ShmCapacityError
from worker_lib.store.slots import free_bytes


@pytest.fixture
def shm() -> Iterator[Path]:
    path = Path("/dev/shm") / f"castor-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def machine_services(job: dict[str, object], registration: dict[str, object], shm: Path) -> MachineServices:
    token = str(job["worker_token"])
    services = MachineServices(
        RootClient(["http://127.0.0.1:9"], str(job["id"]), token), token, MachineIdentity("i-a"), shm
    )
    services.registration = RegisterResponse.model_validate(registration)
    return services


async def test_the_capacity_goes_from_the_job_to_every_machine_and_bounds_replicas(
    client: httpx.AsyncClient, shm: Path
) -> None:
    job = await create_job(client, machines=4, replicas=2, procs_per_machine=2, checkpoint_bytes_max=1 << 20)
    assert job["checkpoint_bytes_max"] == 1 << 20
    listed = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert listed["checkpoint_bytes_max"] == 1 << 20
    registration = (await register(client, job, "i-a")).json()
    assert registration["checkpoint_bytes_max"] == 1 << 20

    services = machine_services(job, registration, shm)
    services.capacity = services._rank_capacity()
    assert services.capacity == 1 << 20
    # Machine 0 holds replicas of machine 1's ranks (2 and 3): the data plane bounds them by the job's figure.
    assert services.holds_replicas_of(2)
    assert services.holdings.replica_bytes_max(2) == 1 << 20
    assert services.holdings.replica_store(2).max_bytes == 1 << 20


async def test_a_capacity_that_shared_memory_cannot_hold_fails_at_registration(
    client: httpx.AsyncClient, shm: Path
) -> None:
    free, _ = free_bytes(Path("/dev/shm"))
    # Two own ranks and two replica ranks, two slots each: 8 x free / 4 does not fit.
    job = await create_job(
        client, machines=4, replicas=2, procs_per_machine=2, checkpoint_bytes_max=free // 4
    )
    registration = (await register(client, job, "i-a")).json()
    with pytest.raises(ShmCapacityError, match="Give shared memory at least"):
        machine_services(job, registration, shm)._rank_capacity()


async def test_without_a_capacity_each_agent_takes_an_equal_share(
    client: httpx.AsyncClient, shm: Path
) -> None:
    job = await create_job(client, machines=4, replicas=2, procs_per_machine=2)
    assert job["checkpoint_bytes_max"] is None
    registration = (await register(client, job, "i-a")).json()
    assert registration["checkpoint_bytes_max"] is None
    free, _ = free_bytes(Path("/dev/shm"))
    share = machine_services(job, registration, shm)._rank_capacity()
    # Free memory read on both sides: a test running beside this one may free some meanwhile.
    free = max(free, free_bytes(Path("/dev/shm"))[0])
    assert 0 < share <= free // 8 + (1 << 20)  # 4 ranks kept, 2 slots each


@pytest.mark.parametrize("value", [0, -1, "1048576", True, 1.5, 2**63])
async def test_a_bad_capacity_is_refused(client: httpx.AsyncClient, value: object) -> None:
    response = await client.post(
        "/api/v1/jobs",
        json={"name": f"job-{uuid.uuid4().hex[:8]}", "machines": 2, "checkpoint_bytes_max": value},
        headers=admin(),
    )
    assert_error(response, 422, "validation_error")
