"""The AWS cloud operator against the moto server: concurrent replacements (a lost placement group is two
at once) never promise one instance to two ranks, on either path (standby or a newly launched instance);
one long-lived client whose only retries are botocore's adaptive mode (seen through a throttling proxy in
front of moto); one poller of the group for all waiting replacements."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aioboto3
import httpx
import pytest
from aiohttp import web

from services.root.clients import CloudOperatorError, JobInfo, MachineInfo
from services.root.clients.aws import AwsOperator
from tests import harness
from tests.aws_group import create_group, group_instances, instance_state
from tests.harness import free_port

JOB = JobInfo(id=uuid.uuid4(), name="aws-operator", num_machines=4)


def operator(moto: harness.Moto, group: str) -> AwsOperator:
    return AwsOperator(group, region="us-east-1", endpoint_url=moto.url, poll_s=0.1, timeout_s=60)


def lost(rank: int, instance_id: str) -> MachineInfo:
    return MachineInfo(rank=rank, instance_id=instance_id, address="10.0.0.1")


async def test_two_concurrent_replacements_get_two_new_instances(moto_server: harness.Moto) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 4)
    aws = operator(moto_server, group)
    survivors = set(instances[2:])

    try:
        first, second = await asyncio.gather(
            aws.replace(JOB, lost(0, instances[0]), survivors),
            aws.replace(JOB, lost(1, instances[1]), survivors),
        )
    finally:
        await aws.close()

    assert first.instance_id != second.instance_id
    assert {first.instance_id, second.instance_id}.isdisjoint(instances)
    assert [await instance_state(moto_server, i) for i in instances[:2]] == ["terminated", "terminated"]
    in_service = {
        i
        for i, d in (await group_instances(moto_server, group)).items()
        if d["LifecycleState"] == "InService"
    }
    # A subset, not equality: moto's threaded server can race two concurrent terminations into launching
    # one instance too many; which instances the operator promised is what matters here.
    assert survivors | {first.instance_id, second.instance_id} <= in_service


async def test_one_standby_instance_goes_to_one_replacement_and_the_other_gets_a_new_instance(
    moto_server: harness.Moto,
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 5)
    spare, machines = instances[-1], instances[:-1]
    async with aioboto3.Session(region_name="us-east-1").client(
        "autoscaling", endpoint_url=moto_server.url
    ) as autoscaling:
        await autoscaling.enter_standby(
            AutoScalingGroupName=group, InstanceIds=[spare], ShouldDecrementDesiredCapacity=True
        )
    aws = operator(moto_server, group)
    survivors = set(machines[2:])

    try:
        replacements = await asyncio.gather(
            aws.replace(JOB, lost(0, machines[0]), survivors),
            aws.replace(JOB, lost(1, machines[1]), survivors),
        )
    finally:
        await aws.close()

    chosen = {r.instance_id for r in replacements}
    assert len(chosen) == 2 and spare in chosen, replacements
    assert sorted(r.extra["standby"] for r in replacements) == [False, True]
    states = await group_instances(moto_server, group)
    assert states[spare]["LifecycleState"] == "InService"
    assert survivors | chosen <= {i for i, d in states.items() if d["LifecycleState"] == "InService"}


THROTTLED = (
    b"<ErrorResponse><Error><Type>Sender</Type><Code>Throttling</Code><Message>Rate exceeded</Message>"
    b"</Error><RequestId>castor-test</RequestId></ErrorResponse>"
)


class ThrottlingProxy:
    """An HTTP proxy in front of moto that answers AWS's Throttling error to the first `throttle` requests
    and forwards the rest, counting requests and client connections."""

    def __init__(self, moto: harness.Moto, throttle: int):
        self.moto, self.throttle = moto, throttle
        self.requests = 0
        self.connections: set[tuple[str, int]] = set()
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.connections.add(request.transport.get_extra_info("peername") if request.transport else ("?", 0))
        if self.requests <= self.throttle:
            return web.Response(status=400, body=THROTTLED, content_type="text/xml")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        async with httpx.AsyncClient() as client:
            answer = await client.request(
                request.method,
                f"{self.moto.url}{request.path_qs}",
                headers=headers,
                content=await request.read(),
            )
        return web.Response(status=answer.status_code, body=answer.content, content_type="text/xml")


@pytest.fixture
async def throttling_proxy(moto_server: harness.Moto) -> AsyncIterator[Any]:
    proxies: list[web.AppRunner] = []

    async def start(throttle: int) -> ThrottlingProxy:
        proxy = ThrottlingProxy(moto_server, throttle)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", proxy.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", proxy.port).start()
        proxies.append(runner)
        return proxy

    yield start
    for runner in proxies:
        await runner.cleanup()


async def test_throttling_is_retried_by_botocore_on_one_long_lived_connection(
    moto_server: harness.Moto, throttling_proxy: Any
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 2)
    proxy = await throttling_proxy(throttle=2)
    aws = AwsOperator(group, region="us-east-1", endpoint_url=proxy.url, attempts=4)
    try:
        for _ in range(3):
            assert sorted(i["InstanceId"] for i in await aws.instances()) == instances
    finally:
        await aws.close()
    # Two throttled answers retried inside the first call, then two more calls: 5 requests, all on the one
    # client's kept-alive connection (a client per call opens a connection per call).
    assert proxy.requests == 5
    assert len(proxy.connections) == 1, proxy.connections


async def test_retries_stop_at_the_configured_attempts_without_nested_loops(
    moto_server: harness.Moto, throttling_proxy: Any
) -> None:
    proxy = await throttling_proxy(throttle=1_000)  # never reaches moto: no group needed
    aws = AwsOperator("castor-throttled", region="us-east-1", endpoint_url=proxy.url, attempts=3)
    try:
        with pytest.raises(CloudOperatorError, match="Throttling"):
            await aws.instances()
    finally:
        await aws.close()
    assert proxy.requests == 3  # botocore's attempts, and no retry loop of Castor's around them


async def test_one_poller_serves_every_waiting_replacement() -> None:
    """Three replacements wait for new instances at once: each round describes the group once for all of
    them, and each gets a different instance."""
    aws = AwsOperator("castor-poller", region="us-east-1", poll_s=0.01)
    old = [{"InstanceId": f"i-old{n}", "LifecycleState": "InService"} for n in range(3)]
    fresh = [{"InstanceId": f"i-new{n}", "LifecycleState": "InService"} for n in range(3)]
    snapshots = [old, old, old + fresh]
    calls = 0

    async def instances() -> list[dict[str, Any]]:
        nonlocal calls
        calls += 1
        return snapshots[min(calls, len(snapshots)) - 1]

    aws.instances = instances  # type: ignore[method-assign]
    known = {i["InstanceId"] for i in old}
    try:
        chosen = await asyncio.wait_for(
            asyncio.gather(*(aws._wait_for_new_instance(known) for _ in range(3))), timeout=10
        )
    finally:
        await aws.close()
    assert sorted(chosen) == ["i-new0", "i-new1", "i-new2"]
    assert calls == 3  # one describe per round for all three waiters, not one per waiter


async def test_a_failed_describe_fails_every_waiting_replacement() -> None:
    aws = AwsOperator("castor-poller", region="us-east-1", poll_s=0.01)

    async def instances() -> list[dict[str, Any]]:
        raise CloudOperatorError("could not describe the group: EndpointConnectionError")

    aws.instances = instances  # type: ignore[method-assign]
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(aws._wait_for_new_instance(set()) for _ in range(2)), return_exceptions=True),
            timeout=10,
        )
    finally:
        await aws.close()
    assert [str(r) for r in results] == ["could not describe the group: EndpointConnectionError"] * 2
