"""The AWS cloud operator against the moto server: concurrent replacements (a lost placement group is two
at once) never promise one instance to two ranks, on either path (standby or a newly launched instance)."""

from __future__ import annotations

import asyncio
import uuid

import aioboto3

from services.root.clients import JobInfo, MachineInfo
from services.root.clients.aws import AwsOperator
from tests import harness
from tests.aws_group import create_group, group_instances, instance_state

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

    first, second = await asyncio.gather(
        aws.replace(JOB, lost(0, instances[0]), survivors),
        aws.replace(JOB, lost(1, instances[1]), survivors),
    )

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

    replacements = await asyncio.gather(
        aws.replace(JOB, lost(0, machines[0]), survivors),
        aws.replace(JOB, lost(1, machines[1]), survivors),
    )

    chosen = {r.instance_id for r in replacements}
    assert len(chosen) == 2 and spare in chosen, replacements
    assert sorted(r.extra["standby"] for r in replacements) == [False, True]
    states = await group_instances(moto_server, group)
    assert states[spare]["LifecycleState"] == "InService"
    assert survivors | chosen <= {i for i, d in states.items() if d["LifecycleState"] == "InService"}
