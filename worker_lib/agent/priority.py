"""Replication yields the CPU to training.

GEMINI fits checkpoint traffic into the time training leaves idle. Interleaving (worker_lib/agent/pacing.py)
keeps the replica bytes off the wire while training's collectives are on it, but a replica also costs the
host CPU: the sender's pacing and socket writes, the receiver's copies into shared memory and its checksums,
and the kernel's packet work charged to those threads. Where the host's cores are busy (gloo's all-reduce
on CPU, a data loader, a host-side optimizer) that work competes with training for them. The threads that
move replicas therefore run `nice` steps below the process (CASTOR_REPLICATION_NICE, default 10): the
kernel's scheduler gives training the cores first and replication what is left, which is what "idle"
means (measured with benchmarks/network.py: docs/figures.md, Network).

Only those threads are lowered (Linux's nice is per thread): the agent's event loop, which refreshes its
lease and answers the root, stays at the process's priority, and so does a restore's fetch from a peer.
The holder's side of that fetch is a data-plane connection like any other; it runs while the job's
training is stopped for the recovery, when nothing competes for the cores. The lowered threads share the
agent's interpreter lock: one preempted while it holds the lock holds the event loop up until the
scheduler runs it again (benchmarks/replication_priority.py: at most about 0.3 s at nice 10 with every
core spinning at nice 0, against lease refreshes a third of a TTL apart). Embedded mode
(worker_lib.embedded) runs these threads inside a training process, whose own thread would wait the same
way, so it lowers them only when CASTOR_REPLICATION_NICE says so. Elsewhere than Linux nice is per
process, and nothing is changed.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

NICE_ENV = "CASTOR_REPLICATION_NICE"
REPLICATION_NICE = 10  # 0: replication at training's priority
NICE_MAX = 19  # the lowest priority Linux has


def replication_nice(text: str | None, default: int = REPLICATION_NICE) -> int:
    """The steps below the process that replication's threads run at, from CASTOR_REPLICATION_NICE or
    --replication-nice (None or empty: `default`)."""
    if text is None or not text.strip():
        return default
    try:
        nice = int(text)
    except ValueError:
        nice = -1
    if not 0 <= nice <= NICE_MAX:
        raise ValueError(f"{NICE_ENV} must be a whole number from 0 to {NICE_MAX}, got {text!r}")
    return nice


_warned = False


def lower_thread_priority(nice: int) -> None:
    """Run the calling thread `nice` steps below its process's priority (at most 19); threads it starts
    inherit it. Never raises: a thread that cannot be lowered replicates at the process's priority."""
    global _warned
    if nice <= 0 or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        # The process's own priority is its main thread's (its id is the process id).
        target = min(NICE_MAX, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, thread) < target:
            os.setpriority(os.PRIO_PROCESS, thread, target)
    except OSError as exc:  # a sandbox that forbids it (seccomp): replication still works
        if not _warned:
            _warned = True
            log.warning("replication keeps training's CPU priority: lowering it failed: %s", exc)
