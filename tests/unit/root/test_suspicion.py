"""The pure suspicion rules: when heartbeats lapse, what declares a suspect lost, when it is reinstated."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from services.root.domain.suspicion import (
    Seen,
    implicates_a_peer,
    lapsed,
    mass_silence,
    reinstatable,
    resumed,
    verdict,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def suspect(last: float = 0.0, since: float = 3.0) -> Seen:
    return Seen("suspect", at(last), T0, at(since))


def test_only_a_live_machine_silent_past_the_timeout_lapses() -> None:
    assert lapsed(Seen("healthy", at(0), T0, None), at(3.1), 3.0)
    assert not lapsed(Seen("healthy", at(0), T0, None), at(2.9), 3.0)
    assert lapsed(Seen("pending", None, T0, None), at(4), 3.0), "no heartbeat yet: from registration"
    for state in ("suspect", "failed", "replaced"):
        assert not lapsed(Seen(state, at(0), T0, at(3)), at(60), 3.0)


def test_a_suspect_alone_stays_suspect_until_the_grace_passes() -> None:
    assert verdict(suspect(), at(5), 10.0, peer_failures=[], operator_says_gone=None) is None
    assert verdict(suspect(), at(5), 10.0, peer_failures=[], operator_says_gone=False) is None
    why = verdict(suspect(), at(13.5), 10.0, peer_failures=[], operator_says_gone=None)
    assert why is not None and "suspect for 10s" in why


def test_a_second_signal_declares_a_suspect_lost_at_once() -> None:
    why = verdict(suspect(), at(4), 10.0, peer_failures=[at(1)], operator_says_gone=None)
    assert why is not None and "peers' training processes failed" in why
    why = verdict(suspect(), at(4), 10.0, peer_failures=[], operator_says_gone=True)
    assert why is not None and "cloud operator" in why


def test_a_peer_failure_long_before_the_suspects_last_heartbeat_is_not_its_symptom() -> None:
    assert (
        verdict(suspect(last=30, since=33), at(34), 10.0, peer_failures=[at(1)], operator_says_gone=None)
        is None
    )


def test_only_a_suspect_is_judged() -> None:
    healthy = Seen("healthy", at(0), T0, None)
    assert verdict(healthy, at(60), 1.0, peer_failures=[at(1)], operator_says_gone=True) is None


def test_a_heartbeat_after_the_suspicion_resumes_it() -> None:
    assert resumed(Seen("suspect", at(4), T0, at(3)))
    assert not resumed(Seen("suspect", at(0), T0, at(3)))
    assert not resumed(Seen("healthy", at(4), T0, at(3)))


def test_a_failed_machine_is_reinstated_only_before_its_replacement_registered() -> None:
    assert reinstatable("failed", at(5), at(4), replaced=False)
    assert not reinstatable("failed", at(5), at(4), replaced=True)
    assert not reinstatable("failed", at(3), at(4), replaced=False), "no heartbeat since it failed"
    assert not reinstatable("healthy", at(5), at(4), replaced=False)


def error(kind: str, message: str) -> dict[str, str]:
    return {"type": kind, "message": f"{kind}: {message}", "traceback": ""}


def test_only_a_failure_that_may_be_waiting_on_a_peer_implicates_one() -> None:
    gloo = (
        "[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:1: Connection reset by peer"
    )
    for exit_code, recorded in [
        (1, error("RuntimeError", gloo)),
        (1, error("RuntimeError", "[unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")),
        (1, error("torch.distributed.DistBackendError", "Watchdog caught collective operation timeout")),
        (1, error("DistNetworkError", "failed to recv, got 0 bytes")),
        (-9, error("Hung", "no commit for 60s")),  # the agent's hang watchdog stopped it
        (1, None),  # no error file (a script without @record): it may be
        (-6, None),  # an abort: NCCL's watchdog
        (134, None),
        (None, None),
    ]:
        assert implicates_a_peer(exit_code, recorded), (exit_code, recorded)
    for exit_code, recorded in [
        (1, error("ValueError", "bad batch")),
        (1, error("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")),
        (1, error("KeyError", "'labels'")),
        (-9, None),  # the OOM killer
        (137, None),
        (-15, None),
        (-2, None),
    ]:
        assert not implicates_a_peer(exit_code, recorded), (exit_code, recorded)


def test_silence_en_masse_needs_a_share_of_the_job_and_at_least_three_machines() -> None:
    assert not mass_silence(2, 4, 0.25), "a group of 2 of 4 (a rack) is believed"
    assert mass_silence(3, 4, 0.25)
    assert not mass_silence(2, 2, 0.25), "never below 3"
    assert not mass_silence(249, 1000, 0.25)
    assert mass_silence(250, 1000, 0.25)
    assert not mass_silence(499, 1000, 0.5) and mass_silence(500, 1000, 0.5)


def test_en_masse_the_grace_declares_nothing_but_a_second_signal_still_does() -> None:
    assert verdict(suspect(), at(60), 10.0, peer_failures=[], operator_says_gone=None, en_masse=True) is None
    why = verdict(suspect(), at(4), 10.0, peer_failures=[at(1)], operator_says_gone=None, en_masse=True)
    assert why is not None and "peers' training processes failed" in why
    why = verdict(suspect(), at(4), 10.0, peer_failures=[], operator_says_gone=True, en_masse=True)
    assert why is not None and "cloud operator" in why


def test_after_a_mass_silence_the_grace_counts_from_its_end() -> None:
    since_long_ago, ended = suspect(last=0, since=3), at(40)
    kept = verdict(
        since_long_ago, at(45), 10.0, peer_failures=[], operator_says_gone=None, believed_since=ended
    )
    assert kept is None
    why = verdict(
        since_long_ago, at(50.5), 10.0, peer_failures=[], operator_says_gone=None, believed_since=ended
    )
    assert why is not None and "suspect for 48s" in why
    # A suspicion after the mass silence ended counts from itself.
    later = suspect(last=41, since=44)
    assert (
        verdict(later, at(53), 10.0, peer_failures=[], operator_says_gone=None, believed_since=ended) is None
    )
    assert verdict(later, at(54.5), 10.0, peer_failures=[], operator_says_gone=None, believed_since=ended)
