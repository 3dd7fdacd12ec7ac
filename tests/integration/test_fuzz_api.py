"""Fuzzing: schemathesis against the live root service (a real `castor serve` process on Postgres), every
operation of openapi.yaml, each API surface with its own token (public: the admin token; worker: the
worker token of a job made for the run, whose id the fuzzer mostly uses for {job_id}).

Checked for every response: no 5xx; status code, content type and body as openapi.yaml documents them;
bad input (schemathesis' negative mode) refused with a 4xx; every 4xx in the one error shape
{"error": {"code", "message", "details"}}; a 405 names the allowed methods; and the service logged no error.

Bounded to fit the suite: CASTOR_FUZZ_EXAMPLES examples per operation and generation mode (default 25;
about 2,500 requests), generated deterministically (derandomize), so a failure on a fresh clone
reproduces with the same command."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)

from tests import harness

pytestmark = [pytest.mark.postgres, pytest.mark.aws]

REPO = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "castor-admin.fuzz"
MACHINES = 4
ABSENT_GROUP = "castor-fuzz-absent"
INT32_MAX = 2**31 - 1
EXAMPLES = int(os.environ.get("CASTOR_FUZZ_EXAMPLES", "25"))
OPENAPI: dict[str, Any] = yaml.safe_load((REPO / "openapi.yaml").read_text())

CONFIG = schemathesis.Config.from_dict(
    {
        "cache": {"enabled": False},  # nothing written into the repository
        "generation": {
            "mode": "all",  # valid requests and invalid ones
            "max-examples": EXAMPLES,
            "deterministic": True,
            # The test sends each surface's token itself; what a missing or foreign token gets is checked
            # for every operation by test_every_operation_refuses_a_missing_or_foreign_token.
            "with-security-parameters": False,
        },
    }
)
schema = schemathesis.openapi.from_path(REPO / "openapi.yaml", config=CONFIG)


# -- the live service --------------------------------------------------------------------------------------


@dataclass
class LiveRoot:
    url: str
    log_path: Path
    job_id: str = ""
    worker_token: str = ""

    def create_job(self) -> dict[str, Any]:
        body = {"name": f"fuzz-{uuid.uuid4().hex[:12]}", "machines": MACHINES}
        response = httpx.post(f"{self.url}/api/v1/jobs", json=body, headers=bearer(ADMIN_TOKEN), timeout=30)
        assert response.status_code == 201, response.text
        return response.json()  # type: ignore[no-any-return]


def instance(rank: int) -> str:
    return f"fuzz-machine-{rank}"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def live_root(
    postgres_server: harness.Postgres, moto_server: harness.Moto, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveRoot]:
    state = tmp_path_factory.mktemp("fuzz-root")
    port = harness.free_port()
    env = {
        **os.environ,
        "CASTOR_DATABASE_URL": postgres_server.create_database(f"fuzz_{uuid.uuid4().hex[:8]}"),
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_PORT": str(port),
        "CASTOR_STATE_DIR": str(state),
        # The AWS operator (on moto, with no such group) instead of the local one: a fuzzed `launch` spec
        # is refused instead of started as processes on this host, and replacements fail at once.
        "CASTOR_CLOUD": "aws",
        "CASTOR_ASG_NAME": ABSENT_GROUP,
        "CASTOR_AWS_ENDPOINT_URL": moto_server.url,
        # No agent heartbeats: keep the failure detector out of the run; fuzzed exit reports start
        # recoveries that cannot succeed, which must not end the job the run uses.
        "CASTOR_HEARTBEAT_TIMEOUT_S": "3600",
        "CASTOR_MAX_FAILED_RECOVERIES": "1000000",
    }
    log_path = state / "root.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        harness.wait_for_port(port, process, timeout=60)
        root = LiveRoot(f"http://127.0.0.1:{port}", log_path)
        job = root.create_job()
        root.job_id, root.worker_token = job["id"], job["worker_token"]
        for rank in range(MACHINES):  # registered machines, so that reports about them get past 409s
            response = httpx.post(
                f"{root.url}/api/v1/worker/jobs/{root.job_id}/machines",
                json={"instance_id": instance(rank), "address": "127.0.0.1", "data_port": 1, "rank": rank},
                headers=bearer(root.worker_token),
                timeout=30,
            )
            assert response.status_code == 200, response.text
        yield root
    finally:
        harness.stop_process(process)


# -- checks ------------------------------------------------------------------------------------------------


def error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every 4xx carries the one error shape, {"error": {"code", "message", "details"}}."""
    if not 400 <= response.status_code < 500:
        return None
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, f"not the error shape: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"code", "message", "details"}, error
    assert isinstance(error["code"], str) and error["code"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["details"], dict), error
    return True


