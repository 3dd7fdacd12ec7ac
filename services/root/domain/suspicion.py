"""Suspicion before replacement: what the leader concludes about one machine from its heartbeats and the
other signals it has. Pure: the caller reads the machine, its job's open failures and the cloud operator's
opinion, and applies the verdict.

A lapse of heartbeats alone (a REST timeout, an expired etcd lease) makes a machine `suspect`: on a loaded
host a healthy agent's heartbeats can queue past their timeout, and replacing a healthy machine costs a
recovery (and, on AWS, the instance). A suspect is declared lost on a second signal:
- its peers' training processes failed after its last sign of life in a way that points at a peer (they
  were waiting on it in a collective: `implicates_a_peer`), reported by their agents;
- the cloud operator says its instance is gone (the local operator saw its agent process exit; the Auto
  Scaling Group no longer has it healthy);
or after `grace` seconds of suspicion without either, unless the job's machines are silent en masse
(`mass_silence`): when a large share of them lapse at once, the observer (the root's host, etcd, the
network to them) is the likelier fault, and silence alone declares none lost (as Kubernetes' node
controller stops evicting in a zone where most nodes went unready at once). Its heartbeats resuming
first reinstates it; a failed machine whose heartbeats resume before a replacement took its rank is
reinstated too.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from worker_lib.api.worker import HANG_ERROR_TYPE

# How long before a suspect's last heartbeat a peer's crash still counts as caused by it (the heartbeat is
# periodic: the machine may have died up to one interval after it), as flows.failures.SYMPTOM_SLACK.
PEER_SLACK = timedelta(seconds=2)


# Exceptions that say a process lost a peer: torch.distributed's own error types, gloo's and NCCL's
# transport errors (gloo: "Read error ...: Connection reset by peer", "Timed out waiting 5000ms for recv
# operation to complete"; NCCL: "Watchdog caught collective operation timeout"), a store that went away,
# and a process the agent's hang watchdog stopped (it stopped committing: most often stuck in a collective).
_PEER_ERROR_TYPES = frozenset(
    {"DistBackendError", "DistNetworkError", "DistStoreError", "DistError", HANG_ERROR_TYPE}
)
_PEER_ERROR_WORDS = re.compile(
    r"gloo|nccl|c10d|processgroup|collective|connection (?:reset|closed|refused|aborted)|broken pipe"
    r"|timed out waiting|socket timeout|store->get",
    re.IGNORECASE,
)
# Signals that come from outside the process (the kernel's OOM killer, an operator, a scheduler): a process
# they ended was not failing in a collective. SIGABRT is not among them: NCCL's watchdog aborts the process
# when a collective times out, and gloo's threads can too.
_EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def implicates_a_peer(exit_code: int | None, error: Mapping[str, Any] | None) -> bool:
    """Whether a training process's failure may be its waiting on a dead peer, so that it can be a
    silent machine's second signal (and fold into its loss as a symptom).

    With the exception the process recorded (torchelastic's error file, or the hang watchdog's report),
    only a communication failure does: a ValueError in the training code or a CUDA out-of-memory says
    nothing about the peers. Without one, a kill by a signal from outside the process does not, and
    anything else (a script without `@record` exiting with 1, an abort) may: the exit code alone cannot
    tell, and treating it as a symptom keeps what a machine loss costs to its old bound."""
    if error:
        kind = str(error.get("type") or "").rsplit(".", 1)[-1]
        text = f"{error.get('message') or ''}"
        return kind in _PEER_ERROR_TYPES or bool(_PEER_ERROR_WORDS.search(text))
    if exit_code is None:
        return True
    signum = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else 0
    return signum not in _EXTERNAL_SIGNALS


# Below this many suspects a job's silence is never "en masse": a group of 2 of a 4-machine job (a real
# rack's loss) must still be declared lost on the grace alone.
MASS_SILENCE_MIN = 3


def mass_silence(suspects: int, machines: int, fraction: float) -> bool:
    """Whether `suspects` of a job's `machines` silent at once are too many to believe (see the module)."""
    return suspects >= max(MASS_SILENCE_MIN, math.ceil(fraction * machines))


@dataclass(frozen=True)
class Seen:
    """What the leader knows of one machine."""

    state: str  # MachineState value
    last_heartbeat_at: datetime | None
    registered_at: datetime
    suspected_at: datetime | None


def lapsed(machine: Seen, now: datetime, timeout_s: float) -> bool:
    """REST mode: a healthy (or just registered) machine silent for longer than the heartbeat timeout."""
    if machine.state not in ("healthy", "pending"):
        return False
    last = machine.last_heartbeat_at or machine.registered_at
    return now - last > timedelta(seconds=timeout_s)


def resumed(machine: Seen) -> bool:
    """A suspect whose agent heartbeated after it became suspect."""
    return (
        machine.state == "suspect"
        and machine.suspected_at is not None
        and machine.last_heartbeat_at is not None
        and machine.last_heartbeat_at > machine.suspected_at
    )


def verdict(
    machine: Seen,
    now: datetime,
    grace_s: float,
    *,
    peer_failures: list[datetime],
    operator_says_gone: bool | None,
    en_masse: bool = False,
    believed_since: datetime | None = None,
) -> str | None:
    """Why a suspect is lost now (the cause recorded on its failure event), or None: still suspect.

    `en_masse`: the job's machines are silent in such numbers (`mass_silence`) that the grace declares
    nothing; the second signals still do. `believed_since`: when the job's last mass silence ended; the
    grace counts from then for a machine suspected before (silence during it proved nothing, and the
    machines of a lapse storm come back over seconds, not at once).

    `peer_failures`: when the job's open process-exit failures on other machines that implicate a peer
    (`implicates_a_peer`) were detected;
    `operator_says_gone`: the cloud operator's health check (None: it does not know this machine)."""
    if machine.state != "suspect" or machine.suspected_at is None:
        return None
    if operator_says_gone:
        return "stopped heartbeating, and the cloud operator reports its instance gone"
    last = machine.last_heartbeat_at or machine.registered_at
    if any(at >= last - PEER_SLACK for at in peer_failures):
        return "stopped heartbeating, and its peers' training processes failed"
    silent = (now - machine.suspected_at).total_seconds()
    counted_from = max(machine.suspected_at, believed_since or machine.suspected_at)
    if not en_masse and (now - counted_from).total_seconds() > grace_s:
        return f"stopped heartbeating (suspect for {silent:.0f}s without a sign of life)"
    return None


def reinstatable(
    machine_state: str,
    last_heartbeat_at: datetime | None,
    failed_at: datetime | None,
    replaced: bool,
) -> bool:
    """A failed machine whose agent heartbeated after it was declared failed, while no replacement has
    taken its rank or gone past the point of no return (`replaced`): it was alive after all."""
    return (
        machine_state == "failed"
        and not replaced
        and failed_at is not None
        and last_heartbeat_at is not None
        and last_heartbeat_at > failed_at
    )
