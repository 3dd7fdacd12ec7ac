"""Worker API on Postgres and SQLite: idempotent registration (also under concurrency), heartbeats,
process exits, the current recovery plan."""

from __future__ import annotations

import asyncio

import httpx

from tests.integration.api.test_jobs import assert_error
from tests.integration.conftest import admin, bearer, create_job


def registration(instance: str, port: int = 7000, **extra: object) -> dict[str, object]:
    return {"instance_id": instance, "address": "127.0.0.1", "data_port": port} | extra


async def register(
    client: httpx.AsyncClient, job: dict[str, object], instance: str, **extra: object
) -> httpx.Response:
    return await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines",
        json=registration(instance, **extra),
        headers=bearer(str(job["worker_token"])),
    )


async def test_registration_is_idempotent_and_starts_the_job(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=4, replicas=2)
    first = (await register(client, job, "i-a")).json()
    again = (await register(client, job, "i-a", port=7100)).json()
    assert first["rank"] == again["rank"] == 0 and first["machine_id"] == again["machine_id"]
    assert first["placement"]["groups"][0]["members"] == [0, 1]
    assert first["heartbeat"]["mode"] == "rest" and first["plan_generation"] == 1
    assert [p["rank"] for p in first["peers"]] == [1] and first["peers"][0]["address"] is None

    for instance in ("i-b", "i-c", "i-d"):
        assert (await register(client, job, instance)).status_code == 200
    machines = (await client.get(f"/api/v1/jobs/{job['id']}/machines", headers=admin())).json()
    assert [(m["rank"], m["instance_id"], m["state"]) for m in machines] == [
        (0, "i-a", "healthy"),
        (1, "i-b", "healthy"),
        (2, "i-c", "healthy"),
        (3, "i-d", "healthy"),
    ]
    assert machines[0]["data_port"] == 7100, "re-registration takes the new address"
    state = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert state["state"] == "running" and state["machines_healthy"] == 4
    assert_error(await register(client, job, "i-e"), 409, "job_full")


async def test_concurrent_registration_gives_distinct_ranks(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=6, replicas=2)
    instances = [f"i-{n}" for n in range(6)]
    # Every instance registers three times at once: retries from an impatient agent.
    responses = await asyncio.gather(*(register(client, job, i) for i in instances * 3))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    ranks: dict[str, set[int]] = {}
    for instance, response in zip(instances * 3, responses, strict=True):
        ranks.setdefault(instance, set()).add(response.json()["rank"])
    assert all(len(r) == 1 for r in ranks.values()), "one instance, one rank"
    assert sorted(next(iter(r)) for r in ranks.values()) == list(range(6)), "ranks are distinct"


async def test_requested_rank(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2, replicas=2)
    assert (await register(client, job, "i-x", rank=1)).json()["rank"] == 1
    assert_error(await register(client, job, "i-y", rank=1), 409, "rank_taken")
    assert_error(await register(client, job, "i-y", rank=5), 409, "rank_out_of_range")
    assert_error(await register(client, job, "i-x", rank=0), 409, "rank_mismatch")
    assert (await register(client, job, "i-y")).json()["rank"] == 0


async def test_a_registration_is_in_the_next_directive_at_once(client: httpx.AsyncClient) -> None:
    """The directive is cached for a moment; a registration drops that copy, or a replacement's first poll
    could show its rank still held by the machine it displaced (and the agent stops as "replaced")."""
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    await register(client, job, "i-0")
    await register(client, job, "i-1")
    before = (await client.get(url, headers=token)).json()  # read, and cached
    assert [(m["rank"], m["data_port"]) for m in before["machines"]] == [(0, 7000), (1, 7000)]
    await register(client, job, "i-1", port=7100)  # the agent restarted on a new port
    after = (await client.get(url, headers=token)).json()
    assert [(m["rank"], m["data_port"]) for m in after["machines"]] == [(0, 7000), (1, 7100)]


