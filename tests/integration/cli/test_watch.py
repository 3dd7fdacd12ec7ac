"""`castor jobs watch` against a real root service: it follows a job until the job ends, shows its
machines, replication and the newest failure's recovery phases, and leaves on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from typing import Any

from services.cli import render, watch
from tests.integration.cli.conftest import ADMIN_TOKEN, Root, base_env, castor_on_tty, create_job, unique


def _running_job(root: Root, name: str, machines: int = 2) -> dict[str, Any]:
    job = create_job(root, name, machines=machines, replicas=min(2, machines))
    for rank in range(machines):
        root.api(
            "POST",
            f"/api/v1/worker/jobs/{job['id']}/machines",
            token=job["worker_token"],
            json={"instance_id": f"i-{name}-{rank}", "address": "127.0.0.1", "data_port": 9200 + rank},
        ).raise_for_status()
    assert root.api("GET", f"/api/v1/jobs/{job['id']}").json()["state"] == "running"
    return job


def _watch(root: Root, name: str) -> subprocess.Popen[str]:
    """`castor jobs watch NAME` with a pipe as stdout (no terminal), as a log collector would run it, with
    SIGINT at its default as a shell's foreground command has it. Not inherited from the suite: pytest run
    as a background job of a non-interactive shell (`./scripts/test ... &`, nohup) ignores SIGINT, the
    command rightly keeps it ignored then, and a Ctrl-C test would wait for an exit that never comes."""
    env = {**base_env(), "CASTOR_ROOT_URL": root.url, "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "jobs", "watch", name, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=root.workdir,
        preexec_fn=_sigint_default,
    )


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_watch_exits_when_the_job_ends_and_shows_its_machines(root: Root) -> None:
    name = unique("watch")
    job = _running_job(root, name)
    process = _watch(root, name)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # the watcher is following the running job
        assert f"job {name}: running" in first, first
        assert process.poll() is None, "a running job keeps the watcher going"
        root.api("POST", f"/api/v1/jobs/{job['id']}/stop").raise_for_status()
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    screen = first + out
    assert f"job {name}: stopped" in out
    assert "\x1b" not in screen, "no escape sequences without a terminal"
    assert f"Job {name}  stopped" in out
    assert "Replication: nothing reported yet" in out
    assert "Machines (2 of 2 registered)" in out
    table = out[out.index("RANK") :].splitlines()
    assert table[0].split() == ["RANK", "STATE", "INSTANCE", "HOST", "HEARTBEAT", "ITERATION", "REPLICATED"]
    assert [line.split()[:3] for line in table[1:3]] == [
        ["0", "healthy", f"i-{name}-0"],
        ["1", "healthy", f"i-{name}-1"],
    ]
    assert "Failures: none" in out


def test_watch_leaves_on_ctrl_c(root: Root) -> None:
    name = unique("watch-int")
    _running_job(root, name, machines=1)
    process = _watch(root, name)
    try:
        assert process.stdout is not None
        assert f"job {name}: running" in process.stdout.readline()
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and "Traceback" not in err


def test_watch_redraws_in_place_on_a_terminal(root: Root) -> None:
    name = unique("watch-tty")
    job = _running_job(root, name)
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.update(screen=castor_on_tty(root, "jobs", "watch", name, "--interval", "0.2"))
    )
    thread.start()
    try:
        # Whenever the stop lands (before the watcher starts or after), the watcher ends with the job.
        root.api("POST", f"/api/v1/jobs/{job['id']}/stop").raise_for_status()
    finally:
        thread.join(timeout=90)
    code, screen = result["screen"]
    assert code == 0, screen
    assert f"i-{name}-0" in screen and f"i-{name}-1" in screen
    assert "\x1b[" in screen, "colours and cursor movement on a terminal"
    assert "stopped" in screen


def test_watch_json_is_the_last_snapshot(root: Root) -> None:
    name = unique("watch-json")
    job = _running_job(root, name, machines=1)
    root.api("POST", f"/api/v1/jobs/{job['id']}/stop").raise_for_status()
    env = {**base_env(), "CASTOR_ROOT_URL": root.url, "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN}
    completed = subprocess.run(
        [sys.executable, "-m", "services.cli", "jobs", "watch", name, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root.workdir,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    document = json.loads(completed.stdout)
    assert document["job"] == root.api("GET", f"/api/v1/jobs/{job['id']}").json()
    assert [m["rank"] for m in document["machines"]] == [0] and document["failures"] == []


def test_watch_view_shows_replication_and_the_recovery_in_progress() -> None:
    """The view's pieces, in process: replication as JobOut reports it, and the newest failure's phases
    as the API computes them (a software failure still restoring: no replace phase, the restore under
    way, nothing yet for the resume)."""
    now = datetime(2026, 1, 2, 12, 0, 10, tzinfo=UTC)
    job = {
        "name": "gpt",
        "state": "recovering",
        "newest_iteration": 120,
        "machines": 2,
        "machines_healthy": 1,
        "failures": 1,
        "replicas": 2,
        "replicated_iteration": 118,
        "replication_interval": 2,
        "replication_lag": 2,
        "replication_state": "ok",
    }
    machine = {
        "rank": 0,
        "state": "healthy",
        "instance_id": "i-0",
        "hostname": "h0",
        "last_heartbeat_at": "2026-01-02T12:00:09Z",
        "summary": {"local": {"0": 120}, "replicated_iteration": 118},
    }
    failure = {
        "id": 7,
        "number": 1,
        "kind": "software",
        "rank": 1,
        "state": "recovering",
        "cause": "rank 1 exited with code 1",
        "detected_at": "2026-01-02T12:00:00Z",
        "classified_at": "2026-01-02T12:00:00.500Z",
        "replaced_at": None,
        "restored_at": None,
        "resumed_at": None,
    }
    snapshot = watch.Snapshot(job, [machine], [failure])
    text = render.to_text(watch.watch_view(snapshot, now))
    assert "Job gpt  recovering  iteration 120  machines 1/2 healthy  failures 1" in text
    assert "Replication: ok, iteration 118, every 2 iterations, lag 2" in text
    assert "Recovery of failure #1 (software, rank 1): recovering  rank 1 exited with code 1" in text
    phases = {line.split()[0]: line for line in text.splitlines() if line.split()[:1]}
    assert phases["classify"].split()[-1] == "ms"
    assert "under way, 9.5 s so far" in phases["restore"]
    assert "replace" not in phases and "resume" not in phases
    machine_row = next(line for line in text.splitlines() if "i-0" in line).split()
    assert machine_row == ["0", "healthy", "i-0", "h0", "1", "s", "ago", "120", "118"]
    stalled = render.to_text(
        watch.watch_view(watch.Snapshot({**job, "replication_state": "stalled"}, [], []))
    )
    assert "Replication: stalled, iteration 118" in stalled and "Failures: none" in stalled
