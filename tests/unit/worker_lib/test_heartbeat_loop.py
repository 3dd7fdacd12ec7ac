"""The agent's REST heartbeat loop outlives answers that are not the root's API (a proxy's error page with
a 200, a root of another version): before, one of them ended the loop, and the agent with it (exit 1,
training killed, a recovery for nothing)."""

from __future__ import annotations

import asyncio
from typing import Any

from worker_lib.agent.heartbeat import rest_heartbeats
from worker_lib.client import RootUnavailable, UnexpectedAnswer


class Root:
    """Answers each heartbeat with the next of `answers` (an exception is raised), then waits."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.calls = 0
        self.done = asyncio.Event()

    async def heartbeat(self, rank: int, instance_id: str, summary: dict[str, Any]) -> Any:
        self.calls += 1
        if not self.answers:
            self.done.set()
            await asyncio.Event().wait()
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_heartbeats_go_on_after_answers_that_are_not_the_root_s_api() -> None:
    root = Root(
        [
            UnexpectedAnswer("not JSON: <html>proxy error</html>", 200, "http://root/heartbeat"),
            RootUnavailable("connection refused"),
            "ok",
        ]
    )
    answered: list[Any] = []

    async def main() -> None:
        loop = asyncio.create_task(
            rest_heartbeats(root, 0, "i-0", 0.001, dict, on_response=answered.append)  # type: ignore[arg-type]
        )
        await asyncio.wait_for(root.done.wait(), 10)
        assert not loop.done(), "the loop ended"
        loop.cancel()

    asyncio.run(main())
    assert root.calls == 4 and answered == ["ok"]


class AlwaysOk:
    async def heartbeat(self, rank: int, instance_id: str, summary: dict[str, Any]) -> str:
        return "ok"


def test_a_cancellation_that_arrives_as_the_loop_is_woken_ends_the_loop() -> None:
    """On Python 3.11 asyncio.wait_for dropped a cancellation delivered while the event it waited on was
    being set: the loop heartbeated on, and the agent's stop, which waits for its loops, hung."""

    async def cancelled_after(steps: int) -> bool:
        wake = asyncio.Event()
        first_beat = asyncio.Event()

        def answered(answer: Any) -> None:
            first_beat.set()

        loop = asyncio.create_task(rest_heartbeats(AlwaysOk(), 0, "i-0", 30.0, dict, answered, wake))  # type: ignore[arg-type]
        await first_beat.wait()  # the first heartbeat went out: the loop now waits on `wake`
        wake.set()
        for _ in range(steps):
            await asyncio.sleep(0)
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=2)
        if not done:
            loop.cancel()  # stop it for good, whatever this step counted
            await asyncio.gather(loop, return_exceptions=True)
        return bool(done) and loop.cancelled()

    async def main() -> list[int]:
        return [steps for steps in range(6) if not await cancelled_after(steps)]

    assert asyncio.run(main()) == [], "the loop outlived its cancellation after these many steps"
