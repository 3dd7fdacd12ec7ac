"""A machine replacement on AWS is decided, recorded on its failure event, then acted on; a try cut short
after any cloud call is continued from the group's actual state, never repeated: against the moto server,
the operator alone (a try that dies right after a call, then a fresh operator with the recorded intent) and
the recovery driver on Postgres (a leader frozen right after its call and a new leader continuing the
recovery; a call that raises and the same leader's retry). Each run checks the cloud calls made, the
group's instances and the failure event's record of the chosen instance."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest
from botocore.exceptions import ClientError

from services.root import schemas
from services.root.clients import CloudOperatorError, JobInfo, MachineInfo, ReplacementJournal
from services.root.clients.aws import AwsOperator, Refused
from services.root.db import repository as repo
from services.root.db.database import Database
from services.root.db.migrate import upgrade_async
from services.root.db.models import FailureEvent
from services.root.errors import Conflict
from services.root.flows import recovery
from services.root.flows.failures import machine_lost
from services.root.flows.jobs import create_job, stop_job
from services.root.flows.machines import register, register_machine
from services.root.orchestration.leadership import Leadership
from services.root.orchestration.per_job import PerJob
from services.root.orchestration.recovery_driver import RecoveryDriver
from services.root.settings import Settings
from tests import harness
from tests.aws_group import create_group, group_instances, instance_state

MUTATING = ("exit_standby", "set_instance_health", "terminate_instance_in_auto_scaling_group")


class LeaderDied(BaseException):
    """The leader's process ends right after a cloud call (nothing after it runs, not even error
    handling)."""


def aws_error(operation: str, code: str, message: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
        operation,
    )


class Answering:
    """The Auto Scaling client, answering the operations in `errors` with that error instead (what AWS
    answers and moto does not: moto 5.2.5's ExitStandby checks neither MaxSize nor permissions)."""

    def __init__(self, client: Any, errors: dict[str, ClientError]):
        self._client, self._errors = client, errors

    def __getattr__(self, name: str) -> Any:
        if name in self._errors:

            async def refused(**params: Any) -> Any:
                raise self._errors[name]

            return refused
        return getattr(self._client, name)


class Recorded(AwsOperator):
    """The AWS operator, counting its calls that change the group; after `stop_after` returns it dies
    (`LeaderDied`), raises (`raise_after`: the call's answer lost, say) or freezes (`freeze_after`: a
    leader that stops acting but never exits). `errors`: operations AWS answers with an error."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.stop_after: str | None = kwargs.pop("stop_after", None)
        self.how: str = kwargs.pop("how", "die")
        self.errors: dict[str, ClientError] = kwargs.pop("errors", {})
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []
        self.stopped = asyncio.Event()

    async def _autoscaling(self) -> Any:
        client = await super()._autoscaling()
        return Answering(client, self.errors) if self.errors else client

    async def _call(self, what: str, operation: str, **params: Any) -> Any:
        answer = await super()._call(what, operation, **params)
        if operation in MUTATING:
            self.calls.append((operation, params.get("InstanceId") or params["InstanceIds"][0]))
        if operation == self.stop_after:
            self.stop_after = None
            self.stopped.set()
            if self.how == "die":
                raise LeaderDied(operation)
            if self.how == "raise":
                raise CloudOperatorError(f"lost the answer to {operation}")
            await asyncio.Event().wait()  # frozen
        return answer


def operator(moto: harness.Moto, group: str, **how: Any) -> Recorded:
    return Recorded(group, region="us-east-1", endpoint_url=moto.url, poll_s=0.1, timeout_s=60, **how)


async def with_standby(moto: harness.Moto, group: str, spares: list[str]) -> None:
    async with aioboto3.Session(region_name="us-east-1").client("autoscaling", endpoint_url=moto.url) as asg:
        await asg.enter_standby(
            AutoScalingGroupName=group, InstanceIds=spares, ShouldDecrementDesiredCapacity=True
        )


def lifecycle(states: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {instance: d["LifecycleState"] for instance, d in states.items()}


JOB = JobInfo(id=uuid.uuid4(), name="aws-replacement", num_machines=2)


@pytest.mark.parametrize("standby", [False, True], ids=["launch", "standby"])
async def test_a_try_that_dies_after_a_call_is_continued_by_a_fresh_operator_without_repeating_it(
    moto_server: harness.Moto, standby: bool
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 4 if standby else 2)
    machines, spares = instances[:2], instances[2:]
    if spares:
        await with_standby(moto_server, group, spares)
    failed = MachineInfo(rank=1, instance_id=machines[1], address="10.0.0.1")
    bound = set(machines)

    # The first try dies right after its first call: the Standby instance moved into service, or the
    # failed instance terminated (the group then launches its replacement).
    first = operator(
        moto_server,
        group,
        stop_after="exit_standby" if standby else "terminate_instance_in_auto_scaling_group",
    )
    journal = ReplacementJournal(key="failure-1")
    try:
        with pytest.raises(LeaderDied):
            await first.replace(JOB, failed, bound, journal)
    finally:
        await first.close()
    chosen = sorted(spares)[0] if standby else None
    assert journal.intent["replacing"] == machines[1], "the instance being replaced was recorded first"
    assert journal.intent.get("standby") == chosen
    assert ("exit_standby_at" in journal.intent) == standby
    assert ("terminate_at" in journal.intent) != standby
    before = lifecycle(await group_instances(moto_server, group))

    # A fresh operator (a new leader: none of the first one's memory) continues from the recorded intent.
    second = operator(moto_server, group)
    try:
        done = await second.replace(JOB, failed, bound, ReplacementJournal("failure-1", journal.intent))
    finally:
        await second.close()
    after = lifecycle(await group_instances(moto_server, group))

    assert await instance_state(moto_server, machines[1]) == "terminated"
    if standby:
        assert done.instance_id == chosen and done.extra == {"standby": True}
        # What was left: the failed instance, terminated once, with the decrement; no second Standby.
        assert second.calls == [
            ("set_instance_health", machines[1]),
            ("terminate_instance_in_auto_scaling_group", machines[1]),
        ]
        assert after[sorted(spares)[1]] == "Standby", "the other Standby instance stays in the pool"
    else:
        # The group's new instance is adopted: nothing terminated again, nothing launched again.
        assert second.calls == []
        (new,) = set(after) - set(instances)
        assert done.instance_id == new and done.extra == {"standby": False}
        assert after == before, "the group did not change"
    assert done.instance_id not in bound


async def test_a_try_that_dies_after_both_standby_calls_is_finished_without_a_call(
    moto_server: harness.Moto,
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 3)
    machines, spare = instances[:2], instances[2]
    await with_standby(moto_server, group, [spare])
    failed = MachineInfo(rank=0, instance_id=machines[0], address="10.0.0.1")
    first = operator(moto_server, group, stop_after="terminate_instance_in_auto_scaling_group")
    journal = ReplacementJournal(key="failure-2")
    try:
        with pytest.raises(LeaderDied):
            await first.replace(JOB, failed, set(machines), journal)
    finally:
        await first.close()
    second = operator(moto_server, group)
    try:
        done = await second.replace(
            JOB, failed, set(machines), ReplacementJournal("failure-2", journal.intent)
        )
    finally:
        await second.close()
    assert done.instance_id == spare and second.calls == []


MAX_SIZE = aws_error(
    "ExitStandby",
    "ValidationError",
    "New SetDesiredCapacity value 4 is above max value 3 for the AutoScalingGroup.",
)
NO_PERMISSION = aws_error(
    "ExitStandby", "AccessDenied", "User is not authorized to perform: autoscaling:ExitStandby", 403
)


@pytest.mark.parametrize("refusal", [MAX_SIZE, NO_PERMISSION], ids=["max-size", "no-permission"])
async def test_a_refused_exit_standby_is_recorded_and_the_failed_instance_terminated_instead(
    moto_server: harness.Moto, refusal: ClientError, caplog: pytest.LogCaptureFixture
) -> None:
    """AWS refuses to move the Standby instance into service (it would raise the desired capacity above the
    group's MaxSize; no permission): asking again would be refused again, so the refusal is recorded and
    the same try terminates the failed instance without a decrement and adopts the group's launch."""
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 4)
    machines, spares = instances[:2], sorted(instances[2:])
    await with_standby(moto_server, group, spares)
    failed = MachineInfo(rank=1, instance_id=machines[1], address="10.0.0.1")
    aws = operator(moto_server, group, errors={"exit_standby": refusal})
    journal = ReplacementJournal(key="failure-3")
    try:
        done = await aws.replace(JOB, failed, set(machines), journal)
    finally:
        await aws.close()
    states = lifecycle(await group_instances(moto_server, group))
    (launched,) = set(states) - set(instances)
    assert done.instance_id == launched and done.extra == {"standby": False}
    assert aws.calls == [
        ("set_instance_health", machines[1]),
        ("terminate_instance_in_auto_scaling_group", machines[1]),
    ], "one Standby instance tried, never another; the failed instance terminated once"
    assert states[spares[0]] == states[spares[1]] == "Standby"
    code = refusal.response["Error"]["Code"]
    assert journal.intent["standby"] == spares[0] and journal.intent["terminate_at"]
    assert journal.intent["exit_standby_refused"].startswith(f"{code}: ")
    assert spares[0] not in aws._claims, "the refused Standby instance is not held"
    assert any(f"AWS refused to move standby instance {spares[0]}" in r.message for r in caplog.records)
    assert await instance_state(moto_server, machines[1]) == "terminated"


async def test_a_throttled_exit_standby_is_retried_not_taken_as_a_refusal(moto_server: harness.Moto) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 3)
    machines, spare = instances[:2], instances[2]
    await with_standby(moto_server, group, [spare])
    failed = MachineInfo(rank=1, instance_id=machines[1], address="10.0.0.1")
    throttled = aws_error("ExitStandby", "Throttling", "Rate exceeded")
    first = operator(moto_server, group, errors={"exit_standby": throttled})
    journal = ReplacementJournal(key="failure-4")
    try:
        with pytest.raises(CloudOperatorError, match="Throttling"):
            await first.replace(JOB, failed, set(machines), journal)
    finally:
        await first.close()
    assert first.calls == [] and "exit_standby_refused" not in journal.intent
    assert journal.intent["standby"] == spare

    # The retry moves the same Standby instance into service.
    second = operator(moto_server, group)
    try:
        done = await second.replace(
            JOB, failed, set(machines), ReplacementJournal("failure-4", journal.intent)
        )
    finally:
        await second.close()
    assert done.instance_id == spare and done.extra == {"standby": True}
    assert second.calls[0] == ("exit_standby", spare)