RETRIES_SEEN: set[str] = set()


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    """No 5xx, except the documented 503 `retry` of a transaction that lost a race inside the database (the
    service's own recovery work runs beside the fuzzer); counted, and named at the end."""
    retry = response.status_code == 503 and response.headers.get("retry-after")
    if retry and response.json().get("error", {}).get("code") == "retry":
        RETRIES_SEEN.add(case.id)
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    unsupported_method,
    error_shape,
]


# -- the run -----------------------------------------------------------------------------------------------


def _uuid(value: object) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None


def _valid_instance_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and 1 <= len(value) <= 128
        and "\x00" not in value
        and not any("\ud800" <= c <= "\udfff" for c in value)
    )


def aim(case: Any, root: LiveRoot) -> None:
    """Point most generated requests at the job the worker token belongs to, so that the fuzzer gets past
    403/404 into the handlers; one valid id in eight stays random (a 403 for the worker token, a 404 for
    the admin). Derived from the generated id itself, so the run stays deterministic."""
    generated = _uuid(case.path_parameters.get("job_id"))
    if generated is not None and generated.int % 8:
        if case.method == "DELETE" or case.path.endswith("/stop"):
            # Deleting or stopping the worker token's job would end the worker surface's run: a job each.
            case.path_parameters["job_id"] = root.create_job()["id"]
        else:
            case.path_parameters["job_id"] = root.job_id
    rank = case.path_parameters.get("rank")
    # Only values the schema allows are replaced (by other allowed ones): a negative case stays negative.
    if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank <= INT32_MAX:
        rank = case.path_parameters["rank"] = rank % (2 * MACHINES)  # half of them a rank of the job
        reporter = case.body.get("instance_id") if isinstance(case.body, dict) else None
        if _valid_instance_id(reporter) and rank < MACHINES and len(reporter) % 8:
            case.body["instance_id"] = instance(rank)  # the machine of that rank reports
    wait = (case.query or {}).get("wait")
    try:
        if wait is not None and 0.1 < float(wait) <= 60:
            case.query["wait"] = 0.1  # a long poll of up to 60 s, cut short: the run stays bounded
    except (TypeError, ValueError):
        pass  # not a number: the service refuses it at once


@schema.parametrize()
@settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_fuzz_api(case: Any, live_root: LiveRoot) -> None:
    token = live_root.worker_token if case.path.startswith("/api/v1/worker/") else ADMIN_TOKEN
    aim(case, live_root)
    case.call_and_validate(base_url=live_root.url, headers=bearer(token), checks=CHECKS, timeout=30)


def _documented(method: str, path: str, response: httpx.Response) -> None:
    """The response's status is documented for the operation and its JSON body matches the schema."""
    responses = OPENAPI["paths"][path][method]["responses"]
    assert str(response.status_code) in responses, f"{path}: {response.status_code} {response.text[:500]}"
    content = responses[str(response.status_code)].get("content", {}).get("application/json")
    if content is not None:
        body_schema = {**content["schema"], "components": OPENAPI["components"]}
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(body_schema).iter_errors(response.json())
        )
        assert error is None, f"{path}: {error}"


