"""The AWS cloud operator: replaces a failed machine through its Auto Scaling Group (aioboto3).

Replacement: mark the instance Unhealthy, terminate it without decrementing the desired capacity, and wait
until the group has a new InService instance; or, with standby instances, move one into service (seconds
instead of the minutes a new p4d takes) and terminate the failed one with a decrement. AWS errors and
throttling are retried with exponential backoff and jitter; what still fails becomes a CloudOperatorError
that the recovery records and retries, never a crash of the root.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aioboto3
from botocore.exceptions import BotoCoreError, ClientError

from services.root.clients import CloudOperatorError, JobInfo, MachineInfo, Replacement

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE = {
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "ServiceUnavailable",
    "InternalFailure",
    "RequestTimeout",
    "ScalingActivityInProgress",
    "ResourceContention",
}


class AwsOperator:
    name = "aws"

    def __init__(
        self,
        asg_name: str,
        *,
        region: str,
        endpoint_url: str | None = None,
        use_standby: bool = True,
        poll_s: float = 2.0,
        timeout_s: float = 900.0,
        attempts: int = 6,
    ):
        self.asg_name = asg_name
        self.endpoint_url = endpoint_url
        self.use_standby = use_standby
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._session = aioboto3.Session(region_name=region)
        # Instances never to hand out: those already handed out as replacements and those being replaced.
        # Replacements run concurrently (a lost group is two at once) and an instance is bound in the
        # database only when its agent registers, so without this two ranks could be promised the same
        # standby or new instance, or one rank the failed instance another replacement is terminating.
        self._claimed: set[str] = set()

    async def provision(self, job: JobInfo, worker_token: str) -> None:
        return None  # the group's launch template boots instances that run `castor agent`

    async def release(self, job: JobInfo) -> None:
        return None

    async def instances(self) -> list[dict[str, Any]]:
        """The group's instances: InstanceId, LifecycleState, HealthStatus."""
        async with self._session.client("autoscaling", endpoint_url=self.endpoint_url) as autoscaling:
            groups = await self._retry(
                "describe the group",
                lambda: autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[self.asg_name]),
            )
        if not groups["AutoScalingGroups"]:
            raise CloudOperatorError(f"Auto Scaling Group {self.asg_name!r} does not exist")
        instances: list[dict[str, Any]] = groups["AutoScalingGroups"][0]["Instances"]
        return instances

    async def replace(self, job: JobInfo, failed: MachineInfo, bound_instances: set[str]) -> Replacement:
        self._claimed.add(failed.instance_id)
        async with self._session.client("autoscaling", endpoint_url=self.endpoint_url) as autoscaling:
            current = await self.instances()
            in_group = {i["InstanceId"] for i in current}
            standby = [
                i["InstanceId"]
                for i in current
                if i["LifecycleState"] == "Standby" and i["InstanceId"] not in bound_instances
            ]
            chosen = self._claim_first(standby) if self.use_standby else None
            if chosen is not None:
                try:
                    await self._retry(
                        "move a standby instance into service",
                        lambda: autoscaling.exit_standby(
                            AutoScalingGroupName=self.asg_name, InstanceIds=[chosen]
                        ),
                    )
                except BaseException:
                    self._claimed.discard(chosen)
                    raise
                await self._terminate(autoscaling, failed.instance_id, in_group, decrement=True)
                return Replacement(chosen, f"standby instance {chosen} moved into service", {"standby": True})
            await self._terminate(autoscaling, failed.instance_id, in_group, decrement=False)
        replacement = await self._wait_for_new_instance(bound_instances | {failed.instance_id})
        return Replacement(replacement, f"Auto Scaling Group launched {replacement}", {"standby": False})

    async def _terminate(
        self, autoscaling: Any, instance_id: str, in_group: set[str], *, decrement: bool
    ) -> None:
        if instance_id not in in_group:
            log.info("instance %s already left the group", instance_id)
            return
        await self._retry(
            "mark the instance unhealthy",
            lambda: autoscaling.set_instance_health(InstanceId=instance_id, HealthStatus="Unhealthy"),
        )
        await self._retry(
            "terminate the failed instance",
            lambda: autoscaling.terminate_instance_in_auto_scaling_group(
                InstanceId=instance_id, ShouldDecrementDesiredCapacity=decrement
            ),
        )

    async def _wait_for_new_instance(self, known: set[str]) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while loop.time() < deadline:
            fresh = [
                i["InstanceId"]
                for i in await self.instances()
                if i["InstanceId"] not in known and i["LifecycleState"] == "InService"
            ]
            if (chosen := self._claim_first(fresh)) is not None:
                return chosen
            await asyncio.sleep(self.poll_s)
        raise CloudOperatorError(f"no replacement instance in {self.asg_name!r} after {self.timeout_s:.0f}s")

    def _claim_first(self, candidates: list[str]) -> str | None:
        """The first candidate no other replacement took, now claimed. No await between the check and
        the claim, so concurrent replacements on the event loop cannot both take one instance."""
        for instance_id in sorted(candidates):
            if instance_id not in self._claimed:
                self._claimed.add(instance_id)
                return instance_id
        return None

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        delay = 0.5
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if code not in RETRYABLE and status < 500:
                    raise CloudOperatorError(f"AWS refused to {what}: {code}: {exc}") from exc
                problem = f"{code or status}"
            except (BotoCoreError, OSError) as exc:
                problem = type(exc).__name__
            if attempt == self.attempts:
                raise CloudOperatorError(f"could not {what} after {attempt} attempts ({problem})")
            log.warning("AWS: %s failed (%s), attempt %d; retrying in %.1fs", what, problem, attempt, delay)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 20.0)
        raise AssertionError("unreachable")
