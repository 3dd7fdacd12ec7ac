"""The AWS cloud operator: replaces a failed machine through its Auto Scaling Group (aioboto3).

Replacement: mark the instance Unhealthy, terminate it without decrementing the desired capacity, and wait
until the group has a new InService instance; or, with standby instances, move one into service (seconds
instead of the minutes a new p4d takes) and terminate the failed one with a decrement.

Decide, record, act: before each of these calls the replacement records on its failure event what it is
about to do (`domain.replacement.Intent`: the instance being replaced, the Standby instance chosen, that a
termination was requested), and every try, a retry after an error or a new leader's, decides its next call
from that record and the group's actual state (`domain.replacement.decide`). A failed instance already
terminating is not terminated again, a chosen Standby instance already in service is not moved again, and a
new InService instance no machine holds is adopted: a replacement is requested once, whoever continues it.

At scale (a lost placement group is several replacements at once, and AWS throttles the Auto Scaling API
per account) the operator keeps one long-lived client whose retries are botocore's `adaptive` mode
(exponential backoff with jitter plus a client-side rate limiter that slows down when AWS throttles), and
one poller of the group serves every replacement waiting for a new instance: N concurrent replacements
cost one DescribeAutoScalingGroups call per poll, not N. What still fails after botocore's retries becomes
a CloudOperatorError that the recovery records and retries, never a crash of the root.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from services.root.clients import CloudOperatorError, JobInfo, MachineInfo, Replacement, ReplacementJournal
from services.root.domain.replacement import (
    Action,
    AwaitNew,
    Done,
    ExitStandby,
    Intent,
    decide,
    group_state,
)

log = logging.getLogger(__name__)

# Decisions one try of a replacement makes at most: a Standby instance moved into service, the failed one
# terminated, the outcome is three; the rest is room for a chosen instance that left the group meanwhile
# (or that AWS refused to move into service).
MAX_ACTIONS = 5

# Error codes of an AWS answer that a later call may not get (throttling, a transient or a contended
# resource): retried, never taken as a refusal. Server errors (5xx) are retried too.
RETRYABLE_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "LimitExceededException",
        "SlowDown",
        "PriorRequestNotComplete",
        "RequestTimeout",
        "RequestTimeoutException",
        "ResourceContention",
        "ScalingActivityInProgress",
        "InternalFailure",
        "ServiceUnavailable",
    }
)


class Refused(CloudOperatorError):
    """AWS answered the call with an error a retry does not change (a validation error such as a group's
    MaxSize, a missing IAM permission): neither throttling nor a transient or server error."""

    def __init__(self, message: str, code: str, reason: str):
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(eq=False)
class _Waiter:
    """A replacement waiting for a new InService instance it has not seen before."""

    known: set[str]
    key: str  # the replacement waiting (its claims)
    chosen: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


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
        self.config = Config(
            retries={"mode": "adaptive", "total_max_attempts": attempts}, connect_timeout=10, read_timeout=30
        )
        self._session = aioboto3.Session(region_name=region)
        self._client: Any = None
        self._client_stack = contextlib.AsyncExitStack()
        self._client_lock = asyncio.Lock()
        self._waiters: list[_Waiter] = []
        self._poller: asyncio.Task[None] | None = None
        # Instances never to hand out to another replacement: those handed out (or chosen) and those being
        # replaced, each with the replacement (its journal's key) that claimed it. Replacements run
        # concurrently (a lost group is two at once) and an instance is bound in the database only when its
        # agent registers, so without this two ranks could be promised the same standby or new instance, or
        # one rank the failed instance another replacement is terminating. Across leaders the failure events
        # carry the same knowledge (the driver passes what other replacements recorded as bound).
        self._claims: dict[str, str] = {}

    async def provision(self, job: JobInfo, worker_token: str) -> None:
        return None  # the group's launch template boots instances that run `castor agent`

    async def release(self, job: JobInfo) -> None:
        return None

    async def close(self) -> None:
        """Stop the poller and close the long-lived client (the root's shutdown)."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self._client_stack.aclose()
        self._client = None

    async def _autoscaling(self) -> Any:
        """The one Auto Scaling client, opened on first use: a client per call would pay a TLS handshake
        each time and reset the adaptive rate limiter's view of how hard AWS is throttling us."""
        async with self._client_lock:
            if self._client is None:
                self._client = await self._client_stack.enter_async_context(
                    self._session.client("autoscaling", endpoint_url=self.endpoint_url, config=self.config)
                )
            return self._client

    async def _call(self, what: str, operation: str, **params: Any) -> Any:
        client = await self._autoscaling()
        try:
            return await getattr(client, operation)(**params)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code, reason = str(error.get("Code", "")), str(error.get("Message", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 400
            message = f"AWS refused to {what}: {code}: {exc}"
            if code in RETRYABLE_CODES or status >= 500:
                raise CloudOperatorError(message) from exc
            raise Refused(message, code, reason) from exc
        except (BotoCoreError, OSError) as exc:
            raise CloudOperatorError(f"could not {what}: {type(exc).__name__}: {exc}") from exc

    async def instances(self) -> list[dict[str, Any]]:
        """The group's instances: InstanceId, LifecycleState, HealthStatus."""
        groups = await self._call(
            "describe the group", "describe_auto_scaling_groups", AutoScalingGroupNames=[self.asg_name]
        )
        if not groups["AutoScalingGroups"]:
            raise CloudOperatorError(f"Auto Scaling Group {self.asg_name!r} does not exist")
        instances: list[dict[str, Any]] = groups["AutoScalingGroups"][0]["Instances"]
        return instances

    async def replace(
        self,
        job: JobInfo,
        failed: MachineInfo,
        bound_instances: set[str],
        journal: ReplacementJournal | None = None,
    ) -> Replacement:
        """Decide, record, act, until an instance takes the rank: each round describes the group, lets the
        pure `domain.replacement.decide` choose the next call from the recorded intent and the group's
        state, records the call's intent in `journal` (the failure event) and only then makes it. A try
        that finds an intent recorded (a retry, or a new leader) so continues where the group is: no second
        termination, no second Standby instance, no second launch."""
        journal = journal if journal is not None else ReplacementJournal()
        key = journal.key
        intent = Intent.from_json(journal.intent, replacing=failed.instance_id)
        self._claims.setdefault(failed.instance_id, key)
        self._claims.setdefault(intent.replacing, key)
        previous: Action | None = None
        for _ in range(MAX_ACTIONS):
            group = group_state(await self.instances())
            # No await between the decision and the claims: concurrent replacements on the event loop
            # cannot both take one instance.
            action = decide(intent, group, bound_instances | self._taken(key), use_standby=self.use_standby)
            if action == previous:
                raise CloudOperatorError(
                    f"the group does not show the effect of {action} yet; the replacement will retry"
                )
            previous = action
            if isinstance(action, Done):
                self._claims[action.instance] = key
                how = (
                    "standby instance {} moved into service"
                    if action.standby
                    else "Auto Scaling Group launched {}"
                )
                return Replacement(action.instance, how.format(action.instance), {"standby": action.standby})
            if isinstance(action, AwaitNew):
                replacement = await self._wait_for_new_instance(set(action.exclude), key)
                return Replacement(
                    replacement, f"Auto Scaling Group launched {replacement}", {"standby": False}
                )
            if isinstance(action, ExitStandby):
                self._claims[action.instance] = key
                intent = intent.exiting_standby(action.instance, _now())
                await journal.record(intent.to_json())
                try:
                    await self._call(
                        "move a standby instance into service",
                        "exit_standby",
                        AutoScalingGroupName=self.asg_name,
                        InstanceIds=[action.instance],
                    )
                except Refused as exc:
                    if "not in standby" in exc.reason.lower():
                        # An earlier try's call landed and its answer was lost: the instance is in service
                        # (or on its way). No refusal: the next try decides from the group's state.
                        raise CloudOperatorError(str(exc)) from exc
                    # Asking again would be refused again (and so would another Standby instance): recorded,
                    # the next decision goes without a Standby instance, and the group launches one.
                    why = f"{exc.code}: {exc.reason}"[:500]
                    log.warning(
                        "replacing %s: AWS refused to move standby instance %s into service (%s); "
                        "replacing it without a standby instance: the group launches a new one",
                        intent.replacing,
                        action.instance,
                        why,
                    )
                    intent = intent.standby_refused(why)
                    await journal.record(intent.to_json())
                    if self._claims.get(action.instance) == key:
                        del self._claims[action.instance]
            else:
                intent = intent.terminating(_now())
                await journal.record(intent.to_json())
                await self._terminate(action.instance, decrement=action.decrement)
        raise CloudOperatorError(f"replacing {failed.instance_id}: no outcome after {MAX_ACTIONS} steps")

    async def _terminate(self, instance_id: str, *, decrement: bool) -> None:
        await self._call(
            "mark the instance unhealthy",
            "set_instance_health",
            InstanceId=instance_id,
            HealthStatus="Unhealthy",
        )
        await self._call(
            "terminate the failed instance",
            "terminate_instance_in_auto_scaling_group",
            InstanceId=instance_id,
            ShouldDecrementDesiredCapacity=decrement,
        )

    def _taken(self, key: str) -> set[str]:
        """Instances claimed by other replacements of this operator."""
        return {instance for instance, owner in self._claims.items() if owner != key}

    async def _wait_for_new_instance(self, known: set[str], key: str | None = None) -> str:
        waiter = _Waiter(set(known), key if key is not None else uuid.uuid4().hex)
        self._waiters.append(waiter)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_group(), name=f"asg-poller-{self.asg_name}")
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: on 3.11 it can swallow a cancellation
                return await asyncio.shield(waiter.chosen)
        except TimeoutError:
            raise CloudOperatorError(
                f"no replacement instance in {self.asg_name!r} after {self.timeout_s:.0f}s"
            ) from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def _poll_group(self) -> None:
        """The one poller: each round describes the group once and hands each waiting replacement, oldest
        first, a new InService instance it has not seen. Runs while anyone waits."""
        while self._waiters:
            try:
                current = await self.instances()
            except CloudOperatorError as exc:
                # botocore already retried; the recoveries waiting record the failure and try again.
                for waiter in self._waiters:
                    if not waiter.chosen.done():
                        waiter.chosen.set_exception(exc)
                self._waiters.clear()
                return
            in_service = [
                i["InstanceId"]
                for i in current
                if i["LifecycleState"] == "InService" and i.get("HealthStatus", "Healthy") == "Healthy"
            ]
            for waiter in list(self._waiters):
                if waiter.chosen.done():  # timed out or cancelled meanwhile
                    self._waiters.remove(waiter)
                    continue
                chosen = self._claim_first([i for i in in_service if i not in waiter.known], waiter.key)
                if chosen is not None:
                    waiter.chosen.set_result(chosen)
                    self._waiters.remove(waiter)
            if self._waiters:
                await asyncio.sleep(self.poll_s)

    def _claim_first(self, candidates: list[str], key: str) -> str | None:
        """The first candidate no other replacement took, now claimed for `key`. No await between the
        check and the claim, so concurrent replacements on the event loop cannot both take one instance."""
        for instance_id in sorted(candidates):
            if self._claims.get(instance_id, key) == key:
                self._claims[instance_id] = key
                return instance_id
        return None


def _now() -> str:
    return datetime.now(UTC).isoformat()
