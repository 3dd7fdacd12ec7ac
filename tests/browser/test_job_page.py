"""The job page of a real job: four agents ("machines") training with replicas in groups of two; one
machine is lost, the root replaces it and the job recovers from a peer's memory. The page, refreshing
itself, shows the placement groups, then the failure in the timeline with its tier; the screenshot is a
test artifact (and, with CASTOR_UPDATE_SCREENSHOTS=1 or when missing, the README's docs/screenshots)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import ARTIFACTS, REPO, sign_in
from tests.e2e.cluster import LocalCluster, Machine, wait_until

# serial: a four-machine cluster with a 3 s heartbeat timeout, expecting exactly one failure; beside another
# test's processes a starved machine could be declared lost too (and it would load that test in turn).
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.serial]

SCREENSHOT = REPO / "docs" / "screenshots" / "job-page.png"


@pytest.mark.timeout(480)
def test_job_page_shows_placement_then_a_recovered_failure_with_its_tier(
    page: Page, cluster: LocalCluster, tmp_path: Path
) -> None:
    root = cluster.start_root()
    command = cluster.training_command(tmp_path / "logs", iterations=1_000_000, sleep=0.3)
    job = cluster.launch_job(command, name="llama-8b-pretrain", machines=4, replicas=2, persist_every=25)
    sign_in(page, root.url, cluster.admin_token, f"/jobs/{job['id']}")

    # The placement: two groups of two machines, every machine healthy once the agents registered.
    expect(page.locator(".group")).to_have_count(2)
    expect(page.locator(".group").nth(0).locator(".group-head")).to_contain_text("Group 0")
    expect(page.locator(".group").nth(1).locator("article.machine")).to_have_count(2)
    expect(page.locator("article.machine.state-healthy")).to_have_count(4, timeout=120_000)
    wait_until(
        lambda: (cluster.job_state()["newest_iteration"] or 0) >= 25, 240, "25 iterations", interval=0.5
    )
    cluster.wait_until_warm()
    # The page refreshes itself: the machines' newest iterations appear without a reload.
    expect(page.locator("article.machine[aria-label='machine 1'] dd[title^='rank 1:']")).to_have_text(
        re.compile(r"^\d+$")
    )
    expect(page.locator("#iterations polyline.series")).to_have_count(1)

    # Steady state: the group peer holds a current replica of machine 1's checkpoint (as it does between
    # two saves of a training job that runs for more than a few seconds).
    wait_until(lambda: _replica_current(cluster, rank=1, holder=0), 60, "a current replica of rank 1", 0.2)

    # A hardware failure: machine 1's agent, its training process and its memory are gone at once.
    _lose_machine(cluster.root_machine(1))
    expect(page.locator(".alert-recovering")).to_contain_text("Recovering from failure", timeout=30_000)
    (event,) = cluster.wait_for_recoveries(1, timeout=180)
    # Usually "peer" (machine 0's replica of rank 1); "persistent" when the loss caught the replica behind.
    assert event["kind"] == "hardware" and event["tier"] in ("peer", "persistent"), event

    item = page.locator(".timeline li.event").first
    expect(item.locator(".event-id")).to_have_text(f"#{event['number']}", timeout=15_000)
    expect(item.locator(".badge.state-recovered")).to_have_count(1)
    expect(item.locator(".tier")).to_have_text(event["tier"])
    expect(item.locator(".lost b")).to_have_text(str(event["iterations_lost"]))
    expect(item.locator("svg.phasebar rect.phase-replace")).to_have_count(1)
    expect(item.locator("svg.phasebar rect.phase-resume")).to_have_count(1)
    expect(page.locator(".alert-last")).to_contain_text("Recovered from")
    expect(page.locator("#iterations .failure-label")).to_have_text(f"#{event['number']}")

    # Let training go on a little after the recovery, so the chart shows the dip and the climb after it.
    resumed = cluster.job_state()["newest_iteration"] or 0
    wait_until(
        lambda: (cluster.job_state()["newest_iteration"] or 0) >= resumed + 12,
        120,
        "training after recovery",
        0.5,
    )
    time.sleep(2.5)  # one more refresh of the page
    page.mouse.move(0, 0)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "job-page.png"
    page.screenshot(path=shot, full_page=True)
    assert shot.stat().st_size > 20_000
    if os.environ.get("CASTOR_UPDATE_SCREENSHOTS") == "1" or not SCREENSHOT.exists():
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)

    # The failure page: the plan, with the tier and source of every rank, and the replacement.
    item.locator(".event-id").click()
    page.wait_for_url(f"**/jobs/{job['id']}/failures/{event['id']}")
    expect(page.locator(".facts .tier")).to_have_text(event["tier"])
    sources = page.locator("table.sources tbody tr")
    expect(sources).to_have_count(4)
    expect(sources.nth(1).locator(".tier")).to_have_text(event["details"]["tiers"]["1"])
    if event["tier"] == "peer":
        expect(sources.nth(1).locator("td[data-label='Source machine']")).to_have_text("0")
        expect(sources.nth(0).locator(".tier")).to_have_text("local")
    expect(page.locator("#machines")).to_contain_text("replacement")
    page.screenshot(path=ARTIFACTS / "failure-page.png", full_page=True)


def _replica_current(cluster: LocalCluster, *, rank: int, holder: int) -> bool:
    machines = {
        m["rank"]: m["summary"] for m in cluster.api("GET", f"/api/v1/jobs/{cluster.job['id']}/machines")
    }
    local = machines.get(rank, {}).get("local", {}).get(str(rank))
    replica = machines.get(holder, {}).get("replicas", {}).get(str(rank))
    return local is not None and replica is not None and replica >= local


def _lose_machine(machine: Machine) -> None:
    """Kill the machine's agent and every process of it in one go (find them all first: a training
    process that outlived its agent by a moment would train on without replicating), then drop its memory."""
    marker = f"CASTOR_SHM_DIR={machine.shm_dir}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(machine.process.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    machine.process.wait()
    shutil.rmtree(machine.shm_dir, ignore_errors=True)