async def test_an_exit_standby_answered_not_in_standby_is_no_refusal(moto_server: harness.Moto) -> None:
    """What AWS answers to a second ExitStandby of an instance an earlier call (whose answer was lost)
    moved into service. Taken as a refusal, the failed instance was terminated without a decrement and the
    group launched one more for good; it is retried, and the next try decides from the group's state."""
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 3)
    machines, spare = instances[:2], instances[2]
    await with_standby(moto_server, group, [spare])
    failed = MachineInfo(rank=1, instance_id=machines[1], address="10.0.0.1")
    landed = aws_error("ExitStandby", "ValidationError", f"The instance {spare} is not in Standby.")
    aws = operator(moto_server, group, errors={"exit_standby": landed})
    journal = ReplacementJournal(key="failure-5")
    try:
        with pytest.raises(CloudOperatorError, match="not in Standby") as raised:
            await aws.replace(JOB, failed, set(machines), journal)
    finally:
        await aws.close()
    assert not isinstance(raised.value, Refused)
    assert "exit_standby_refused" not in journal.intent and journal.intent["standby"] == spare
    assert aws.calls == [], "the failed instance is not terminated on that answer"


# -- the recovery driver on Postgres: a new leader continues a replacement in progress --------------------


@pytest.fixture
async def database(postgres_server: harness.Postgres) -> AsyncIterator[Database]:
    url = postgres_server.create_database(f"replace_{uuid.uuid4().hex[:8]}")
    await upgrade_async(url)
    db = Database(url)
    yield db
    await db.dispose()


