"""An Auto Scaling Group on the moto server, the AWS of the tests: a launch template, a group of `size`
instances and a bucket of the same name."""

from __future__ import annotations

from typing import Any

import aioboto3

from tests import harness


async def create_group(moto: harness.Moto, name: str, size: int) -> list[str]:
    session = aioboto3.Session(region_name="us-east-1")
    async with (
        session.client("ec2", endpoint_url=moto.url) as ec2,
        session.client("autoscaling", endpoint_url=moto.url) as autoscaling,
        session.client("s3", endpoint_url=moto.url) as s3,
    ):
        image = (await ec2.describe_images(Owners=["amazon"]))["Images"][0]["ImageId"]
        subnet = (await ec2.describe_subnets())["Subnets"][0]["SubnetId"]
        await ec2.create_launch_template(
            LaunchTemplateName=name, LaunchTemplateData={"ImageId": image, "InstanceType": "p4d.24xlarge"}
        )
        await autoscaling.create_auto_scaling_group(
            AutoScalingGroupName=name,
            MinSize=0,
            MaxSize=size + 2,
            DesiredCapacity=size,
            LaunchTemplate={"LaunchTemplateName": name, "Version": "$Latest"},
            VPCZoneIdentifier=subnet,
        )
        await s3.create_bucket(Bucket=name)
    return sorted(await group_instances(moto, name))


async def group_instances(moto: harness.Moto, name: str) -> dict[str, dict[str, Any]]:
    async with aioboto3.Session(region_name="us-east-1").client(
        "autoscaling", endpoint_url=moto.url
    ) as autoscaling:
        groups = await autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[name])
    return {i["InstanceId"]: i for i in groups["AutoScalingGroups"][0]["Instances"]}


async def instance_state(moto: harness.Moto, instance_id: str) -> str:
    async with aioboto3.Session(region_name="us-east-1").client("ec2", endpoint_url=moto.url) as ec2:
        reservations = (await ec2.describe_instances(InstanceIds=[instance_id]))["Reservations"]
    return str(reservations[0]["Instances"][0]["State"]["Name"])
