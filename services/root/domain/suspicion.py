"""Suspicion before replacement: what the leader concludes about one machine from its heartbeats and the
other signals it has. Pure: the caller reads the machine, its job's open failures and the cloud operator's
opinion, and applies the verdict.

A lapse of heartbeats alone (a REST timeout, an expired etcd lease) makes a machine `suspect`: on a loaded
host a healthy agent's heartbeats can queue past their timeout, and replacing a healthy machine costs a
recovery (and, on AWS, the instance). A suspect is declared lost on a second signal:
- its peers' training processes failed after its last sign of life (they were waiting on it in a
  collective), reported by their agents;
- the cloud operator says its instance is gone (the local operator saw its agent process exit; the Auto
  Scaling Group no longer has it healthy);
or after `grace` seconds of suspicion without either. Its heartbeats resuming first reinstates it; a failed
machine whose heartbeats resume before a replacement took its rank is reinstated too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

# How long before a suspect's last heartbeat a peer's crash still counts as caused by it (the heartbeat is
# periodic: the machine may have died up to one interval after it), as flows.failures.SYMPTOM_SLACK.
PEER_SLACK = timedelta(seconds=2)


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
) -> str | None:
    """Why a suspect is lost now (the cause recorded on its failure event), or None: still suspect.

    `peer_failures`: when the job's open process-exit failures on other machines were detected;
    `operator_says_gone`: the cloud operator's health check (None: it does not know this machine)."""
    if machine.state != "suspect" or machine.suspected_at is None:
        return None
    if operator_says_gone:
        return "stopped heartbeating, and the cloud operator reports its instance gone"
    last = machine.last_heartbeat_at or machine.registered_at
    if any(at >= last - PEER_SLACK for at in peer_failures):
        return "stopped heartbeating, and its peers' training processes failed"
    silent = (now - machine.suspected_at).total_seconds()
    if silent > grace_s:
        return f"stopped heartbeating (suspect for {silent:.0f}s without a sign of life)"
    return None


def reinstatable(
    machine_state: str,
    last_heartbeat_at: datetime | None,
    failed_at: datetime | None,
    replaced: bool,
) -> bool:
    """A failed machine whose agent heartbeated after it was declared failed, while no replacement has
    taken its rank: it was alive after all."""
    return (
        machine_state == "failed"
        and not replaced
        and failed_at is not None
        and last_heartbeat_at is not None
        and last_heartbeat_at > failed_at
    )
