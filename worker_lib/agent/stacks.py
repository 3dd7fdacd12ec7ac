"""A training process's Python stacks, on the agent's request: the hang watchdog's evidence.

The agent names a file in CASTOR_STACKS_FILE when it starts a training process; the process registers
faulthandler to write every thread's stack there on SIGUSR1. faulthandler writes from its C signal handler,
without the GIL, so it works while the main thread is blocked inside a collective. Standard library only:
warm spares and the training side's notifier both call this, without importing torch. `exit_after` makes a
process that decided to stop exit on time, with its own stacks as the evidence of what held it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from typing import IO

STACKS_FILE_ENV = "CASTOR_STACKS_FILE"
STACKS_SIGNAL = signal.SIGUSR1

_installed: IO[str] | None = None  # kept open: faulthandler writes to its file descriptor


def install_stack_dump() -> bool:
    """Write every thread's stack to $CASTOR_STACKS_FILE on SIGUSR1 (once per process). False: no file
    named, or it cannot be opened (the watchdog then kills the process without its stacks)."""
    global _installed
    path = os.environ.get(STACKS_FILE_ENV)
    if _installed is not None or not path:
        return _installed is not None
    try:
        _installed = open(path, "w")  # noqa: SIM115 - must outlive this call
    except OSError:
        return False
    faulthandler.register(STACKS_SIGNAL, file=_installed, all_threads=True, chain=False)
    return True


def exit_after(deadline_s: float, code: int, what: str) -> threading.Timer:
    """Exit the process with `code` in `deadline_s` unless it exited by then, every thread's stack written
    to stderr first. For a process that has decided to stop (`castor agent` once its agent stopped): its
    cleanup and the interpreter's shutdown wait for threads (asyncio.run for every to_thread call, the
    interpreter for every non-daemon thread), and one that never returns would keep the process, and the
    machine it holds, forever. The timer is a daemon thread: it runs while the interpreter waits for them."""

    def expire() -> None:
        sys.stderr.write(
            f"{what} still running {deadline_s:g}s after it stopped: exiting; every thread's stack:\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.name = "castor-exit-deadline"
    timer.start()
    return timer
