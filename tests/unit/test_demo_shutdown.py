"""The demo's shutdown watchdog: a Ctrl-C whose shutdown hangs ends with the stacks printed, the job's
machines killed and status 1, never a silent hang."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_hung_shutdown_prints_the_stacks_kills_the_machines_and_exits_1() -> None:
    program = textwrap.dedent(
        """
        import threading
        from services.demo import ShutdownWatchdog

        class FakeDemo:
            def stop_machines_now(self):
                print("machines killed", flush=True)

        ShutdownWatchdog(FakeDemo(), budget_s=0.2).start()
        threading.Event().wait(60)  # the hang: a shutdown step that never returns
        print("not reached", flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "machines killed" in result.stdout
    assert "not reached" not in result.stdout
    assert "the shutdown took over 0 s" in result.stderr
    assert "threading.py" in result.stderr  # the main thread's stack, where it waits
