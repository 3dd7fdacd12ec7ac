"""A warm training process: an interpreter that has already imported the heavy modules (torch) and waits
for the agent to say which training script to run, as which rank.

Restarting training after a failure means starting Python and importing torch in every process again:
seconds per process, and on a busy machine the larger part of a software failure's recovery (the paper
measured 253 s of restart warm-up). The agent keeps one warm process per local rank ready; a restart
hands it the command and environment, and training starts at once.

Protocol: one JSON line on stdin, {"argv": [...], "env": {...}, "cwd": "..."}; an empty stdin means "not
needed", and the process exits. Modules named in CASTOR_PRELOAD (comma-separated; default: torch and what
DistributedDataParallel imports on construction, torch._dynamo alone being 1.5 s) are imported first;
variables those modules read at import time come from the agent's environment. A spare dies with its agent
(the parent-death signal, armed before the imports), and so does the training process it becomes.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from collections.abc import Callable

from worker_lib.agent import die_with_parent, stacks

DEFAULT_PRELOAD = "torch,torch.distributed,torch.nn.parallel,torch._dynamo"
READY_FD_ENV = "CASTOR_WARM_READY_FD"


def main() -> None:
    parent = os.environ.pop(die_with_parent.PARENT_PID_ENV, None)
    if parent is not None:  # die with the agent, as a spare and as the training process it becomes
        die_with_parent.arm(int(parent))
    for module in filter(None, os.environ.get("CASTOR_PRELOAD", DEFAULT_PRELOAD).split(",")):
        importlib.import_module(module.strip())
    ready_fd = int(os.environ.pop(READY_FD_ENV, "-1"))
    if ready_fd >= 0:  # tell the agent the imports are done
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    line = sys.stdin.readline()
    if not line.strip():
        return
    order = json.loads(line)
    os.environ.clear()
    os.environ.update(order["env"])
    stacks.install_stack_dump()  # the hang watchdog's evidence, before the script runs
    os.chdir(order["cwd"])
    argv: list[str] = order["argv"]
    recorded(run, argv)


def run(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def recorded(function: Callable[[list[str]], None], argv: list[str]) -> None:
    """Run the script as torchelastic's `@record` would: an uncaught exception is written to
    TORCHELASTIC_ERROR_FILE (which the agent sends with the exit report), then raised as before. A script
    started from a spare needs no `@record` of its own; one that has it writes the same exception there
    first."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # torch without torch.distributed: the exit code alone, as before
        function(argv)
        return
    record(function)(argv)


if __name__ == "__main__":
    main()