def settings_for(database: Database, tmp_path: Path, moto: harness.Moto, group: str) -> Settings:
    return Settings(
        database_url=database.url,
        state_dir=tmp_path,
        admin_token="x",
        cloud="aws",
        asg_name=group,
        aws_endpoint_url=moto.url,
    )


async def lost_machine(database: Database, settings: Settings, instances: list[str]) -> tuple[uuid.UUID, int]:
    """A running job of two machines on `instances`, machine 1 lost: the job's id and the failure's."""
    async with database.session() as session:
        job, _ = await create_job(session, schemas.JobCreate(name=f"job-{uuid.uuid4().hex[:8]}", machines=2))
        for rank, instance in enumerate(instances):
            request = schemas.RegisterRequest(instance_id=instance, address="10.0.0.1", data_port=9000 + rank)
            await register_machine(session, job, request, settings)
        (machine,) = await repo.machines_at_ranks(session, job.id, [1])
        event = await machine_lost(session, job, machine, "stopped heartbeating (the test)")
        assert event is not None
        return job.id, event.id


async def replica(database: Database, settings: Settings, aws: AwsOperator) -> RecoveryDriver:
    """A replica that has just become the leader (its epoch raised: the previous leader is fenced)."""
    leadership = Leadership(database, settings, None)
    await leadership.claim_epoch(None)
    return RecoveryDriver(leadership, PerJob(), settings, aws)


