"""`castor failures list|show` (and the failures in `jobs show`) for a failure reported through the worker
API: every machine registers, then one reports a training process killed by SIGKILL."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.cli.conftest import Root, castor, create_job, unique


@dataclass
class FailedJob:
    job: dict[str, Any]
    failure_id: int
    plan_id: int | None


@pytest.fixture(scope="module")
def failed(root: Root) -> FailedJob:
    job = create_job(root, unique("failing"), machines=2)
    worker = f"/api/v1/worker/jobs/{job['id']}"
    for rank in range(2):
        root.api(
            "POST",
            f"{worker}/machines",
            token=job["worker_token"],
            json={"instance_id": f"i-{rank}", "address": "127.0.0.1", "data_port": 9200 + rank},
        ).raise_for_status()
    exit_ack = root.api(
        "POST",
        f"{worker}/machines/1/exits",
        token=job["worker_token"],
        json={"instance_id": "i-1", "local_rank": 0, "global_rank": 1, "exit_code": -9},
    )
    assert exit_ack.status_code == 202, exit_ack.text
    failure_id = exit_ack.json()["failure_id"]
    assert isinstance(failure_id, int)
    # The leader opens a recovery (a plan collecting the machines' inventories) in the background.
    plan_id = None
    deadline = time.monotonic() + 15
    while plan_id is None and time.monotonic() < deadline:
        failure = root.api("GET", f"/api/v1/jobs/{job['id']}/failures/{failure_id}").json()
        plan_id = failure["plan_id"]
        time.sleep(0.1)
    return FailedJob(job, failure_id, plan_id)


def test_failures_list(root: Root, failed: FailedJob) -> None:
    name = failed.job["name"]
    table = castor(root, "failures", "list", name)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "#",
        "ID",
        "DETECTED",
        "RANK",
        "KIND",
        "STATE",
        "TIER",
        "LOST",
        "RECOVERY",
        "CAUSE",
    ]
    assert re.match(
        rf"\s*#1\s+{failed.failure_id}\s+(\d+ s ago|just now)\s+1\s+software\s+(detected|recovering)\s+",
        lines[1],
    ), lines
    assert lines[1].endswith("training process rank 1 was killed by SIGKILL")

    events = castor(root, "failures", "list", failed.job["id"], "--json").json()
    assert [e["id"] for e in events] == [failed.failure_id]
    assert events[0]["kind"] == "software" and events[0]["rank"] == 1
    assert events[0]["details"]["exit_code"] == -9

    quiet = create_job(root, unique("no-failures"), machines=2)
    none = castor(root, "failures", "list", quiet["name"])
    assert none.returncode == 0 and none.stdout.strip() == f"job {quiet['name']} has no failures"
    assert castor(root, "failures", "list", quiet["name"], "--json").json() == []


def test_failures_show(root: Root, failed: FailedJob) -> None:
    name = failed.job["name"]
    human = castor(root, "failures", "show", name, str(failed.failure_id))
    assert human.returncode == 0, human.stderr
    out = human.stdout
    assert out.startswith(f"Failure {failed.failure_id} of job {name} (#1 of the job)\n")
    assert re.search(r"cause:\s+training process rank 1 was killed by SIGKILL", out)
    assert re.search(r"kind:\s+software", out) and re.search(r"machine rank:\s+1\n", out)
    # Phases: detected and classified at once (the agent reported the exit); the rest has not happened.
    assert re.search(r"^\s+PHASE\s+AT\s+TOOK$", out, re.MULTILINE)
    assert re.search(r"^\s+detect\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", out, re.MULTILINE)
    assert re.search(r"^\s+classify\s+\d{4}-\d\d-\d\d .*\)\s+(\d+ ms|0 s)$", out, re.MULTILINE), out
    # The phases the API computed, as the pages draw them: a software failure has no replace phase, the
    # restore is under way, and nothing is shown for what has not started.
    assert re.search(r"^\s+restore\s+-\s+under way, .* so far$", out, re.MULTILINE), out
    assert not re.search(r"^\s+(replace|resume)\s", out, re.MULTILINE), out
    assert re.search(r"^\s+recovery time\s+-$", out, re.MULTILINE)
    assert re.search(r"exit_code:\s+-9", out) and re.search(r"instance_id:\s+i-1", out)

    document = castor(root, "failures", "show", failed.job["id"], str(failed.failure_id), "--json").json()
    assert set(document) == {"failure", "plan"}
    assert document["failure"]["id"] == failed.failure_id and document["failure"]["rank"] == 1
    assert document["failure"]["detected_at"] and document["failure"]["resumed_at"] is None
    if failed.plan_id is not None:
        assert document["plan"]["id"] == failed.plan_id == document["failure"]["plan_id"]
        assert f"Recovery plan {failed.plan_id} (generation {document['plan']['generation']})" in out
    else:  # the leader had not planned yet when the fixture gave up waiting
        assert document["plan"] is None or document["plan"]["id"] == document["failure"]["plan_id"]


def test_failure_shows_up_in_jobs_show(root: Root, failed: FailedJob) -> None:
    out = castor(root, "jobs", "show", failed.job["name"]).stdout
    assert "Recent failures (1 of 1)" in out
    row = rf"^\s+#1\s+{failed.failure_id}\s+.*software.*killed by SIGKILL$"
    assert re.search(row, out, re.MULTILINE), out
    document = castor(root, "jobs", "show", failed.job["name"], "--json").json()
    assert [f["id"] for f in document["failures"]] == [failed.failure_id]
    assert document["job"]["failures"] == 1


def test_unknown_failure_and_bad_id(root: Root, failed: FailedJob) -> None:
    missing = castor(root, "failures", "show", failed.job["name"], "999999")
    assert missing.returncode == 1 and "has no failure 999999" in missing.stderr
    not_a_number = castor(root, "failures", "show", failed.job["name"], "first")
    assert not_a_number.returncode == 2 and "invalid int value" in not_a_number.stderr
    no_job = castor(root, "failures", "list", unique("nope"))
    assert no_job.returncode == 1 and "no job with id or name" in no_job.stderr
