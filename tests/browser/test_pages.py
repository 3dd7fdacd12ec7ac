"""The status pages in a real browser: the login gate and the jobs list."""

from __future__ import annotations

import uuid

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.browser.conftest import ARTIFACTS, RootService, sign_in

pytestmark = pytest.mark.browser


def test_pages_without_the_token_redirect_to_the_login(page: Page, root_service: RootService) -> None:
    target = f"/jobs/{uuid.uuid4()}"
    page.goto(root_service.url + target)
    page.wait_for_url("**/login?next=**")
    expect(page.locator("h1")).to_have_text("Sign in")
    assert page.locator("input[name=next]").input_value() == target

    page.fill("#token", "castor-admin.wrong")
    page.click("button[type=submit]")
    expect(page.locator(".error")).to_have_text("That is not the admin token.")
    assert not [c for c in page.context.cookies() if c["name"] == "castor_session"]

    page.fill("#token", root_service.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(root_service.url + target)
    expect(page.locator("h1")).to_have_text("Not found")  # signed in; that job does not exist
    (cookie,) = [c for c in page.context.cookies() if c["name"] == "castor_session"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert root_service.admin_token not in cookie["value"]
    assert page.evaluate("document.cookie") == "", "scripts cannot read the session"

    page.click("text=Log out")
    page.wait_for_url("**/login")
    page.goto(root_service.url + "/")
    page.wait_for_url("**/login**")


def test_jobs_list_shows_a_job_created_through_the_api(page: Page, root_service: RootService) -> None:
    name = f"browser-{uuid.uuid4().hex[:8]}"
    job = root_service.api("POST", "/api/v1/jobs", json={"name": name, "machines": 4, "replicas": 2})
    sign_in(page, root_service.url, root_service.admin_token)

    row = page.locator("table.jobs tbody tr", has=page.locator(f"a:text-is('{name}')"))
    expect(row).to_have_count(1)
    expect(row.locator("td[data-label=State]")).to_have_text("pending")
    expect(row.locator("td[data-label='Machines healthy']")).to_have_text("0 / 4")
    expect(row.locator("td[data-label=Failures]")).to_have_text("0")

    page.click("nav.tabs >> text=running")
    page.wait_for_url("**/?state=running")
    expect(page.locator(f"a:text-is('{name}')")).to_have_count(0)
    page.click("nav.tabs >> text=pending")
    expect(page.locator(f"a:text-is('{name}')")).to_have_count(1)

    page.click(f"a:text-is('{name}')")
    page.wait_for_url(f"**/jobs/{job['id']}")
    expect(page.locator("h1")).to_contain_text(name)
    expect(page.locator(".group")).to_have_count(2)
    expect(page.locator("article.machine")).to_have_count(4)
    expect(page.locator("article.machine .badge").first).to_have_text("unregistered")


def test_pages_read_without_javascript(browser: Browser, root_service: RootService) -> None:
    name = f"nojs-{uuid.uuid4().hex[:8]}"
    job = root_service.api("POST", "/api/v1/jobs", json={"name": name, "machines": 2, "replicas": 2})
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        sign_in(page, root_service.url, root_service.admin_token, f"/jobs/{job['id']}")
        expect(page.locator("h1")).to_contain_text(name)
        expect(page.locator("article.machine")).to_have_count(2)
        expect(page.locator("#placement")).to_contain_text("Recovery probability")
        expect(page.locator("#refresh-status")).to_have_text("")  # nothing ran
    finally:
        context.close()


def test_a_machine_whose_checkpoints_are_on_storage_is_pointed_out(
    page: Page, root_service: RootService
) -> None:
    """Its agent says so in its heartbeats (summary.store_filesystem): a warning above the counters names
    the machine, and its box says where its checkpoints are."""
    job = root_service.api(
        "POST", "/api/v1/jobs", json={"name": f"disk-{uuid.uuid4().hex[:8]}", "machines": 2}
    )
    worker = {"Authorization": f"Bearer {job['worker_token']}"}
    base = f"{root_service.url}/api/v1/worker/jobs/{job['id']}/machines"
    for rank in range(2):
        body = {"instance_id": f"i-{rank}", "address": "127.0.0.1", "data_port": 7000 + rank, "rank": rank}
        httpx.post(base, json=body, headers=worker, timeout=30).raise_for_status()
        summary = {"local": {str(rank): 7}, **({"store_filesystem": "ext4"} if rank == 1 else {})}
        beat = {"instance_id": f"i-{rank}", "summary": summary}
        httpx.post(f"{base}/{rank}/heartbeat", json=beat, headers=worker, timeout=30).raise_for_status()
    sign_in(page, root_service.url, root_service.admin_token, f"/jobs/{job['id']}")
    alert = page.locator(".alert-storage")
    expect(alert).to_contain_text("Checkpoints on storage, not in memory on 1 machine: machine 1 (ext4).")
    expect(alert.locator("code").first).to_have_text("--shm-dir")
    expect(page.locator("article.machine[aria-label='machine 1'] dd.warn")).to_have_text("on ext4")
    expect(page.locator("article.machine[aria-label='machine 0'] dd.warn")).to_have_count(0)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / "job-page-storage.png", full_page=True)