async def replacement_of(database: Database, event_id: int) -> dict[str, Any]:
    async with database.session() as session:
        event = await session.get(FailureEvent, event_id)
        assert event is not None
        return dict(event.details.get("replacement", {}))


async def settled(driver: RecoveryDriver) -> None:
    """The driver's replacements in flight have ended (bounded)."""
    if driver._tasks:
        await asyncio.wait_for(asyncio.gather(*driver._tasks, return_exceptions=True), 60)


@pytest.mark.parametrize("standby", [False, True], ids=["launch", "standby"])
async def test_a_new_leader_continues_the_replacement_its_frozen_predecessor_started(
    database: Database, moto_server: harness.Moto, tmp_path: Path, standby: bool
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 4 if standby else 2)
    machines, spares = instances[:2], sorted(instances[2:])
    if spares:
        await with_standby(moto_server, group, spares)
    settings = settings_for(database, tmp_path, moto_server, group)
    job_id, event_id = await lost_machine(database, settings, machines)

    # The first leader asks the cloud once, then freezes (a stuck process keeps its task, never records).
    call = "exit_standby" if standby else "terminate_instance_in_auto_scaling_group"
    old_aws = operator(moto_server, group, stop_after=call, how="freeze")
    new_aws = operator(moto_server, group)
    old = await replica(database, settings, old_aws)
    try:
        await old.step(job_id)
        await asyncio.wait_for(old_aws.stopped.wait(), 60)
        request = await replacement_of(database, event_id)
        assert request["status"] == "requested"
        assert request["intent"]["replacing"] == machines[1], "recorded before the call"
        assert request["intent"].get("standby") == (spares[0] if standby else None)

        # A new leader takes over (the old one is fenced) and its first step continues the replacement.
        new = await replica(database, settings, new_aws)
        await new.step(job_id)
        await settled(new)
        request = await replacement_of(database, event_id)
        assert request["status"] == "launched", request
        states = lifecycle(await group_instances(moto_server, group))
        if standby:
            assert request["instance"] == spares[0] == request["intent"]["standby"]
            assert new_aws.calls == [
                ("set_instance_health", machines[1]),
                ("terminate_instance_in_auto_scaling_group", machines[1]),
            ]
            assert states[spares[1]] == "Standby", "no second Standby instance"
        else:
            (launched,) = set(states) - set(instances)
            assert request["instance"] == launched, "the instance the first leader's call launched"
            assert new_aws.calls == [], "nothing terminated or launched a second time"
        first_calls = (
            [(call, spares[0])] if standby else [("set_instance_health", machines[1]), (call, machines[1])]
        )
        assert old_aws.calls == first_calls
        assert await instance_state(moto_server, machines[1]) == "terminated"
    finally:
        for task in old._tasks:
            task.cancel()
        await asyncio.gather(*old._tasks, return_exceptions=True)
        await old_aws.close()
        await new_aws.close()


async def test_a_call_that_raises_is_retried_from_the_groups_state_by_the_same_leader(
    database: Database, moto_server: harness.Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 2)
    settings = settings_for(database, tmp_path, moto_server, group)
    job_id, event_id = await lost_machine(database, settings, instances)
    monkeypatch.setattr(recovery, "REPLACEMENT_RETRY_S", 0.0)  # no pause before the retry
    aws = operator(moto_server, group, stop_after="terminate_instance_in_auto_scaling_group", how="raise")
    driver = await replica(database, settings, aws)
    try:
        await driver.step(job_id)
        await settled(driver)
        request = await replacement_of(database, event_id)
        assert request["status"] == "error" and "lost the answer" in request["error"]
        assert request["intent"]["replacing"] == instances[1] and request["intent"]["terminate_at"]

        await driver.step(job_id)  # the retry
        await settled(driver)
        request = await replacement_of(database, event_id)
    finally:
        await aws.close()
    states = lifecycle(await group_instances(moto_server, group))
    (launched,) = set(states) - set(instances)
    assert request["status"] == "launched" and request["instance"] == launched
    assert request["attempts"] == 2 and request["intent"]["replacing"] == instances[1]
    assert aws.calls == [
        ("set_instance_health", instances[1]),
        ("terminate_instance_in_auto_scaling_group", instances[1]),
    ], "one termination: the retry found the instance gone and the new one there"


