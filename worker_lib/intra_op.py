"""Cores for a background save beside CPU training: torch's intra-op threads make room for the copy.

Torch's intra-op threads on the CPU are libgomp's, which spin at the end of every parallel operator waiting
for each other. A copy thread that preempts one of them holds the others up for its time slice as well, so
the copy's cycles are paid twice: on 2 cores the forward beside the background copy of a 1.3 GB state
lengthened by 0.23 s where the same copy alone took 0.12 s (docs/figures.md). With one intra-op thread
fewer while the copy runs, the operators run undisturbed on the cores left and the copy on its own: +0.11 s.

The threads come back at the first module call after the copy ends (global forward hooks, registered only
while yielding), at the end of the outermost forward whatever happens (a backward is out of the hooks'
sight, so it never runs short of threads for long), and at any fence (the optimizer step, the next save).

Off unless CASTOR_YIELD_CORES=1: torch's CPU reductions split their work by the thread count, so an operator
that runs while the copy does gives results that differ in the last bits from the same operator on all the
threads, and when the copy ends depends on timing. Training is then no longer reproducible bit for bit from
run to run, nor is a resumed run against an uninterrupted one. Holding the threads back for a fixed span (the
whole forward) would keep it reproducible, but cost more than it saves (0.24 s against 0.22 s).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

YIELD_CORES_ENV = "CASTOR_YIELD_CORES"


@dataclass(frozen=True)
class CoreShare:
    """How the cores are shared while a background copy runs: torch's intra-op threads and the copy's."""

    torch_threads: int
    copy_threads: int


def share_cores(torch_threads: int, cores: int, copy_threads: int) -> CoreShare | None:
    """The share that keeps torch's threads and the copy's within the cores, or None when they fit already
    (or torch has a single thread to give). A copy is limited by memory bandwidth beyond a few threads, and
    what the operators lose, cores x time, is about the same for any number of copy threads: a quarter of
    the cores at most, one at least."""
    wanted = max(1, min(copy_threads, cores // 4))
    if torch_threads <= 1 or torch_threads + wanted <= cores:
        return None
    return CoreShare(torch_threads=max(1, min(torch_threads, cores - wanted)), copy_threads=wanted)


def yield_enabled() -> bool:
    value = os.environ.get(YIELD_CORES_ENV, "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"{YIELD_CORES_ENV}={value!r}: expected 1 (yield cores to the copy) or 0")
    return value == "1"


def available_cores() -> int:
    return len(os.sched_getaffinity(0))


class CoreYield:
    """Lowers the calling thread's intra-op threads for one background copy and raises them back (see the
    module's docstring). torch.set_num_threads acts on the calling thread's OpenMP setting, so only the
    thread that saved (the training thread) changes it, never the copy threads."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._restore_to: int | None = None  # the thread count before the yield; None: not yielding
        self._lowered_to = 0
        self._owner = 0  # the thread that saved
        self._copy_done: Callable[[], bool] = bool
        self._depth = 0  # module calls entered and not left, since the yield began
        self._hooks: list[RemovableHandle] = []

    def plan(self, copy_threads: int) -> CoreShare | None:
        """The share for a copy of up to `copy_threads` threads that starts now beside training."""
        if not self.enabled:
            return None
        return share_cores(torch.get_num_threads(), available_cores(), copy_threads)

    def begin(self, share: CoreShare, copy_done: Callable[[], bool]) -> None:
        self.end()
        self._restore_to = torch.get_num_threads()
        self._lowered_to = share.torch_threads
        self._owner = threading.get_ident()
        self._copy_done = copy_done
        self._depth = 0
        torch.set_num_threads(share.torch_threads)
        self._hooks = [
            register_module_forward_pre_hook(self._entering),
            register_module_forward_hook(self._leaving),
        ]

    def end(self) -> None:
        """Give the threads back. Called from another thread (a close() elsewhere), only the hooks go: the
        thread that saved gets its threads back at its next fence or save."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._restore_to is None or threading.get_ident() != self._owner:
            return
        restore_to, self._restore_to = self._restore_to, None
        if torch.get_num_threads() == self._lowered_to:  # a count the user set meanwhile stays
            torch.set_num_threads(restore_to)

    def _entering(self, module: nn.Module, args: object) -> None:
        if threading.get_ident() != self._owner:
            return
        self._depth += 1
        if self._copy_done():
            self.end()

    def _leaving(self, module: nn.Module, args: object, output: object) -> None:
        if threading.get_ident() != self._owner:
            return
        self._depth -= 1
        if self._depth <= 0:  # the outermost forward is over: backward comes next, out of sight
            self.end()
