"""The transport policy of the root's REST API client (`worker_lib.client.RootClient`), which the agent
(worker token) and the operator CLI (`services.cli.client`, admin token) share:

- `api_error`: the API's one error shape, {"error": {"code", "message", "details"}}, read from a response
  (a proxy's or a wrong URL's HTML answer becomes code http_<status> and the start of its text).
- `retrying`: the retry policy, from tenacity rather than a hand-rolled loop: transport errors and 5xx
  answers are retried until a time budget is spent, a 4xx never is (it is the root's considered answer).
  With several root replicas the next one is tried at once and the policy backs off only after a full
  round of them failed (exponential from 0.1 s to 2 s, with jitter so that a job's agents do not come
  back in step).

Kept in worker_lib (never importing services or fastapi): it ships in the training-side package.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import httpx
import tenacity

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MOST_BACKOFF_S = 2.0


class ServerError(Exception):
    """A 5xx answer: the root (or a proxy in front of it) failed this time; worth another try."""

    def __init__(self, response: httpx.Response):
        super().__init__(f"{response.status_code} from {response.request.url}")
        self.response = response


RETRYABLE = (httpx.TransportError, ServerError)


def api_error(response: httpx.Response, limit: int = 500) -> tuple[str, str]:
    """(code, message) of an error answer, from the API's error shape when it has one."""
    try:
        error = response.json()["error"]
        return str(error["code"]), str(error["message"])
    except (ValueError, KeyError, TypeError):
        text = response.text.strip()[:limit]
        return (
            f"http_{response.status_code}",
            text or response.reason_phrase or f"HTTP {response.status_code}",
        )


def raise_for_server_error(response: httpx.Response) -> httpx.Response:
    if response.status_code >= 500:
        raise ServerError(response)
    return response


def backoff(replicas: int) -> Callable[[tenacity.RetryCallState], float]:
    """No wait between the replicas of one round; after a full round, exponential backoff with jitter."""

    def wait(state: tenacity.RetryCallState) -> float:
        rounds, within = divmod(state.attempt_number, max(1, replicas))
        if within:
            return 0.0
        delay = min(FIRST_BACKOFF_S * 2.0 ** (rounds - 1), MOST_BACKOFF_S)
        return delay * (0.75 + random.random() / 2)

    return wait


def _log_backoff(state: tenacity.RetryCallState) -> None:
    if state.next_action is not None and state.next_action.sleep > 0 and state.outcome is not None:
        log.info(
            "root not answering (%s); retrying in %.1fs", state.outcome.exception(), state.next_action.sleep
        )


# What the operator CLI retries: an answer that failed on the way (a 5xx, a connection dropped mid-request,
# as when a root replica restarts), not a root that is not there at all: an operator typing a command is
# better served by "connection refused" at once than after a budget of retries.
DROPPED = (ServerError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def retrying(
    budget_s: float,
    replicas: int = 1,
    *,
    asynchronous: bool = True,
    retry_on: tuple[type[BaseException], ...] = RETRYABLE,
    reraise: bool = False,
) -> Any:
    """A tenacity retrier (AsyncRetrying, or Retrying when not `asynchronous`) for one API call: retries
    `retry_on` errors while less than `budget_s` has passed since the first attempt (the last wait is cut
    to what is left of it; 0: one attempt); once it is spent tenacity.RetryError, or with `reraise` the
    last attempt's own exception; anything else propagates at once."""

    wait_for = backoff(replicas)

    def wait(state: tenacity.RetryCallState) -> float:
        return min(wait_for(state), max(0.0, budget_s - (state.seconds_since_start or 0.0)))

    options: dict[str, Any] = {
        "retry": tenacity.retry_if_exception_type(retry_on),
        "stop": tenacity.stop_after_delay(budget_s),
        "wait": wait,
        "before_sleep": _log_backoff,
        "reraise": reraise,
    }
    return tenacity.AsyncRetrying(**options) if asynchronous else tenacity.Retrying(**options)
