"""stacks.exit_after: a process that decided to stop exits on time, with the stacks of what held it."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.e2e.cluster import REPO

# The interpreter waits for every non-daemon thread at exit: one that never returns keeps the process, as a
# to_thread call that never returns keeps asyncio.run, until the deadline.
HELD = """
import threading
from worker_lib.agent import stacks
threading.Thread(target=threading.Event().wait, name="never-returns").start()
stacks.exit_after(0.5, 7, "the agent")
"""


def test_a_process_held_by_a_thread_that_never_returns_exits_at_the_deadline_with_its_stacks() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HELD], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 7, done.stderr
    assert "the agent still running 0.5s after it stopped: exiting" in done.stderr
    # Every thread's stack: the held one (in Event.wait), and the main thread waiting for it at shutdown.
    assert done.stderr.count("(most recent call first)") >= 3, done.stderr
    assert "in _shutdown" in done.stderr and 'threading.py", line' in done.stderr, done.stderr
    assert time.monotonic() - started < 30


def test_a_process_that_exits_by_itself_is_not_cut_short() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from worker_lib.agent import stacks\nstacks.exit_after(30, 7, 'the agent')"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0 and "still running" not in done.stderr, done.stderr
