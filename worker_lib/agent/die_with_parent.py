"""Training processes die with their agent: Linux's parent-death signal (prctl PR_SET_PDEATHSIG).

A training process outliving its agent keeps its GPUs and its rank's collectives busy while a restarted
agent (or a replacement) starts a second set. The kernel sends the signal when the *thread* that forked the
child ends; the agent forks from its event loop, which runs in its main thread for the agent's whole life.
The signal must be asked for by the child itself, so a process whose parent died before it asked would be
missed: `arm` checks the parent is still the one expected right after asking, and exits otherwise.

Cold starts go through this file as a tiny exec wrapper (`python -I -S die_with_parent.py PARENT LC -- cmd
...`): it arms the signal and execs the command in place (same pid; the signal survives exec). It is run
by path and imports only the standard library, so it costs a bare interpreter start (tens of ms), not the
package's imports. Warm spares call `arm` themselves before importing torch.

Why not `preexec_fn`: the agent has threads (replication, to_thread), and Python documents preexec_fn as
unsafe with threads (the child may deadlock before exec).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "CASTOR_AGENT_PID"  # tells a warm spare which agent must be alive when it arms the signal


def arm(expected_parent: int, signum: int = signal.SIGKILL) -> None:
    """Ask for `signum` when the parent dies; if the parent already is not `expected_parent` (it died
    before this ran), die now: nobody would stop this process later."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != expected_parent:
        os._exit(128 + signum)


def wrap(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """`command` started through the wrapper, which arms the signal for this process as its parent."""
    # A bare interpreter coerces a C locale by setting LC_CTYPE in its environment (PEP 538); the
    # wrapper must exec the command with the environment it was given, so it is told whether to drop it.
    lc_ctype = "1" if "LC_CTYPE" in env else "0"
    return [sys.executable, "-I", "-S", __file__, str(os.getpid()), lc_ctype, "--", *command]


def main(argv: Sequence[str]) -> None:
    parent, lc_ctype, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: die_with_parent.py PARENT_PID LC_CTYPE_GIVEN -- COMMAND ...")
    arm(int(parent))
    if lc_ctype == "0":
        os.environ.pop("LC_CTYPE", None)
    # Python ignores these at startup and exec keeps ignored signals ignored: the command gets them as a
    # direct start would (subprocess restores them for its children), or `yes | head -1` reports EPIPE.
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:  # as a failed exec of the command itself would: 127, said on stderr
        print(f"castor: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
