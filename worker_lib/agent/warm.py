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

The script then runs as `python script.py` started cold would: its real directory (symlinks resolved) first
on sys.path, an absolute __file__, and the agent's stdin (passed as CASTOR_WARM_STDIN_FD), not the order's
pipe.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import io
import json
import os
import pkgutil
import runpy
import sys
import types
from collections.abc import Callable

from worker_lib.agent import die_with_parent, stacks

DEFAULT_PRELOAD = "torch,torch.distributed,torch.nn.parallel,torch._dynamo"
READY_FD_ENV = "CASTOR_WARM_READY_FD"
# The agent's stdin, for the script: a cold-started process inherits it (-1: the agent has none).
STDIN_FD_ENV = "CASTOR_WARM_STDIN_FD"


def main() -> None:
    parent = os.environ.pop(die_with_parent.PARENT_PID_ENV, None)
    if parent is not None:  # die with the agent, as a spare and as the training process it becomes
        die_with_parent.arm(int(parent))
    for module in filter(None, os.environ.get("CASTOR_PRELOAD", DEFAULT_PRELOAD).split(",")):
        importlib.import_module(module.strip())
    stdin_fd = os.environ.pop(STDIN_FD_ENV, None)
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
    if stdin_fd is not None:  # else (not started by the agent) the order's pipe stays, at its end
        adopt_stdin(int(stdin_fd))
    argv: list[str] = order["argv"]
    recorded(run, argv)


def adopt_stdin(fd: int) -> None:
    """Make `fd` (the agent's stdin; -1: none) this process's stdin in place of the order's pipe, with
    sys.stdin as CPython makes it at startup: what a cold start of the script has."""
    stream: io.TextIOWrapper | None = None  # as CPython without an fd 0
    if fd < 0:
        os.close(0)
    else:
        os.dup2(fd, 0)
        os.close(fd)
        # CPython's create_stdio, for stdin: buffered, newline "\n", line-buffered on a terminal.
        buffer = open(0, "rb", closefd=False)  # noqa: SIM115
        buffer.raw.name = "<stdin>"  # type: ignore[attr-defined]
        stream = io.TextIOWrapper(
            buffer,
            encoding=sys.stdin.encoding,
            errors=sys.stdin.errors,
            newline="\n",
            line_buffering=os.isatty(0),
        )
        stream.mode = "r"  # type: ignore[misc]
    sys.stdin = stream
    sys.__stdin__ = stream  # type: ignore[misc]


def _set_path0(entry: str) -> None:
    """The script's entry of the module search path, where CPython puts it: in place of the spare's own
    (`-m`: the spare's working directory). With safe_path (-P, PYTHONSAFEPATH; the spare's and the cold
    start's alike) neither has one."""
    if not sys.flags.safe_path:
        sys.path[0] = entry


def run(argv: list[str]) -> None:
    """Run the command's script or module as `python ARGV...` would, started cold."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        _set_path0(os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = argv
    script = os.path.abspath(argv[0])  # __file__ is absolute, as CPython (3.9+) makes it
    if pkgutil.get_importer(script) is None:  # a file: its real directory (symlinks resolved) comes first
        _set_path0(os.path.dirname(os.path.realpath(script)))
        run_file(script)
        return
    if not sys.flags.safe_path:  # a directory or zip with a __main__.py: runpy puts it first
        del sys.path[0]
    runpy.run_path(script, run_name="__main__")


def run_file(script: str) -> None:
    """Run the file `script` as the __main__ module, as CPython runs `python script`: unlike
    runpy.run_path, sys.argv[0] stays as the command gave it while __file__ is absolute."""
    loader: importlib.machinery.SourceFileLoader | importlib.machinery.SourcelessFileLoader
    with io.open_code(script) as source:
        code = pkgutil.read_code(source)  # a compiled file (.pyc), as CPython runs one
        if code is None:
            source.seek(0)
            code = compile(source.read(), script, "exec")
            loader = importlib.machinery.SourceFileLoader("__main__", script)
        else:
            loader = importlib.machinery.SourcelessFileLoader("__main__", script)
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=script, __cached__=None, __loader__=loader, __builtins__=builtins, __annotations__={}
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


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
