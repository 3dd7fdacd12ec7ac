"""The one client of the root service's REST API: the agent's (worker surface, a job's worker token) and
the operator CLI's (public surface, the admin token), returning the API's own pydantic models
(`worker_lib.api`, the models the root validates and documents with).

It is asynchronous (the agent runs on asyncio); the CLI drives it from one event loop per command
(`services.cli.client`). Retries are `worker_lib.rest`'s tenacity policy, across every root URL given:
by default (the agent's) transport errors and 5xx answers are retried with backoff within a time budget,
because training must not stop while the root restarts or leadership moves to another replica; the CLI
narrows what is retried and sends writes once (`retry_on`, `retry_writes`). A 4xx is the root's
considered answer and is raised at once as RootRejected with its error code.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import pydantic
import tenacity

from worker_lib import rest
from worker_lib.api.public import (
    FailureOut,
    JobCreated,
    JobOut,
    JobPage,
    MachineOut,
    PersistedCheckpointOut,
    RecoveryPlanOut,
)
from worker_lib.api.shared import PlacementOut
from worker_lib.api.worker import (
    CheckpointSummary,
    DirectiveOut,
    ExitAck,
    HeartbeatResponse,
    InventoryReport,
    PersistedReport,
    ProcessError,
    ProgressReport,
    RegisterRequest,
    RegisterResponse,
    ReplicationAlignment,
)

log = logging.getLogger(__name__)

API = "/api/v1"
T = TypeVar("T")
LIST_PAGE = 500  # the root's largest page of failures, plans and checkpoints
MAX_PAGES = 100_000  # a list whose next links never end is a broken root, not a long list
# A request body: the API's model, or the same document as a mapping (sent as is; the root validates it).
Body = pydantic.BaseModel | Mapping[str, Any]


class RootError(Exception):
    """Every problem this client raises."""


class RootUnavailable(RootError):
    """No root replica answered within the retry budget; `cause` is the last attempt's problem (a transport
    error, or rest.ServerError with the 5xx response)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


class RootRejected(RootError):
    """The root answered with a 4xx: `status`, `code` (stable, machine-readable) and its message."""

    def __init__(self, status: int, code: str, message: str, url: str = ""):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.url = status, code, message, url


class UnexpectedAnswer(RootError):
    """A 2xx answer that is not the API's: not JSON (a proxy's page, a URL that is not a root service) or
    not the model the route documents."""

    def __init__(self, message: str, status: int, url: str):
        super().__init__(message)
        self.status, self.url = status, url


def first_replica(key: str, replicas: int) -> int:
    """The replica (an index into the root URLs) a client identified by `key` asks first: stable across
    restarts, evenly spread over many keys."""
    return zlib.crc32(key.encode()) % replicas


