"""Ctrl-C in the operator CLI: every one stops the command (KeyboardInterrupt, exit 130 in `ops.run`),
wherever it lands. asyncio.Runner's own handling lost about one in 2,000 calls (a `castor jobs watch` kept
running after it, seen once in the suite): these are the ways a Ctrl-C got lost."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from services.cli import client as cli_client

PAGE = {"items": [], "total": 0, "limit": 50, "offset": 0}


@pytest.fixture(autouse=True)
def default_sigint_handler() -> Iterator[None]:
    """Python's default SIGINT handler, as a command starts with (the suite may have its own)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _client(transport: httpx.AsyncBaseTransport) -> cli_client.CliClient:
    connection = cli_client.Connection("http://root:8080", "castor-admin.x", "--token")
    return cli_client.CliClient(connection, transport=transport, retry_for_s=0.0)


def test_a_ctrl_c_whose_cancellation_a_library_turns_into_a_timeout_still_stops_the_command() -> None:
    """Taken for a root briefly unreachable, `jobs watch` would go on watching."""

    async def handler(request: httpx.Request) -> httpx.Response:
        ctrl_c()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            raise httpx.ReadTimeout("timed out", request=request) from None
        return httpx.Response(200, json=PAGE)

    client = _client(httpx.MockTransport(handler))
    with pytest.raises(KeyboardInterrupt), client:
        client.run(client.api.jobs())


def test_a_ctrl_c_whose_cancellation_is_swallowed_still_stops_the_command() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        ctrl_c()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(5)
        return httpx.Response(200, json=PAGE)

    client = _client(httpx.MockTransport(handler))
    with pytest.raises(KeyboardInterrupt), client:
        client.run(client.api.jobs())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_a_finalizer_swallowed_stops_the_next_call() -> None:
    """Python ignores what a __del__ raises, KeyboardInterrupt included: a Ctrl-C that lands in one
    between two calls (the watch's rendering, a collection) is raised by the next call."""

    class Finalized:
        def __del__(self) -> None:
            ctrl_c()
            sum(range(1000))  # the handler runs here, inside the finalizer

    sent: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(200, json=PAGE)

    client = _client(httpx.MockTransport(handler))
    with pytest.raises(KeyboardInterrupt), client:
        client.run(client.api.jobs())
        Finalized()
        gc.collect()
        client.run(client.api.jobs())
    assert len(sent) == 1, "the call after the Ctrl-C is not sent"


def test_without_python_s_default_handler_the_command_leaves_sigint_as_it_found_it() -> None:
    """SIGINT ignored (a background job of a non-interactive shell): the client does not take it over."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = _client(httpx.MockTransport(lambda request: httpx.Response(200, json=PAGE)))
    with client:
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        ctrl_c()
        client.run(client.api.jobs())
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_work_on_another_event_loop_gets_python_s_own_handling() -> None:
    """The export downloads with asyncio.run inside the command: a Ctrl-C cancels that loop's task (which
    cleans up as cancelled), as it would outside the client, rather than landing anywhere in it."""
    cleaned_up: list[str] = []

    async def download() -> None:
        try:
            ctrl_c()
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cleaned_up.append("cancelled")
            raise

    client = _client(httpx.MockTransport(lambda request: httpx.Response(200, json=PAGE)))
    with pytest.raises(KeyboardInterrupt), client, client.python_ctrl_c():
        asyncio.run(download())
    assert cleaned_up == ["cancelled"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