def test_what_the_fuzzer_stored_reads_back(live_root: LiveRoot) -> None:
    """After the run (tests run in file order; the fuzzer's own reads ran before most of its writes):
    every job the fuzzer wrote to reads back as documented through the API, and renders on the status
    pages and in /metrics."""
    admin = bearer(ADMIN_TOKEN)
    jobs = httpx.get(f"{live_root.url}/api/v1/jobs", params={"limit": 500}, headers=admin, timeout=30)
    assert jobs.status_code == 200, jobs.text
    for job in jobs.json()["items"]:
        for path, methods in OPENAPI["paths"].items():
            if "get" not in methods or not path.startswith("/api/v1/jobs/{job_id}") or "{failure_id}" in path:
                continue
            response = httpx.get(live_root.url + path.format(job_id=job["id"]), headers=admin, timeout=60)
            assert response.status_code == 200, f"{path}: {response.status_code} {response.text[:500]}"
            _documented("get", path, response)
        page = httpx.get(f"{live_root.url}/jobs/{job['id']}", headers=admin, timeout=60)
        assert page.status_code == 200, f"job page: {page.status_code} {page.text[:500]}"
        failures = httpx.get(f"{live_root.url}/api/v1/jobs/{job['id']}/failures", headers=admin, timeout=30)
        for failure in failures.json():
            path = "/api/v1/jobs/{job_id}/failures/{failure_id}"
            url = live_root.url + path.format(job_id=job["id"], failure_id=failure["id"])
            response = httpx.get(url, headers=admin, timeout=30)
            assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:500]}"
            _documented("get", path, response)
            page = httpx.get(f"{live_root.url}/jobs/{job['id']}/failures/{failure['id']}", headers=admin)
            assert page.status_code == 200, f"failure page: {page.status_code} {page.text[:500]}"
    worker = bearer(live_root.worker_token)
    for path in ("/api/v1/worker/jobs/{job_id}/recovery-plan", "/api/v1/worker/jobs/{job_id}/directive"):
        response = httpx.get(live_root.url + path.format(job_id=live_root.job_id), headers=worker, timeout=30)
        _documented("get", path, response)
    for page_path in ("/", "/metrics"):
        page = httpx.get(live_root.url + page_path, headers=admin, timeout=60)
        assert page.status_code == 200, f"{page_path}: {page.status_code} {page.text[:500]}"


def test_the_service_logged_no_error(live_root: LiveRoot) -> None:
    """After the run (tests run in file order): nothing failed inside the service either, background
    tasks included (a 500 there never reaches a client)."""
    lines = live_root.log_path.read_text(errors="replace").splitlines()
    errors = [
        line
        for line in lines
        if (" ERROR " in line or line.startswith(("ERROR", "Traceback")))
        # Replacements of machines that fuzzed exit reports declared failed: the group is missing on purpose.
        and f"Auto Scaling Group '{ABSENT_GROUP}' does not exist" not in line
    ]
    assert not errors, "\n".join(lines[-60:])
    if RETRIES_SEEN:
        warnings.warn(f"{len(RETRIES_SEEN)} requests were answered 503 retry", stacklevel=1)


# -- authentication, for every operation ------------------------------------------------------------------


def _protected_operations() -> list[tuple[str, str]]:
    return [
        (method.upper(), path)
        for path, methods in OPENAPI["paths"].items()
        for method, operation in methods.items()
        if operation.get("security")
    ]


@pytest.fixture(scope="module")
def other_job(live_root: LiveRoot) -> dict[str, Any]:
    return live_root.create_job()


@pytest.mark.parametrize(("method", "path"), _protected_operations(), ids=" ".join)
def test_every_operation_refuses_a_missing_or_foreign_token(
    method: str, path: str, live_root: LiveRoot, other_job: dict[str, Any]
) -> None:
    url = live_root.url + path.format(job_id=live_root.job_id, rank=0, failure_id=1)
    worker = path.startswith("/api/v1/worker/")
    body = {} if method in ("POST", "PUT", "PATCH") else None
    refusals = {
        "no token": ({}, 401),
        "an unknown token": (bearer("castor-admin.wrong"), 401),
        "a worker token with a wrong secret": (bearer(live_root.worker_token + "x"), 401),
        # The public surface is the admin's; a job's worker token acts on its own job only.
        "a token that may not act here": (
            bearer(other_job["worker_token"] if worker else live_root.worker_token),
            403,
        ),
    }
    for what, (headers, status) in refusals.items():
        response = httpx.request(method, url, headers=headers, json=body, timeout=30)
        assert response.status_code == status, f"{what}: {response.status_code} {response.text}"
        assert set(response.json()) == {"error"} and set(response.json()["error"]) == {
            "code",
            "message",
            "details",
        }, f"{what}: {response.text}"
        assert str(status) in OPENAPI["paths"][path][method.lower()]["responses"], f"{status} undocumented"


def test_every_operation_documents_its_errors() -> None:
    """openapi.yaml names, in the one error shape, what every protected operation can answer besides its
    own outcomes: 401/403 (the token), 422 (bad input) and 503 (a lost race in the database: retry)."""
    for method, path in _protected_operations():
        responses = OPENAPI["paths"][path][method.lower()]["responses"]
        for status in ("401", "403", "422", "503"):
            assert status in responses, f"{method} {path} does not document {status}"
            body = responses[status]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/ErrorResponse"}, f"{method} {path} {status}: {body}"