async def test_a_registration_sent_again_by_the_same_agent_is_no_restart(client: httpx.AsyncClient) -> None:
    """An agent whose registration's answer was lost (a read timeout, a root replica restarting) sends it
    again: before, the running job recorded "the agent of machine 1 restarted", and during a recovery that
    counted as the recovery failing. A new agent process (another session) is a restart."""
    job = await create_job(client, machines=2, replicas=2)
    sessions = {"i-0": "a" * 32, "i-1": "b" * 32}
    for instance, session in sessions.items():
        assert (await register(client, job, instance, agent_session=session)).status_code == 200
    admin_job = f"/api/v1/jobs/{job['id']}"
    assert (await client.get(admin_job, headers=admin())).json()["state"] == "running"
    again = await register(client, job, "i-1", agent_session=sessions["i-1"])
    assert again.status_code == 200 and again.json()["rank"] == 1
    assert (await client.get(f"{admin_job}/failures", headers=admin())).json() == []
    restarted = await register(client, job, "i-1", port=7100, agent_session="c" * 32)
    assert restarted.status_code == 200
    (failure,) = (await client.get(f"{admin_job}/failures", headers=admin())).json()
    assert "restarted" in failure["cause"]


async def test_heartbeat_updates_counters(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    for rank, instance in enumerate(("i-0", "i-1")):
        await register(client, job, instance)
        summary = {
            "local": {str(rank): 40 + rank},
            "replicas": {str(1 - rank): 39},
            "committed": 41,
            "skipped": rank,
            "per_minute": 60.0 - rank,
        }
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
            json={"instance_id": instance, "summary": summary},
            headers=token,
        )
        assert response.status_code == 200, response.text
        assert response.json()["peers"][0]["rank"] == 1 - rank
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["newest_iteration"] == 40, "the iteration every rank has committed"
    assert fetched["checkpoints_committed"] == 82 and fetched["checkpoints_skipped"] == 1
    assert fetched["checkpoints_per_minute"] == 59.0
    # Heartbeats without a rate (each machine's training process restarted, one commit each so far): the
    # rate measured last stands, so lost iterations are still charged their time.
    for rank, instance in enumerate(("i-0", "i-1")):
        summary = {"local": {str(rank): 42}, "committed": 42, "per_minute": None}
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
            json={"instance_id": instance, "summary": summary},
            headers=token,
        )
        assert response.status_code == 200, response.text
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["newest_iteration"] == 42 and fetched["checkpoints_per_minute"] == 59.0
    # A heartbeat from an instance that does not hold the rank is refused.
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/heartbeat", json={"instance_id": "i-1"}, headers=token
    )
    assert_error(response, 409, "not_registered")
    bad = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/0/heartbeat",
        json={"instance_id": "i-0", "summary": {"local": {"zero": 1}}},
        headers=token,
    )
    assert_error(bad, 422, "validation_error")


async def test_a_summary_claiming_ranks_its_machine_does_not_run_moves_no_counter(
    client: httpx.AsyncClient,
) -> None:
    """Before, machine 0 claiming rank 1's newest iteration (a rank machine 1 runs) set the job's newest
    iteration, which the counters take as each rank's highest claim, and a rank outside the job left it
    unknown; the persist schedule follows the same summaries. Entries of ranks a machine neither runs nor
    can replicate are now ignored; the rest of its summary stands."""
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    summaries = {
        0: {
            "local": {"0": 41, "1": 10_000, "7": 10_000},
            "replicas": {"0": 10_000, "1": 39},
            "committed": 41,
        },
        1: {"local": {"1": 40}, "replicas": {"0": 39}, "committed": 40},
    }
    for instance in ("i-0", "i-1"):
        await register(client, job, instance)
    for rank, instance in enumerate(("i-0", "i-1")):
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/heartbeat",
            json={"instance_id": instance, "summary": summaries[rank]},
            headers=token,
        )
        assert response.status_code == 200, response.text
    fetched = (await client.get(f"/api/v1/jobs/{job['id']}", headers=admin())).json()
    assert fetched["newest_iteration"] == 40 and fetched["checkpoints_committed"] == 81


