"""Async client of the root service's worker API, used by the agent.

Training must not stop because the root is briefly gone (restarting, or leadership moving to another
replica), so transport errors and 5xx answers are retried with backoff, across every root URL given; a
4xx is the root's considered answer and is raised at once as RootRejected with its error code. The retry
policy (tenacity) and the error shape are `worker_lib.rest`'s, which the operator CLI uses too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
import tenacity

from worker_lib import rest

log = logging.getLogger(__name__)


class RootUnavailable(Exception):
    """No root replica answered within the retry budget."""


class RootRejected(Exception):
    """The root answered with a 4xx: `status`, `code` (stable, machine-readable) and its message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class RootClient:
    def __init__(
        self,
        root_urls: str | Sequence[str],
        job_id: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        retry_for_s: float = 60.0,
    ):
        urls = root_urls.split(",") if isinstance(root_urls, str) else list(root_urls)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("at least one root URL is needed")
        self.job_id = job_id
        self.retry_for_s = retry_for_s
        self._current = 0  # index of the replica that answered last
        self._http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=httpx.Timeout(timeout_s, connect=3.0)
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RootClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- worker API --------------------------------------------------------------------------------------

    async def register(self, **body: Any) -> dict[str, Any]:
        return await self._call("POST", "/machines", json=body)

    async def heartbeat(self, rank: int, instance_id: str, summary: dict[str, Any]) -> dict[str, Any]:
        # A heartbeat is worth nothing once the next one is due: retry briefly only.
        body = {"instance_id": instance_id, "summary": summary}
        return await self._call("POST", f"/machines/{rank}/heartbeat", json=body, retry_for_s=2.0)

    async def report_exit(
        self,
        rank: int,
        instance_id: str,
        *,
        local_rank: int,
        global_rank: int,
        exit_code: int,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "local_rank": local_rank,
            "global_rank": global_rank,
            "exit_code": exit_code,
        }
        if error is not None:  # the exception from the process's torchelastic error file
            body["error"] = error
        return await self._call("POST", f"/machines/{rank}/exits", json=body)

    async def directive(self, after: int, wait_s: float = 10.0) -> dict[str, Any]:
        """The job's current directive, once its generation is newer than `after` (long poll)."""
        params = {"after": after, "wait": wait_s}
        return await self._call("GET", "/directive", params=params, timeout_s=wait_s + 10)

    async def report_inventory(self, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/machines/{rank}/inventory", json=body)

    async def report_progress(self, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/machines/{rank}/progress", json=body)

    async def report_persisted(self, rank: int, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/machines/{rank}/persisted", json=body)

    # -- transport ---------------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        retry_for_s: float | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        budget = self.retry_for_s if retry_for_s is None else retry_for_s
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        problem = ""
        try:
            async for attempt in rest.retrying(budget, len(self.urls)):
                with attempt:
                    url = f"{self.urls[self._current]}/api/v1/worker/jobs/{self.job_id}{path}"
                    try:
                        response = await self._http.request(
                            method, url, json=json, params=params, timeout=timeout
                        )
                        rest.raise_for_server_error(response)
                    except rest.RETRYABLE as exc:
                        problem = (
                            str(exc)
                            if isinstance(exc, rest.ServerError)
                            else f"{type(exc).__name__} for {url}"
                        )
                        # The next replica gets the next attempt (at once; the policy backs off only
                        # after all of them failed).
                        self._current = (self._current + 1) % len(self.urls)
                        raise
                    return _decode(response)
        except tenacity.RetryError as exc:
            attempts = exc.last_attempt.attempt_number
            raise RootUnavailable(f"root unreachable after {attempts} attempts: {problem}") from None
        raise AssertionError("unreachable: tenacity either returns an attempt's result or raises")


def _decode(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        code, message = rest.api_error(response)
        raise RootRejected(
            response.status_code, code if code != f"http_{response.status_code}" else "http_error", message
        )
    if response.status_code == 204 or not response.content:
        return {}
    body: dict[str, Any] = response.json()
    return body
