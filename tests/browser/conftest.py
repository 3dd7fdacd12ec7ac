"""Real headless Chromium (the system's /usr/bin/chromium, driven by Playwright's sync API) against a real
root service process.

Browser tests are plain sync functions: Playwright's sync API refuses to run inside a running asyncio loop,
and pytest-asyncio only runs its loop around async tests and fixtures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright

from tests.e2e.cluster import ARTIFACTS
from tests.harness import free_port, stop_process, wait_for_port

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CASTOR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
ADMIN_TOKEN = "castor-admin.browser-test"


@dataclass
class RootService:
    url: str
    admin_token: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(
            method,
            self.url + path,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=30,
            **kwargs,
        )
        response.raise_for_status()
        return response.json() if response.content else None


@pytest.fixture(scope="module")
def root_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RootService]:
    """`castor serve` on a free port, embedded defaults (SQLite) in a temp state dir."""
    state_dir = tmp_path_factory.mktemp("root-state")
    port = free_port()
    log_path = state_dir / "root.log"
    env = {
        **os.environ,
        "CASTOR_STATE_DIR": str(state_dir),
        "CASTOR_ADMIN_TOKEN": ADMIN_TOKEN,
        "CASTOR_PORT": str(port),
        "CASTOR_HEARTBEAT_TIMEOUT_S": "3600",  # machines registered by hand never heartbeat
    }
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_port(port, process, timeout=60)
        yield RootService(f"http://127.0.0.1:{port}", ADMIN_TOKEN, process, log_path)
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        # scripts/setup installs it; a silent skip would let the page tests vanish from CI unnoticed.
        pytest.fail(f"no Chromium at {CHROMIUM}: run ./scripts/setup (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def context(browser: Browser, request: pytest.FixtureRequest) -> Iterator[BrowserContext]:
    context = browser.new_context(
        viewport={"width": 1280, "height": 900}, color_scheme="light", locale="en-US"
    )
    context.set_default_timeout(15_000)
    yield context
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        ARTIFACTS.mkdir(exist_ok=True)
        for index, page in enumerate(context.pages):
            page.screenshot(path=ARTIFACTS / f"{request.node.name}-{index}.png", full_page=True)
    context.close()


@pytest.fixture
def page(context: BrowserContext) -> Page:
    return context.new_page()


def sign_in(page: Page, base_url: str, token: str, path: str = "/") -> None:
    """Open `path`; the login form comes first; sign in and land on `path`."""
    page.goto(base_url + path)
    page.wait_for_url("**/login**")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/login" not in url)