class RootClient:
    def __init__(
        self,
        root_urls: str | Sequence[str],
        job_id: str,
        token: str,
        *,
        timeout_s: float = 10.0,
        retry_for_s: float = 60.0,
        retry_on: tuple[type[BaseException], ...] = rest.RETRYABLE,
        retry_writes: bool = True,
        transport: httpx.AsyncBaseTransport | None = None,
        user_agent: str | None = None,
        spread_key: str | None = None,
    ):
        """`job_id`: the job whose worker surface this client calls ("": the public surface only).
        `retry_writes`: whether POSTs and DELETEs are retried like reads (the agent's writes are idempotent
        reports; an operator's write that reached the root before its answer was lost must not run twice).
        `spread_key` (an agent's instance id): the replica asked first is `first_replica(spread_key, n)`
        instead of the first URL, so a job's agents given the same URLs spread over the replicas."""
        urls = root_urls.split(",") if isinstance(root_urls, str) else list(root_urls)
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("at least one root URL is needed")
        self.job_id = job_id
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.retry_on = retry_on
        self.retry_writes = retry_writes
        # The index of the replica that answered last. Every replica serves the worker API (the leader only
        # also orchestrates), and a recovery's burst of a thousand agents' requests is one process's CPU:
        # agents that each start on their own replica share it out.
        self._current = first_replica(spread_key, len(self.urls)) if spread_key else 0
        headers = {"Authorization": f"Bearer {token}"}
        if user_agent:
            headers["User-Agent"] = user_agent
        self._http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=3.0), transport=transport
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RootClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- worker surface (the agent) ----------------------------------------------------------------------

    async def register(self, body: RegisterRequest | None = None, **fields: Any) -> RegisterResponse:
        return await self.call(RegisterResponse, "POST", self._worker("/machines"), json=body or fields)

    async def heartbeat(
        self, rank: int, instance_id: str, summary: CheckpointSummary | Mapping[str, Any]
    ) -> HeartbeatResponse:
        body = {"instance_id": instance_id, "summary": summary}
        # A heartbeat is worth nothing once the next one is due: retry briefly only.
        return await self.call(
            HeartbeatResponse, "POST", self._worker(f"/machines/{rank}/heartbeat"), json=body, retry_for_s=2.0
        )

    async def replication_alignment(
        self, heard: ReplicationAlignment | None, wait_s: float = 5.0
    ) -> ReplicationAlignment | None:
        """The job's replication alignment once it differs from `heard` (long poll); None: no machine
        replicates, or the job does not align."""
        params: dict[str, Any] = {"wait": wait_s}
        if heard is not None:
            params.update(
                aligned_iteration=-1 if heard.aligned_iteration is None else heard.aligned_iteration,
                target=-1 if heard.target is None else heard.target,
                go=str(heard.go).lower(),
            )
        return await self.call(
            ReplicationAlignment | None,  # type: ignore[arg-type]
            "GET",
            self._worker("/replication-alignment"),
            params=params,
            timeout_s=wait_s + 10,
        )

    async def report_exit(
        self,
        rank: int,
        instance_id: str,
        *,
        local_rank: int,
        global_rank: int,
        exit_code: int,
        error: ProcessError | Mapping[str, str] | None = None,
        generation: int | None = None,
    ) -> ExitAck:
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "local_rank": local_rank,
            "global_rank": global_rank,
            "exit_code": exit_code,
        }
        if error is not None:  # the exception from the process's torchelastic error file
            body["error"] = error
        url = self._worker(f"/machines/{rank}/exits")
        if generation is None:
            return await self.call(ExitAck, "POST", url, json=body)
        try:
            return await self.call(ExitAck, "POST", url, json={**body, "generation": generation})
        except RootRejected as exc:
            # A root older than the report's generation forbids the field: the report without it, as before.
            if exc.status != 422 or "generation" not in exc.message:
                raise
        return await self.call(ExitAck, "POST", url, json=body)

    async def directive(self, after: int, wait_s: float = 10.0, machine: int | None = None) -> DirectiveOut:
        """The job's current directive, once its revision is newer than `after` (long poll). With `machine`,
        that machine's share: its ranks' sources, itself and the peers holding its replicas (an older root
        answers with the whole job's, which holds the same and more)."""
        params: dict[str, Any] = {"after": after, "wait": wait_s}
        if machine is not None:
            params["machine"] = machine
        return await self.call(
            DirectiveOut, "GET", self._worker("/directive"), params=params, timeout_s=wait_s + 10
        )

    async def report_inventory(
        self,
        rank: int,
        body: InventoryReport | Mapping[str, Any],
        *,
        after: int = -1,
        wait_s: float | None = None,
    ) -> DirectiveOut | None:
        """Report what this machine holds. With `wait_s`, the report is also the machine's next directive
        long poll (as `directive(after, wait_s, machine=rank)`): the answer is its directive, or None from
        a root that only records reports (it answers 204)."""
        path = self._worker(f"/machines/{rank}/inventory")
        if wait_s is None:
            await self.request("POST", path, json=body)
            return None
        params = {"after": after, "wait": wait_s}
        document = await self.request("POST", path, json=body, params=params, timeout_s=wait_s + 10)
        return None if document is None else await self._validated(DirectiveOut, path, document)

    async def report_progress(self, rank: int, body: ProgressReport | Mapping[str, Any]) -> None:
        await self.request("POST", self._worker(f"/machines/{rank}/progress"), json=body)

    async def report_persisted(self, rank: int, body: PersistedReport | Mapping[str, Any]) -> None:
        await self.request("POST", self._worker(f"/machines/{rank}/persisted"), json=body)

    # -- public surface (operators: the CLI) -------------------------------------------------------------

    async def create_job(self, body: Body) -> JobCreated:
        return await self.call(JobCreated, "POST", "/jobs", json=body)

    async def jobs(
        self, *, state: str | None = None, limit: int | None = None, offset: int | None = None
    ) -> JobPage:
        return await self.call(
            JobPage, "GET", "/jobs", params=_params(state=state, limit=limit, offset=offset)
        )

    async def job(self, job_id: str) -> JobOut:
        return await self.call(JobOut, "GET", f"/jobs/{job_id}")

    async def stop_job(self, job_id: str) -> JobOut:
        return await self.call(JobOut, "POST", f"/jobs/{job_id}/stop")

    async def delete_job(self, job_id: str) -> None:
        await self.request("DELETE", f"/jobs/{job_id}")

    async def machines(
        self, job_id: str, *, history: bool = False, limit: int | None = None, offset: int | None = None
    ) -> list[MachineOut]:
        """The job's machines by rank: every page (one request per 1,000 machines), or with `limit` and
        `offset` that page only."""
        params = _params(history="true" if history else None, limit=limit, offset=offset)
        return await self._list(MachineOut, f"/jobs/{job_id}/machines", params, whole=limit is None)

    async def placement(self, job_id: str) -> PlacementOut:
        return await self.call(PlacementOut, "GET", f"/jobs/{job_id}/placement")

    async def failures(self, job_id: str) -> list[FailureOut]:
        """Every failure of the job, newest first (one request per page of 500)."""
        return await self._list(FailureOut, f"/jobs/{job_id}/failures", {"limit": LIST_PAGE})

    async def failures_page(
        self, job_id: str, *, limit: int | None = None, before_id: int | None = None
    ) -> ListPage[FailureOut]:
        """One page of the job's failures, newest first: the newest `limit` (the root's default: 100), or
        those older than failure `before_id`."""
        params = _params(limit=limit, before_id=before_id)
        return await self.page(FailureOut, f"/jobs/{job_id}/failures", params)

    async def failure(self, job_id: str, failure_id: int) -> FailureOut:
        return await self.call(FailureOut, "GET", f"/jobs/{job_id}/failures/{failure_id}")

    async def recovery_plans(self, job_id: str) -> list[RecoveryPlanOut]:
        """Every recovery plan of the job, newest generation first (one request per page of 500)."""
        return await self._list(RecoveryPlanOut, f"/jobs/{job_id}/recovery-plans", {"limit": LIST_PAGE})

    async def checkpoints(self, job_id: str) -> list[PersistedCheckpointOut]:
        """Every persisted checkpoint of the job, newest first (one request per page of 500)."""
        return await self._list(PersistedCheckpointOut, f"/jobs/{job_id}/checkpoints", {"limit": LIST_PAGE})

    async def page(self, model: type[T], path: str, params: Mapping[str, Any] | None = None) -> ListPage[T]:
        """One page of a list endpoint: its items, the list's total (X-Total-Count) and the next page's
        query parameters (from its Link rel="next"; None on the last page). A root from before paging
        answers the whole list with neither header: one page, total None."""
        headers: dict[str, str] = {}
        document = await self.request("GET", path, params=params, answer_headers=headers)
        items = await self._validated(list[model], path, document)  # type: ignore[valid-type]
        total = headers.get("x-total-count")
        return ListPage(
            items, int(total) if total and total.isdigit() else None, next_params(headers.get("link"))
        )

    async def _list(
        self, model: type[T], path: str, params: Mapping[str, Any] | None, *, whole: bool = True
    ) -> list[T]:
        """Every item of a list endpoint, page after page (its Link rel="next"); `whole` False: the first."""
        found = await self.page(model, path, params)
        items = list(found.items)
        seen = 1
        while whole and found.next is not None and found.items:
            seen += 1
            if seen > MAX_PAGES:
                raise UnexpectedAnswer(f"{path} gave more than {MAX_PAGES} pages", 200, path)
            found = await self.page(model, path, found.next)
            items += found.items
        return items

    # -- transport ---------------------------------------------------------------------------------------

    def _worker(self, path: str) -> str:
        if not self.job_id:
            raise ValueError("the worker surface needs the client's job_id")
        return f"/worker/jobs/{self.job_id}{path}"

    async def call(
        self,
        model: type[T],
        method: str,
        path: str,
        *,
        json: Body | None = None,
        params: Mapping[str, Any] | None = None,
        retry_for_s: float | None = None,
        timeout_s: float | None = None,
    ) -> T:
        """`method` `path` (under /api/v1) and its answer as `model`: a pydantic model, or a type such as
        list[Model]."""
        document = await self.request(
            method, path, json=json, params=params, retry_for_s=retry_for_s, timeout_s=timeout_s
        )
        return await self._validated(model, path, document)

    async def _validated(self, model: type[T], path: str, document: Any) -> T:
        try:
            return _adapter(model).validate_python(document)
        except pydantic.ValidationError as exc:
            url = f"{self.urls[self._current]}{API}{path}"
            raise UnexpectedAnswer(
                f"{url} answered with something other than the API's {model}: {exc}", 200, url
            ) from None

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Body | None = None,
        params: Mapping[str, Any] | None = None,
        retry_for_s: float | None = None,
        timeout_s: float | None = None,
        answer_headers: dict[str, str] | None = None,
    ) -> Any:
        """`method` `path` (under /api/v1) and its answer's JSON document (None for an empty answer);
        `answer_headers`, when given, gets the answer's headers (lowercase names)."""
        if retry_for_s is not None:
            budget = retry_for_s
        elif method in ("GET", "HEAD") or self.retry_writes:
            budget = self.retry_for_s
        else:
            budget = 0.0  # one attempt
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        document = _document(json)
        problem: BaseException | None = None
        problem_text = ""
        try:
            async for attempt in rest.retrying(budget, len(self.urls), retry_on=self.retry_on):
                with attempt:
                    url = f"{self.urls[self._current]}{API}{path}"
                    try:
                        response = await self._http.request(
                            method, url, json=document, params=params, timeout=timeout
                        )
                        rest.raise_for_server_error(response)
                    except self.retry_on as exc:
                        problem = exc
                        problem_text = (
                            str(exc)
                            if isinstance(exc, rest.ServerError)
                            else f"{type(exc).__name__} for {url}"
                        )
                        # The next replica gets the next attempt (at once; the policy backs off only
                        # after all of them failed).
                        self._current = (self._current + 1) % len(self.urls)
                        raise
                    if answer_headers is not None:
                        answer_headers.update({k.lower(): v for k, v in response.headers.items()})
                    return _decode(response)
        except tenacity.RetryError as exc:
            attempts = exc.last_attempt.attempt_number
            raise RootUnavailable(
                f"root unreachable after {attempts} attempts: {problem_text}", problem
            ) from None
        raise AssertionError("unreachable: tenacity either returns an attempt's result or raises")