async def test_a_replacement_never_hands_out_another_jobs_machine_of_the_same_group(
    database: Database, moto_server: harness.Moto, tmp_path: Path
) -> None:
    """Two jobs run on one group: the instances the driver tells the operator not to hand out include the
    other job's machines, so its running machine is never adopted as this job's new instance."""
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 4)
    settings = settings_for(database, tmp_path, moto_server, group)
    job_id, event_id = await lost_machine(database, settings, instances[2:])
    await lost_machine(database, settings, instances[:2])  # the other job (its own loss stays unreplaced)
    aws = operator(moto_server, group)
    told: list[set[str]] = []
    replace = aws.replace

    async def spied(job: JobInfo, failed: MachineInfo, bound: set[str], journal: Any = None) -> Any:
        told.append(set(bound))
        return await replace(job, failed, bound, journal)

    aws.replace = spied  # type: ignore[method-assign]
    driver = await replica(database, settings, aws)
    try:
        await driver.step(job_id)
        await settled(driver)
    finally:
        await aws.close()
    assert told and set(instances) <= told[0]
    request = await replacement_of(database, event_id)
    assert request["status"] == "launched" and request["instance"] not in instances


async def test_a_recovery_whose_exit_standby_is_refused_launches_a_replacement_instead(
    database: Database, moto_server: harness.Moto, tmp_path: Path
) -> None:
    """Before, every retry asked the same refused ExitStandby again and the job stayed recovering."""
    group = f"castor-{uuid.uuid4().hex[:8]}"
    instances = await create_group(moto_server, group, 3)
    machines, spare = instances[:2], instances[2]
    await with_standby(moto_server, group, [spare])
    settings = settings_for(database, tmp_path, moto_server, group)
    job_id, event_id = await lost_machine(database, settings, machines)
    aws = operator(moto_server, group, errors={"exit_standby": MAX_SIZE})
    driver = await replica(database, settings, aws)
    try:
        await driver.step(job_id)
        await settled(driver)
        request = await replacement_of(database, event_id)
    finally:
        await aws.close()
    states = lifecycle(await group_instances(moto_server, group))
    (launched,) = set(states) - set(instances)
    assert request["status"] == "launched" and request["instance"] == launched, request
    assert request["intent"]["exit_standby_refused"].startswith("ValidationError: New SetDesiredCapacity")
    assert states[spare] == "Standby"


async def test_an_instance_another_running_job_holds_is_refused_on_aws_and_free_once_that_job_ends(
    database: Database, tmp_path: Path, moto_server: harness.Moto
) -> None:
    """On AWS a failed machine's instance is terminated: an instance of another job, registered with this
    job's token, would be terminated when this job declared it failed. Locally an instance id is a host
    name, which two jobs on one host share."""
    aws = settings_for(database, tmp_path, moto_server, "castor-unused")
    local = Settings(database_url=database.url, state_dir=tmp_path, admin_token="x")
    async with database.session() as session:
        first, _ = await create_job(session, schemas.JobCreate(name=f"a-{uuid.uuid4().hex[:8]}", machines=2))
        second, _ = await create_job(session, schemas.JobCreate(name=f"b-{uuid.uuid4().hex[:8]}", machines=2))
    instance = f"i-{uuid.uuid4().hex[:17]}"
    request = schemas.RegisterRequest(instance_id=instance, address="10.0.0.1", data_port=9000)
    assert (await register(database, first.id, request, aws)).rank == 0
    with pytest.raises(Conflict, match="machine of another job") as refused:
        await register(database, second.id, request, aws)
    assert refused.value.code == "instance_in_use" and first.name not in str(refused.value)
    async with database.session() as session:
        assert await repo.live_ranks(session, second.id) == [], "the refused instance holds no rank"
    # The first job's own instance registers again as before.
    assert (await register(database, first.id, request, aws)).rank == 0
    # Locally, two jobs on one host share its name.
    assert (await register(database, second.id, request, local)).rank == 0
    async with database.session() as session:
        third, _ = await create_job(session, schemas.JobCreate(name=f"c-{uuid.uuid4().hex[:8]}", machines=2))
        for job_id in (first.id, second.id):
            job = await repo.get_job(session, job_id, for_update=True)
            assert job is not None
            await stop_job(session, job)
    assert (await register(database, third.id, request, aws)).rank == 0, (
        "the instance is free once its jobs end"
    )
