"""The one client of the root's API (worker_lib.client.RootClient) on worker_lib.rest's tenacity policy.
As the agent uses it: a dropped connection or a 5xx moves to the next root replica at once and is retried
within the call's budget; a 4xx is the root's answer, raised at once as RootRejected with the API's error
code; a spent budget is RootUnavailable. As the operator CLI drives it (services.cli.client.CliClient):
reads retried when their answer failed on the way, writes sent once. Answers come back as the API's
pydantic models. The root is an httpx.MockTransport: what is under test is the client, not a server."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import httpx
import pytest

from services.cli import client as cli_client
from worker_lib import rest
from worker_lib.api.public import FailureOut, JobPage
from worker_lib.api.worker import DirectiveOut, RegisterResponse
from worker_lib.client import RootClient, RootRejected, RootUnavailable, UnexpectedAnswer, first_replica

Handler = Callable[[httpx.Request], httpx.Response]


def _client(
    urls: list[str], handler: Handler, retry_for_s: float = 30.0, spread_key: str | None = None
) -> tuple[RootClient, list[str]]:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.host}:{request.url.port}")
        return handler(request)

    client = RootClient(
        urls,
        "job-1",
        "castor-job.x",
        retry_for_s=retry_for_s,
        transport=httpx.MockTransport(record),
        spread_key=spread_key,
    )
    return client, seen


JOB_ID = "0b7f6a9e-3c1d-4a5b-9e8f-1a2b3c4d5e6f"
PLACEMENT = {
    "strategy": "group",
    "machines": 2,
    "replicas": 2,
    "groups": [{"index": 0, "kind": "group", "members": [0, 1]}],
    "ranks": [
        {"rank": 0, "holders": [0, 1], "sends_to": [1]},
        {"rank": 1, "holders": [1, 0], "sends_to": [0]},
    ],
    "recovery_probability": {"1": 1.0, "2": 0.0},
}
REGISTERED = {
    "machine_id": 7,
    "rank": 3,
    "job_id": JOB_ID,
    "machines": 2,
    "replicas": 2,
    "procs_per_machine": 1,
    "persist_every": 10,
    "checkpoint_bytes_max": None,
    "placement": PLACEMENT,
    "peers": [{"rank": 1, "address": "10.0.0.2", "data_port": 7001, "state": "healthy"}],
    "heartbeat": {"mode": "rest", "interval_s": 1.0, "timeout_s": 5.0},
    "plan_generation": None,
    "persistent": {"kind": "local", "prefix": "castor", "path": "/tmp/persisted"},
}


async def test_a_dead_replica_hands_the_call_to_the_next_one() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port == 8001:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=REGISTERED)

    client, seen = _client(["http://a:8001", "http://b:8002"], handler)
    async with client:
        assert (await client.register(instance_id="i-1")).rank == 3
        assert seen == ["a:8001", "b:8002"]
        # The replica that answered is asked first next time.
        assert await client.report_progress(3, {"event": "resumed"}) is None
        assert seen[-1] == "b:8002" and len(seen) == 3


async def test_a_5xx_is_retried_and_a_4xx_is_not() -> None:
    answers = [httpx.Response(503, text="overloaded"), httpx.Response(204)]
    client, seen = _client(["http://a:8001"], lambda request: answers.pop(0))
    async with client:
        assert await client.report_inventory(0, {}) is None
    assert len(seen) == 2

    error = {"error": {"code": "machine_replaced", "message": "rank 0 is held by i-2", "details": {}}}
    client, seen = _client(["http://a:8001"], lambda request: httpx.Response(409, json=error))
    async with client:
        with pytest.raises(RootRejected) as rejected:
            await client.heartbeat(0, "i-1", {})
    assert (rejected.value.status, rejected.value.code) == (409, "machine_replaced")
    assert rejected.value.message == "rank 0 is held by i-2" and len(seen) == 1

    client, _ = _client(["http://a:8001"], lambda request: httpx.Response(404, text="<html>nope</html>"))
    async with client:
        with pytest.raises(RootRejected) as not_json:
            await client.report_persisted(0, {})
    assert (not_json.value.code, not_json.value.message) == ("http_error", "<html>nope</html>")


async def test_a_spent_budget_is_root_unavailable() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client, seen = _client(["http://a:8001", "http://b:8002"], handler, retry_for_s=0.3)
    async with client:
        with pytest.raises(RootUnavailable, match=r"root unreachable after \d+ attempts: ConnectError for"):
            await client.report_progress(0, {})
    assert len(seen) >= 2 and {"a:8001", "b:8002"} <= set(seen), "every replica was tried"
    # Strictly alternating: a failed replica hands over to the next, never to itself.
    assert all(first != second for first, second in itertools.pairwise(seen))


def test_backoff_waits_only_after_a_full_round_of_replicas() -> None:
    wait = rest.backoff(replicas=3)

    class State:
        def __init__(self, attempt: int):
            self.attempt_number = attempt

    waits = [wait(State(n)) for n in range(1, 10)]  # type: ignore[arg-type]
    assert waits[0] == waits[1] == 0.0 and waits[3] == waits[4] == 0.0
    assert 0 < waits[2] <= rest.FIRST_BACKOFF_S * 1.25  # after the first round
    assert waits[5] > 0 and waits[8] > 0
    assert max(waits) <= rest.MOST_BACKOFF_S * 1.25


def test_api_error_reads_the_error_shape_or_the_text() -> None:
    shaped = httpx.Response(
        422, json={"error": {"code": "validation_error", "message": "bad", "details": {}}}
    )
    assert rest.api_error(shaped) == ("validation_error", "bad")
    assert rest.api_error(httpx.Response(502, text="  Bad gateway  ")) == ("http_502", "Bad gateway")
    assert rest.api_error(httpx.Response(500)) == ("http_500", "Internal Server Error")


async def test_answers_are_the_apis_models_and_bodies_the_fields_set() -> None:
    sent: list[tuple[str, str, bytes]] = []
    directive = {
        "revision": 4,
        "job_state": "recovering",
        "status": "ready",
        "generation": 2,
        "iteration": 40,
        "world_size": 2,
        "procs_per_machine": 1,
        "rendezvous": {"master_addr": "10.0.0.1", "master_port": 29500},
        "sources": [{"rank": 0, "tier": "peer", "source_rank": 1, "address": "10.0.0.2", "data_port": 7001}],
        "machines": [{"rank": 1, "address": "10.0.0.2", "data_port": 7001, "state": "healthy"}],
    }
    failure = {
        "id": 9,
        "job_id": JOB_ID,
        "rank": 1,
        "kind": "hardware",
        "state": "resolved",
        "cause": "lost",
        "detected_at": "2026-01-02T12:00:00Z",
        "classified_at": None,
        "replaced_at": None,
        "restored_at": None,
        "resumed_at": "2026-01-02T12:00:30Z",
        "plan_id": None,
        "tier": "peer",
        "iterations_lost": 1,
        "details": {},
        "recovery_s": 30.0,
        "number": 1,
    }
    answers = {
        "/machines": REGISTERED,
        "/directive": directive,
        "/jobs": {"items": [], "total": 0, "limit": 50, "offset": 0},
        f"/jobs/{JOB_ID}/failures": [failure],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path, request.content))
        path = request.url.path.removeprefix("/api/v1").removeprefix(f"/worker/jobs/{JOB_ID}")
        return httpx.Response(200, json=answers[path]) if path in answers else httpx.Response(204)

    client = RootClient("http://a:8001", JOB_ID, "t", transport=httpx.MockTransport(handler))
    async with client:
        registered = await client.register(instance_id="i-1", address="10.0.0.1", data_port=7000)
        assert isinstance(registered, RegisterResponse)
        assert str(registered.job_id) == JOB_ID and registered.placement.ranks[1].holders == [1, 0]
        assert registered.heartbeat.mode == "rest" and registered.persistent.path == "/tmp/persisted"
        # Attributes only: the answers are the models, not JSON documents read by key.
        assert registered.peers[0].address == "10.0.0.2"
        with pytest.raises(TypeError):
            registered["peers"]  # type: ignore[index]
        assert not hasattr(registered, "get")

        answer = await client.directive(after=3, wait_s=0)
        assert isinstance(answer, DirectiveOut) and answer.sources[0].tier == "peer"
        assert answer.rendezvous is not None and answer.rendezvous.master_port == 29500

        page = await client.jobs(state="running")
        assert isinstance(page, JobPage) and page.total == 0
        assert sent[-1][1] == "/api/v1/jobs"
        failures = await client.failures(JOB_ID)
        assert isinstance(failures[0], FailureOut) and failures[0].recovery_s == 30.0

        from worker_lib.api.worker import ProgressReport

        await client.report_progress(0, ProgressReport(instance_id="i-1", generation=2, event="resumed"))
        assert sent[-1][2] == b'{"instance_id":"i-1","generation":2,"event":"resumed"}', "the fields set"

    answers["/directive"] = {"revision": "soon"}
    client = RootClient("http://a:8001", JOB_ID, "t", transport=httpx.MockTransport(handler))
    async with client:
        with pytest.raises(UnexpectedAnswer, match="DirectiveOut"):
            await client.directive(after=0, wait_s=0)


# ---- the operator CLI's client on the same policy ---------------------------------------------------------


def _cli(handler: Handler, retry_for_s: float = 30.0) -> tuple[cli_client.CliClient, list[str]]:
    seen: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request.method)
        return handler(request)

    connection = cli_client.Connection("http://root:8080", "castor-admin.x", "--token")
    client = cli_client.CliClient(connection, transport=httpx.MockTransport(record), retry_for_s=retry_for_s)
    return client, seen


def test_the_cli_retries_a_read_whose_answer_failed_on_the_way() -> None:
    answers: list[Callable[[httpx.Request], httpx.Response]] = [
        lambda request: httpx.Response(503, text="restarting"),
        lambda request: (_ for _ in ()).throw(httpx.RemoteProtocolError("peer closed", request=request)),
        lambda request: httpx.Response(200, json={"items": [], "total": 0, "limit": 50, "offset": 0}),
    ]
    client, seen = _cli(lambda request: answers.pop(0)(request))
    with client:
        assert client.run(client.api.jobs()) == JobPage(items=[], total=0, limit=50, offset=0)
    assert seen == ["GET", "GET", "GET"]


def test_the_cli_sends_a_write_once_and_reports_a_refused_connection_at_once() -> None:
    client, seen = _cli(lambda request: httpx.Response(503, text="restarting"))
    with (
        client,
        pytest.raises(cli_client.ApiError, match=r"the root service failed \(HTTP 503\): restarting"),
    ):
        client.run(client.api.stop_job("x"))
    assert seen == ["POST"], "a write that may have reached the root is never sent twice"

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    client, seen = _cli(refused)
    with client, pytest.raises(cli_client.Unreachable, match="connection refused"):
        client.run(client.api.jobs())
    assert seen == ["GET"], "no root at the URL: said at once, not after a budget of retries"

    client, seen = _cli(lambda request: httpx.Response(500, text="boom"), retry_for_s=0.3)
    with client, pytest.raises(cli_client.ApiError, match=r"HTTP 500"):
        client.run(client.api.jobs())
    assert len(seen) >= 2, "retried until the budget was spent, then the root's own answer"


async def test_agents_spread_over_the_replicas_and_each_fails_over_to_the_next() -> None:
    """An agent starts on the replica its instance id hashes to (a recovery's burst of requests is shared
    out), stays there while it answers, and moves on when it fails."""
    urls = ["http://a:8001", "http://b:8002", "http://c:8003"]
    down: set[int] = set()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.port in down:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json=REGISTERED)

    firsts: dict[str, str] = {}
    for index in range(30):
        instance = f"i-{index:04d}"
        client, seen = _client(urls, handler, spread_key=instance)
        async with client:
            await client.register(instance_id=instance)
            await client.report_progress(3, {"event": "resumed"})
        assert seen[0] == seen[1] == urls[first_replica(instance, 3)].removeprefix("http://")
        firsts[instance] = seen[0]
    assert set(firsts.values()) == {"a:8001", "b:8002", "c:8003"}  # thirty agents reach every replica
    # Stable: the same instance starts on the same replica after a restart (crc32, not Python's hash(),
    # which is salted per process).
    assert first_replica("i-0007", 3) == 2

    # Its replica down, an agent moves to the next one, and stays there.
    instance = next(i for i, first in firsts.items() if first == "b:8002")
    down.add(8002)
    client, seen = _client(urls, handler, spread_key=instance)
    async with client:
        await client.register(instance_id=instance)
        await client.report_progress(3, {"event": "resumed"})
    assert seen == ["b:8002", "c:8003", "c:8003"]


async def test_without_a_spread_key_the_first_url_is_asked_first() -> None:
    client, seen = _client(["http://a:8001", "http://b:8002"], lambda r: httpx.Response(200, json=REGISTERED))
    async with client:
        await client.register(instance_id="i-1")
    assert seen == ["a:8001"]


async def test_an_exit_report_reaches_a_root_that_predates_its_generation() -> None:
    bodies: list[dict[str, object]] = []

    def older_root(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        if "generation" in body:  # as a root whose ExitReport has no generation field answers
            problem = "invalid request: generation: Extra inputs are not permitted"
            return httpx.Response(422, json={"error": {"code": "validation_error", "message": problem}})
        return httpx.Response(202, json={"failure_id": 9})

    client, _ = _client(["http://a:1"], older_root)
    ack = await client.report_exit(0, "i-0", local_rank=0, global_rank=0, exit_code=1, generation=3)
    assert ack.failure_id == 9
    assert [("generation" in b) for b in bodies] == [True, False], bodies

    # Any other rejection is the root's answer, raised as it was.
    def rejecting(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, json={"error": {"code": "replaced", "message": "rank 0 is i-1's now"}})

    client, _ = _client(["http://a:1"], rejecting)
    with pytest.raises(RootRejected):
        await client.report_exit(0, "i-0", local_rank=0, global_rank=0, exit_code=1, generation=3)