# Each answer type's adapter, built once: a heartbeat's answer is validated every interval on every machine.
_ADAPTERS: dict[Any, pydantic.TypeAdapter[Any]] = {}


def _adapter(model: type[T]) -> pydantic.TypeAdapter[T]:
    adapter = _ADAPTERS.get(model)
    if adapter is None:
        adapter = _ADAPTERS[model] = pydantic.TypeAdapter(model)
    return adapter


def _document(body: Any) -> Any:
    """A request body as JSON: a model as its fields the caller set (the root fills in the defaults), a
    model nested in a mapping likewise."""
    if isinstance(body, pydantic.BaseModel):
        return body.model_dump(mode="json", exclude_unset=True)
    if isinstance(body, Mapping):
        return {key: _document(value) for key, value in body.items()}
    if isinstance(body, list | tuple):
        return [_document(value) for value in body]
    return body


@dataclass(frozen=True)
class ListPage(Generic[T]):
    """One page of a list endpoint (RootClient.page)."""

    items: list[T]
    total: int | None  # X-Total-Count: the whole list's length; None from a root without paging
    next: dict[str, str] | None  # the next page's query parameters; None on the last page


def next_params(link: str | None) -> dict[str, str] | None:
    """The query parameters of an RFC 8288 Link header's rel="next" target (None without one)."""
    for part in (link or "").split(","):
        target, _, attributes = part.partition(";")
        rels = [a.strip() for a in attributes.split(";")]
        if 'rel="next"' in rels or "rel=next" in rels:
            url = httpx.URL(target.strip().removeprefix("<").removesuffix(">"))
            return dict(url.params.multi_items())
    return None


def _params(**values: Any) -> dict[str, Any] | None:
    return {key: value for key, value in values.items() if value is not None} or None


def _decode(response: httpx.Response) -> Any:
    url = str(response.request.url)
    if response.status_code >= 400:
        code, message = rest.api_error(response)
        if code == f"http_{response.status_code}":  # not the API's error shape
            code = "http_error"
        raise RootRejected(response.status_code, code, message, url)
    if response.status_code == 204 or not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        raise UnexpectedAnswer(
            f"{url} answered HTTP {response.status_code} with something other than JSON",
            response.status_code,
            url,
        ) from None
