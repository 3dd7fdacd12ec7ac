"""How an operator command reaches the root: the connection (--root, --token and where they came from)
and the shared API client, `worker_lib.client.RootClient`, driven synchronously.

Every expected problem (an unreachable root, a bad token, an unknown job, a 409/422 from the server)
becomes a CliError with one clear line of advice, printed with exit code 1 by `services.cli.ops.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import threading
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pydantic_core

from worker_lib import rest
from worker_lib.client import RootClient, RootRejected, RootUnavailable, UnexpectedAnswer

DEFAULT_ROOT_URL = "http://127.0.0.1:8080"

T = TypeVar("T")


class CliError(Exception):
    """An expected problem: printed as one line, exit code 1, never a traceback."""

    exit_code = 1


class Unreachable(CliError):
    """The root service did not answer (connection refused, DNS, timeout)."""


class ApiError(CliError):
    def __init__(self, message: str, *, status: int, code: str):
        super().__init__(message)
        self.status = status
        self.code = code


class NotFound(ApiError):
    pass


@dataclass(frozen=True)
class Connection:
    root_url: str
    token: str
    token_source: str


def resolve_connection(
    root: str | None, token: str | None, environ: dict[str, str] | None = None, cwd: Path | None = None
) -> Connection:
    """--root / CASTOR_ROOT_URL / the default; --token / CASTOR_ADMIN_TOKEN / the admin-token file the
    embedded service writes into its state directory ($CASTOR_STATE_DIR, else .castor)."""
    env = dict(os.environ) if environ is None else environ
    url = (root or env.get("CASTOR_ROOT_URL") or DEFAULT_ROOT_URL).rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if token:
        return Connection(url, token, "--token")
    if env.get("CASTOR_ADMIN_TOKEN"):
        return Connection(url, env["CASTOR_ADMIN_TOKEN"], "CASTOR_ADMIN_TOKEN")
    here = cwd or Path.cwd()
    candidates = []
    if env.get("CASTOR_STATE_DIR"):
        candidates.append(Path(env["CASTOR_STATE_DIR"]) / "admin-token")
    candidates.append(Path(".castor") / "admin-token")
    for candidate in candidates:
        path = candidate if candidate.is_absolute() else here / candidate
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            return Connection(url, text, f"the file {candidate}")
    raise CliError(
        "no admin token: pass --token or set CASTOR_ADMIN_TOKEN (a service that generated its token keeps it "
        "in $CASTOR_STATE_DIR/admin-token, default .castor/admin-token; `castor serve` prints where)"
    )


def mask_token(token: str) -> str:
    """Enough of a token to tell which one it was, not enough to use it."""
    prefix, dot, secret = token.rpartition(".")
    if dot and prefix and len(secret) > 8:
        return f"{prefix}.{secret[:4]}..."
    return f"{token[: 4 if len(token) > 12 else 1]}... ({len(token)} characters)"


class CliClient:
    """`api` (the shared RootClient, public surface, admin token) run from one event loop per command:
    `client.run(client.api.job(job_id))` returns the API's model or raises a CliError.

    Reads are retried (worker_lib.rest's tenacity policy, as the agent's calls are) when the answer failed
    on the way: a 5xx or a dropped connection, as while a root replica restarts. A root that is not there
    at all is said at once (an operator typing a command is better served by "connection refused" than by
    a budget of retries), and writes are sent once: a POST that reached the root before its answer was
    lost must not run twice."""

    def __init__(
        self,
        connection: Connection,
        *,
        timeout: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        retry_for_s: float = 5.0,
    ):
        self.connection = connection
        self.timeout = timeout
        self.api = RootClient(
            connection.root_url,
            "",
            connection.token,
            timeout_s=timeout,
            retry_for_s=retry_for_s,
            retry_on=rest.DROPPED,
            retry_writes=False,
            transport=transport,
            user_agent="castor-cli",
        )
        self._loop = asyncio.Runner()
        # Ctrl-C: how many came while the client was open, and the call running (see _on_ctrl_c).
        self.interrupts = 0
        self._running: asyncio.Task[Any] | None = None
        self._closing = False
        self._previous_handler: Any = None

    def __enter__(self) -> CliClient:
        # The command's own Ctrl-C handling, where Python's default is in place (not where SIGINT is
        # ignored, as in a background job, or a caller handles it), in the main thread (signals go there).
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous_handler = signal.signal(signal.SIGINT, self._on_ctrl_c)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._closing = True
        try:
            self._until_done(self.api.close())
        finally:
            try:
                self._loop.close()
            finally:
                if self._previous_handler is not None and signal.getsignal(signal.SIGINT) == self._on_ctrl_c:
                    signal.signal(signal.SIGINT, self._previous_handler)
        if self.interrupts and exc_type is None:  # a Ctrl-C while the client closed
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def python_ctrl_c(self) -> Iterator[None]:
        """Python's own Ctrl-C handling for work the client does not run: another event loop's
        (`asyncio.run`, as the export's downloads), which cancels its task on a Ctrl-C only where Python's
        default handler is in place; with the client's, the interrupt would land anywhere in it."""
        if self._previous_handler is None:
            yield
            return
        signal.signal(signal.SIGINT, self._previous_handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, signum: int, frame: object) -> None:
        """A first Ctrl-C during a call cancels it, and `run` raises KeyboardInterrupt once it has ended,
        whatever it ended with; one while the client closes is raised once it is closed; elsewhere, or a
        second one, it raises KeyboardInterrupt at once, as Python's default does. A Ctrl-C that a
        finalizer swallowed (Python ignores what a __del__ raises) is raised by the next call.

        Not asyncio.Runner's own handling, which lost about one Ctrl-C in 2,000 calls and left `castor
        jobs watch` running: a library on the way may swallow the cancellation or turn it into a transport
        error (taken for a root briefly unreachable), and a Ctrl-C that comes after the call ended but
        before its loop stopped raises inside the loop, which then cannot close the client."""
        self.interrupts += 1
        if self.interrupts > 1:
            raise KeyboardInterrupt
        if self._closing:
            return  # the client closes whole first; __exit__ raises it
        running = self._running
        if running is not None:
            running.cancel()
            running.get_loop().call_soon_threadsafe(lambda: None)  # wake a loop waiting in select()
            return
        raise KeyboardInterrupt

    def _until_done(self, call: Coroutine[Any, Any, T]) -> T:
        loop = self._loop.get_loop()
        task: asyncio.Task[T] = loop.create_task(call)
        self._running = task
        try:
            return loop.run_until_complete(task)
        finally:
            self._running = None

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        """The call's answer; every expected problem as a CliError; KeyboardInterrupt after a Ctrl-C."""
        if self.interrupts:
            call.close()
            raise KeyboardInterrupt
        try:
            result = self._until_done(call)
        except BaseException as exc:
            if self.interrupts:
                raise KeyboardInterrupt from None
            expected = self._expected(exc)
            if expected is None:
                raise
            raise expected from None
        if self.interrupts:
            raise KeyboardInterrupt
        return result

    def _expected(self, exc: BaseException) -> CliError | None:
        """The CliError an expected problem becomes; None for anything else."""
        if isinstance(exc, RootRejected):
            return self._rejected(exc)
        if isinstance(exc, RootUnavailable):
            return self._unavailable(exc.cause or exc)
        if isinstance(exc, UnexpectedAnswer):
            return CliError(f"{exc}; is that URL a Castor root service?")
        if isinstance(exc, httpx.HTTPError | httpx.InvalidURL):
            return self._unavailable(exc)
        return None

    def document(self, call: Coroutine[Any, Any, Any]) -> Any:
        """The call's answer as the API's JSON document (the model as the root serialized it): what
        `--json` prints and the views read."""
        return jsonable(self.run(call))

    def _unavailable(self, problem: BaseException) -> CliError:
        url = self.connection.root_url
        if isinstance(problem, rest.ServerError):
            status = problem.response.status_code
            code, message = rest.api_error(problem.response, limit=300)
            return ApiError(f"the root service failed (HTTP {status}): {message}", status=status, code=code)
        if isinstance(problem, httpx.TimeoutException):
            return Unreachable(
                f"the root service at {url} did not answer within {self.timeout:g} s; is it overloaded "
                "or stuck? set --root or CASTOR_ROOT_URL to use another replica"
            )
        if isinstance(problem, httpx.ConnectError):
            return Unreachable(
                f"cannot reach the root service at {url}: {_connect_reason(problem)}; is `castor serve` "
                "running? set --root or CASTOR_ROOT_URL"
            )
        if isinstance(problem, httpx.UnsupportedProtocol | httpx.InvalidURL):
            return CliError(f"bad root URL {url!r}: {problem}")
        return Unreachable(f"cannot talk to the root service at {url}: {problem or type(problem).__name__}")

    def _rejected(self, exc: RootRejected) -> ApiError:
        status, code, message = exc.status, exc.code, exc.message
        if code == "http_error":  # not the API's error shape: say which status it was
            code = f"http_{status}"
        conn = self.connection
        used = f"the admin token {mask_token(conn.token)} from {conn.token_source}"
        if status == 401:
            return ApiError(
                f"the root service at {conn.root_url} rejected {used}: {message}. Use the service's admin "
                "token (--token or CASTOR_ADMIN_TOKEN; `castor serve` prints where it keeps it)",
                status=status,
                code=code,
            )
        if status == 403:
            return ApiError(
                f"{used} may not do this: {message}. The operator commands need the admin token, not a "
                "job's worker token",
                status=status,
                code=code,
            )
        if status == 404:
            if code in ("not_found", f"http_{status}"):  # no such route: not a Castor root at this URL
                message = (
                    f"{exc.url} does not exist (HTTP 404); is {conn.root_url} the base URL of a Castor root "
                    "service? set --root or CASTOR_ROOT_URL"
                )
            return NotFound(message, status=status, code=code)
        return ApiError(f"{message} ({code})", status=status, code=code)


def jsonable(answer: Any) -> Any:
    """An answer of the API client (a model, a list of them) as its JSON document."""
    return pydantic_core.to_jsonable_python(answer)


def resolve_job(client: CliClient, ref: str) -> dict[str, Any]:
    """A job by id or by name (names are unique; looked up through the list), as its JSON document."""
    try:
        uuid.UUID(ref)
    except ValueError:
        pass
    else:
        try:
            job: dict[str, Any] = client.document(client.api.job(ref))
            return job
        except NotFound:
            pass  # a name may look like an id
    offset = 0
    while True:
        page = client.run(client.api.jobs(limit=500, offset=offset))
        for item in page.items:
            if item.name == ref:
                found: dict[str, Any] = jsonable(item)
                return found
        offset += len(page.items)
        if not page.items or offset >= page.total:
            break
    raise NotFound(
        f"no job with id or name {ref!r} on {client.connection.root_url} (`castor jobs list` shows the jobs)",
        status=404,
        code="job_not_found",
    )


def _connect_reason(exc: httpx.ConnectError) -> str:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError) or getattr(cause, "errno", None) == errno.ECONNREFUSED:
            return "connection refused"
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or "connection failed"