async def test_exit_reports_open_failures_only_for_crashes(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    await register(client, job, "i-0")
    await register(client, job, "i-1")
    url = f"/api/v1/worker/jobs/{job['id']}/machines/0/exits"
    clean = await client.post(
        url, json={"instance_id": "i-0", "local_rank": 0, "global_rank": 0, "exit_code": 0}, headers=token
    )
    assert clean.status_code == 202 and clean.json() == {"failure_id": None}
    killed = await client.post(
        url, json={"instance_id": "i-0", "local_rank": 0, "global_rank": 0, "exit_code": -9}, headers=token
    )
    failure_id = killed.json()["failure_id"]
    event = (await client.get(f"/api/v1/jobs/{job['id']}/failures/{failure_id}", headers=admin())).json()
    assert event["kind"] == "software" and "SIGKILL" in event["cause"] and event["rank"] == 0
    assert event["detected_at"] and event["classified_at"]


async def test_current_recovery_plan(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2)
    plan = await client.get(
        f"/api/v1/worker/jobs/{job['id']}/recovery-plan", headers=bearer(str(job["worker_token"]))
    )
    assert plan.status_code == 200 and plan.json()["generation"] == 1 and plan.json()["iteration"] is None


async def test_directive_waits_for_all_machines_then_releases_the_start(client: httpx.AsyncClient) -> None:
    job = await create_job(client, machines=2, replicas=2)
    token = bearer(str(job["worker_token"]))
    url = f"/api/v1/worker/jobs/{job['id']}/directive"
    await register(client, job, "i-0", rendezvous_port=29500)
    first = (await client.get(url, headers=token)).json()
    assert first["status"] == "pending" and first["rendezvous"] is None

    # A long poll started now returns as soon as the last machine registers, with the new revision.
    poll = asyncio.create_task(
        client.get(url, params={"after": first["revision"], "wait": 20}, headers=token)
    )
    await asyncio.sleep(0.3)
    assert not poll.done(), "nothing changed yet: the long poll waits"
    await register(client, job, "i-1", address="10.0.0.2")
    ready = (await asyncio.wait_for(poll, timeout=10)).json()
    assert ready["revision"] > first["revision"] and ready["status"] == "ready"
    assert ready["iteration"] is None and ready["world_size"] == 2 and ready["generation"] == 1
    assert ready["rendezvous"] == {"master_addr": "127.0.0.1", "master_port": 29500}, (
        "machine 0 hosts the store"
    )

    # Every machine's processes finish cleanly: the job completes and agents are told to exit.
    for rank, instance in enumerate(("i-0", "i-1")):
        response = await client.post(
            f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/progress",
            json={"instance_id": instance, "generation": 1, "event": "finished"},
            headers=token,
        )
        assert response.status_code == 204, response.text
    done = (await client.get(url, params={"after": ready["revision"]}, headers=token)).json()
    assert done["status"] == "finished" and done["job_state"] == "completed"


async def report_persisted(
    client: httpx.AsyncClient, job: dict[str, object], rank: int, iteration: int, generation: int, digest: str
) -> None:
    body = {
        "instance_id": f"i-{rank}",
        "rank": rank,
        "iteration": iteration,
        "generation": generation,
        "key": f"castor/{job['id']}/iteration-{iteration}/rank-{rank}/gen-{generation}",
        "digest": digest,
        "nbytes": 64,
    }
    response = await client.post(
        f"/api/v1/worker/jobs/{job['id']}/machines/{rank}/persisted",
        json=body,
        headers=bearer(str(job["worker_token"])),
    )
    assert response.status_code == 204, response.text


async def two_registered(client: httpx.AsyncClient, **fields: object) -> dict[str, object]:
    job = await create_job(client, machines=2, replicas=2, **fields)
    for instance in ("i-0", "i-1"):
        assert (await register(client, job, instance)).status_code == 200
    return job


async def test_persisted_checkpoints_beyond_the_newest_p_complete_ones_expire(
    client: httpx.AsyncClient,
) -> None:
    job = await two_registered(client, keep_persisted=2)
    await report_persisted(client, job, 0, 5, 1, "half")  # incomplete, older than the kept ones
    for iteration in (10, 20, 30):
        for rank in (0, 1):
            await report_persisted(client, job, rank, iteration, 1, f"d{iteration}{rank}")
    checkpoints = (await client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=admin())).json()
    assert [c["iteration"] for c in checkpoints] == [30, 20]


async def test_a_late_upload_from_before_a_rollback_does_not_replace_the_newer_shard(
    client: httpx.AsyncClient,
) -> None:
    job = await two_registered(client)
    await report_persisted(client, job, 0, 10, 2, "new0")
    await report_persisted(client, job, 0, 10, 1, "old0")
    checkpoints = (await client.get(f"/api/v1/jobs/{job['id']}/checkpoints", headers=admin())).json()
    assert [(s["rank"], s["digest"]) for s in checkpoints[0]["shards"]] == [(0, "new0")]
