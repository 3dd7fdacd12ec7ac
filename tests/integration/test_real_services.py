"""The harness's real components start and answer: Postgres, etcd (leases expire, watchers see it) and the
moto server as AWS (Auto Scaling Group replacement, S3 multipart)."""

from __future__ import annotations

import asyncio
import os
import time

import aetcd
import aioboto3
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests import harness


async def test_postgres_answers(postgres_server: harness.Postgres) -> None:
    engine = create_async_engine(postgres_server.url)
    async with engine.connect() as connection:
        version = (await connection.execute(text("SHOW server_version"))).scalar_one()
    await engine.dispose()
    assert version.startswith("15.")


async def test_etcd_lease_expiry_is_seen_by_a_watcher(etcd_server: harness.Etcd) -> None:
    host, port = etcd_server.endpoint.split(":")
    async with aetcd.Client(host, int(port), timeout=5) as client:
        lease = await client.lease(1)
        await client.put(b"/test/hb/0", b"alive", lease=lease)
        watch = await client.watch_prefix(b"/test/hb/")
        started = time.monotonic()

        async def first_delete() -> bytes:
            async for event in watch:
                if event.kind == aetcd.EventKind.DELETE:
                    return bytes(event.kv.key)
            raise AssertionError("watch ended")

        key = await asyncio.wait_for(first_delete(), timeout=10)
        await watch.cancel()
        assert key == b"/test/hb/0"
        assert time.monotonic() - started < 3, "a 1 s lease expires in about a second"
        assert await client.get(b"/test/hb/0") is None


@pytest.fixture
def aws(moto_server: harness.Moto) -> aioboto3.Session:
    moto_server.reset()
    return aioboto3.Session(region_name=os.environ["AWS_DEFAULT_REGION"])


async def test_asg_terminate_without_decrement_yields_a_replacement(
    aws: aioboto3.Session, moto_server: harness.Moto
) -> None:
    async with (
        aws.client("ec2", endpoint_url=moto_server.url) as ec2,
        aws.client("autoscaling", endpoint_url=moto_server.url) as autoscaling,
    ):
        image = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
        subnets = [s["SubnetId"] for s in (await ec2.describe_subnets())["Subnets"]][:2]
        await ec2.create_launch_template(
            LaunchTemplateName="castor-test",
            LaunchTemplateData={"ImageId": image, "InstanceType": "m5.large"},
        )
        await autoscaling.create_auto_scaling_group(
            AutoScalingGroupName="castor-test",
            MinSize=0,
            MaxSize=8,
            DesiredCapacity=4,
            LaunchTemplate={"LaunchTemplateName": "castor-test", "Version": "$Latest"},
            VPCZoneIdentifier=",".join(subnets),
        )

        async def instances() -> set[str]:
            groups = await autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=["castor-test"])
            return {i["InstanceId"] for i in groups["AutoScalingGroups"][0]["Instances"]}

        before = await instances()
        assert len(before) == 4
        victim = sorted(before)[0]
        await autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=victim, ShouldDecrementDesiredCapacity=False
        )
        after = await instances()
        assert len(after) == 4 and victim not in after and len(after - before) == 1
        state = await ec2.describe_instances(InstanceIds=[victim])
        assert state["Reservations"][0]["Instances"][0]["State"]["Name"] == "terminated"


async def test_s3_multipart_round_trip(aws: aioboto3.Session, moto_server: harness.Moto) -> None:
    payload = os.urandom(12 * 1024 * 1024 + 12345)
    part = 5 * 1024 * 1024
    async with aws.client("s3", endpoint_url=moto_server.url) as s3:
        await s3.create_bucket(Bucket="castor-test")
        upload = await s3.create_multipart_upload(Bucket="castor-test", Key="ckpt/rank-0")
        parts = []
        for number, offset in enumerate(range(0, len(payload), part), start=1):
            result = await s3.upload_part(
                Bucket="castor-test",
                Key="ckpt/rank-0",
                UploadId=upload["UploadId"],
                PartNumber=number,
                Body=payload[offset : offset + part],
            )
            parts.append({"ETag": result["ETag"], "PartNumber": number})
        await s3.complete_multipart_upload(
            Bucket="castor-test",
            Key="ckpt/rank-0",
            UploadId=upload["UploadId"],
            MultipartUpload={"Parts": parts},
        )
        response = await s3.get_object(Bucket="castor-test", Key="ckpt/rank-0")
        async with response["Body"] as body:
            fetched = await body.read()
    assert len(parts) == 3 and fetched == payload
