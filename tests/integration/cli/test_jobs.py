"""`castor jobs create|list|show|stop|delete|wait` against a real root service."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.integration.cli.conftest import Root, castor, castor_on_tty, create_job, unique


def test_create_prints_the_worker_token_and_the_agent_command(root: Root) -> None:
    name = unique("create")
    result = castor(root, "jobs", "create", name, "--machines", "4", "--persist-every", "50")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(rf"Created job {name} \([0-9a-f-]{{36}}\): pending, 4 machines", out), out
    assert "group placement" in out and "shown only this once" in out
    token = re.search(r"^\s+(castor-job\.\S+)$", out, re.MULTILINE)
    assert token, out
    job = root.api("GET", "/api/v1/jobs", params={"limit": 500}).json()["items"]
    job_id = next(j["id"] for j in job if j["name"] == name)
    agent = f"castor agent --root {root.url} --job {job_id} --token-file worker-token -- <training command>"
    assert agent in out
    assert out.count(token.group(1)) == 1, "the token is shown once, never in the agent's command line"
    # The printed token is the job's real worker token.
    registered = root.api(
        "POST",
        f"/api/v1/worker/jobs/{job_id}/machines",
        token=token.group(1),
        json={"instance_id": "i-0", "address": "127.0.0.1", "data_port": 9000},
    )
    assert registered.status_code == 200, registered.text


def test_create_json_and_every_option(root: Root) -> None:
    name = unique("create-json")
    result = castor(
        root,
        *("jobs", "create", name, "--machines", "6", "--replicas", "3", "--procs-per-machine", "2"),
        *("--persist-every", "0", "--keep-persisted", "5", "--placement", "ring", "--json"),
    )
    assert result.returncode == 0, result.stderr
    job = result.json()
    assert job["name"] == name and job["state"] == "pending"
    assert (job["machines"], job["replicas"], job["procs_per_machine"]) == (6, 3, 2)
    assert (job["persist_every"], job["keep_persisted"], job["placement_strategy"]) == (0, 5, "ring")
    assert job["worker_token"].startswith("castor-job.")


def test_create_errors(root: Root) -> None:
    name = unique("dup")
    assert castor(root, "jobs", "create", name, "--machines", "2").returncode == 0
    again = castor(root, "jobs", "create", name, "--machines", "2")
    assert again.returncode == 1 and again.stdout == ""
    assert "already exists" in again.stderr and "(job_exists)" in again.stderr

    too_many = castor(root, "jobs", "create", unique("bad"), "--machines", "2", "--replicas", "3")
    assert too_many.returncode == 1
    assert (
        "replicas (3) cannot exceed machines (2)" in too_many.stderr and "validation_error" in too_many.stderr
    )

    group = castor(root, "jobs", "create", unique("bad"), "--machines", "3", "--placement", "group")
    assert group.returncode == 1 and "group placement needs replicas to divide machines" in group.stderr

    bad_name = castor(root, "jobs", "create", "no spaces allowed", "--machines", "2")
    assert bad_name.returncode == 1 and "validation_error" in bad_name.stderr

    no_command = castor(root, "jobs", "create", unique("bad"), "--machines", "2", "--launch")
    assert no_command.returncode == 1 and "--launch needs the training command after --" in no_command.stderr

    missing = castor(root, "jobs", "create", unique("bad"))  # argparse: --machines is required
    assert missing.returncode == 2 and "--machines" in missing.stderr
    choice = castor(root, "jobs", "create", unique("bad"), "--machines", "2", "--placement", "random")
    assert choice.returncode == 2


def test_list_human_json_state_filter_and_paging(root: Root) -> None:
    first, second = unique("list-a"), unique("list-b")
    create_job(root, first, machines=2)
    create_job(root, second, machines=3)

    table = castor(root, "jobs", "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "STATE",
        "MACHINES",
        "ITERATION",
        "FAILURES",
        "CKPT/MIN",
        "CREATED",
        "ID",
    ]
    row = next(line for line in lines if line.startswith(second + " "))
    assert "pending" in row and "0/3" in row and re.search(r"(\d+ s ago|just now)", row)
    assert lines.index(row) < next(i for i, line in enumerate(lines) if line.startswith(first + " ")), (
        "newest first"
    )
    # Aligned: every row's STATE column starts where the header's does.
    column = lines[0].index("STATE")
    assert all(line[column - 2 : column] == "  " and line[column] != " " for line in lines[1:] if line)

    page = castor(root, "jobs", "list", "--json").json()
    assert set(page) == {"items", "total", "limit", "offset"} and page["total"] >= 2
    assert {first, second} <= {job["name"] for job in page["items"]}

    pending = castor(root, "jobs", "list", "--state", "pending", "--json").json()
    assert pending["items"] and all(job["state"] == "pending" for job in pending["items"])
    stopped = castor(root, "jobs", "list", "--state", "stopped")
    assert stopped.returncode == 0 and stopped.stdout.strip() == "no jobs in state stopped"

    one = castor(root, "jobs", "list", "--limit", "1")
    assert len([line for line in one.stdout.splitlines() if line.startswith(second)]) == 1
    assert f"of {page['total']}; next page: --offset 1" in one.stdout
    offset = castor(root, "jobs", "list", "--limit", "1", "--offset", "1", "--json").json()
    assert offset["offset"] == 1 and len(offset["items"]) == 1

    bad_limit = castor(root, "jobs", "list", "--limit", "0")
    assert bad_limit.returncode == 1 and "query.limit" in bad_limit.stderr


def test_show_by_name_and_by_id(root: Root) -> None:
    name = unique("show")
    job = create_job(root, name, machines=4)
    human = castor(root, "jobs", "show", name)
    assert human.returncode == 0, human.stderr
    out = human.stdout
    assert out.startswith(f"Job {name}\n") and "id:" in out and job["id"] in out
    assert re.search(r"created:\s+\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S* ?\((\d+ s ago|just now)\)", out), out
    assert "Machines: none registered yet (0 of 4)" in out
    assert "Placement: group, 4 machines, 2 replicas" in out
    assert re.search(r"^\s+0\s+group\s+0, 1$", out, re.MULTILINE) and re.search(
        r"^\s+1\s+group\s+2, 3$", out, re.M
    )
    assert "k=1: 1.000   k=2: 0.667   k=3: 0.000   k=4: 0.000" in out
    assert "Failures: none" in out

    document = castor(root, "jobs", "show", job["id"], "--json").json()
    assert set(document) == {"job", "machines", "placement", "failures"}
    assert document["job"]["id"] == job["id"] and document["job"]["name"] == name
    assert document["machines"] == [] and document["failures"] == []
    assert document["placement"]["recovery_probability"]["2"] == pytest.approx(4 / 6)
    assert [g["members"] for g in document["placement"]["groups"]] == [[0, 1], [2, 3]]


def test_show_machines_table(root: Root) -> None:
    name = unique("machines")
    job = create_job(root, name, machines=2)
    for rank in range(2):
        root.api(
            "POST",
            f"/api/v1/worker/jobs/{job['id']}/machines",
            token=job["worker_token"],
            json={
                "instance_id": f"host-{rank}",
                "address": "10.0.0.7",
                "data_port": 7000 + rank,
                "hostname": "n7",
            },
        ).raise_for_status()
    out = castor(root, "jobs", "show", name).stdout
    assert "Machines (2 of 2 registered)" in out
    assert re.search(r"^\s+RANK\s+STATE\s+INSTANCE\s+HOST\s+DATA PLANE\s+HEARTBEAT", out, re.MULTILINE)
    assert re.search(r"^\s+1\s+\w+\s+host-1\s+n7\s+10\.0\.0\.7:7001\s", out, re.MULTILINE), out
    assert "running" in out, "the job runs once all its machines registered"
    document = castor(root, "jobs", "show", name, "--json").json()
    assert [m["instance_id"] for m in document["machines"]] == ["host-0", "host-1"]


def test_stop_keeps_the_history_and_tells_the_agents_to_exit(root: Root) -> None:
    name = unique("stop")
    job = create_job(root, name, machines=2)
    result = castor(root, "jobs", "stop", name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Stopped job {name} ({job['id']})")
    stopped = root.api("GET", f"/api/v1/jobs/{job['id']}").json()
    assert stopped["state"] == "stopped" and stopped["finished_at"]
    directive = root.api(
        "GET", f"/api/v1/worker/jobs/{job['id']}/directive", token=str(job["worker_token"])
    ).json()
    assert (directive["status"], directive["job_state"]) == ("finished", "stopped")
    again = castor(root, "jobs", "stop", name, "--json")
    assert again.returncode == 1 and "(job_finished)" in again.stderr

    other = create_job(root, unique("stop-json"), machines=2)
    document = castor(root, "jobs", "stop", other["id"], "--json").json()
    assert (document["id"], document["state"]) == (other["id"], "stopped")


def test_delete_with_yes_and_json(root: Root) -> None:
    name = unique("delete")
    job = create_job(root, name, machines=2)
    result = castor(root, "jobs", "delete", name, "--yes")
    assert result.returncode == 0 and result.stdout.strip() == f"Deleted job {name} ({job['id']})"
    assert root.api("GET", f"/api/v1/jobs/{job['id']}").status_code == 404
    gone = castor(root, "jobs", "show", name)
    assert gone.returncode == 1 and f"no job with id or name {name!r}" in gone.stderr

    other = create_job(root, unique("delete-json"), machines=2)
    document = castor(root, "jobs", "delete", other["id"], "-y", "--json").json()
    assert document == {"deleted": True, "id": other["id"], "name": other["name"]}


def test_delete_asks_on_a_terminal(root: Root) -> None:
    name = unique("confirm")
    job = create_job(root, name, machines=2)
    code, screen = castor_on_tty(root, "jobs", "delete", name, typed=b"n\n")
    assert code == 1 and f"Delete job {name} ({job['id']}, pending)" in screen and "[y/N]" in screen
    assert "not deleted" in screen
    assert root.api("GET", f"/api/v1/jobs/{job['id']}").status_code == 200

    code, screen = castor_on_tty(root, "jobs", "delete", name, typed=b"y\n")
    assert code == 0 and f"Deleted job {name}" in screen
    assert root.api("GET", f"/api/v1/jobs/{job['id']}").status_code == 404


def test_launch_then_wait_until_completed(root: Root) -> None:
    """--launch: the root's local operator starts the machines (agents running the command in the
    directory the CLI ran in); `jobs wait` follows the job until it completes."""
    name = unique("launch")
    script = "import os; print('launched in', os.getcwd(), os.environ['CASTOR_CLI_TEST'])"
    created = castor(
        root,
        *("jobs", "create", name, "--machines", "2", "--env", "CASTOR_CLI_TEST=hello", "--launch"),
        *("--", sys.executable, "-c", script),
    )
    assert created.returncode == 0, created.stderr
    assert "The root's local cloud operator starts the 2 machines itself." in created.stdout
    assert f"-- {sys.executable} -c " in created.stdout

    started = time.monotonic()
    waited = castor(
        root, "jobs", "wait", name, "--state", "completed", "--timeout", "120", "--interval", "0.2"
    )
    assert waited.returncode == 0, waited.stderr
    assert re.fullmatch(rf"job {name} is completed \(waited .+\)\n", waited.stdout), waited.stdout
    assert waited.stderr == "", "no progress line without a terminal"
    assert time.monotonic() - started < 120

    job_id = castor(root, "jobs", "show", name, "--json").json()["job"]["id"]
    logs = sorted((root.state_dir / "jobs" / job_id.replace("-", "") / "logs").glob("*.log"))
    assert len(logs) == 2
    assert all(f"launched in {root.workdir} hello" in log.read_text() for log in logs)

    again = castor(root, "jobs", "wait", name, "--json").json()  # default --state completed
    assert again["state"] == "completed" and again["finished_at"]

    wrong = castor(root, "jobs", "wait", name, "--state", "running", "--timeout", "5")
    assert wrong.returncode == 1 and f"job {name} ended in state completed, not running" in wrong.stderr


def test_wait_times_out_with_a_message(root: Root) -> None:
    name = unique("wait")
    create_job(root, name, machines=2)
    result = castor(root, "jobs", "wait", name, "--state", "running", "--timeout", "1", "--interval", "0.2")
    assert result.returncode == 1
    assert "timed out after" in result.stderr and f"job {name} is pending, not running" in result.stderr


def test_wait_shows_a_progress_line_on_a_terminal(root: Root) -> None:
    name = unique("wait-tty")
    job = create_job(root, name, machines=2)
    code, screen = castor_on_tty(
        root, "jobs", "wait", name, "--state", "running", "--timeout", "3", "--interval", "0.2"
    )
    assert code == 1 and "timed out" in screen
    assert f" {name}: pending  iteration -  machines 0/2 healthy  failures 0" in screen, repr(screen)
    # rich's progress display: the line is erased and redrawn in place (carriage return, erase line).
    assert screen.count("\r\x1b[2K") >= 3, "the line is rewritten in place"

    for rank in range(2):
        root.api(
            "POST",
            f"/api/v1/worker/jobs/{job['id']}/machines",
            token=job["worker_token"],
            json={"instance_id": f"i-{rank}", "address": "127.0.0.1", "data_port": 9100 + rank},
        ).raise_for_status()
    code, screen = castor_on_tty(root, "jobs", "wait", name, "--state", "running", "--timeout", "10")
    assert code == 0 and f"job {name} is running" in screen


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "no-warm-start"])
def test_launch_warm_start_switch(root: Root, tmp_path: Path, warm: bool) -> None:
    """The agents the local operator starts run the command from a warm interpreter (same venv as the
    agent) unless the job was created with --no-warm-start; the printed agent command says it too."""
    name = unique("warm")
    script = tmp_path / "argv.py"
    script.write_text("import sys; print('started as', sys.orig_argv)")
    created = castor(
        root,
        *("jobs", "create", name, "--machines", "1", "--replicas", "1", "--launch"),
        *([] if warm else ["--no-warm-start"]),
        *("--", sys.executable, str(script)),
    )
    assert created.returncode == 0, created.stderr
    assert ("--no-warm-start --" in created.stdout) is not warm
    waited = castor(root, "jobs", "wait", name, "--timeout", "120", "--interval", "0.2")
    assert waited.returncode == 0, waited.stderr
    job_id = castor(root, "jobs", "show", name, "--json").json()["job"]["id"]
    (log,) = (root.state_dir / "jobs" / job_id.replace("-", "") / "logs").glob("*.log")
    text = log.read_text()
    assert "started as" in text, text
    assert ("worker_lib.agent.warm" in text.split("started as", 1)[1].splitlines()[0]) is warm, text
    assert ("started 1 training processes (1 warm" in text) is warm, text
    # The job completed: its machine gave its shared memory back, the job's directory included.
    shm = root.state_dir / "shm" / job_id.replace("-", "")
    deadline = time.monotonic() + 60
    while shm.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm.exists(), list(shm.rglob("*"))
