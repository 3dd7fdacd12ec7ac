"""Where persisted checkpoints live in the persistent tier: the one key layout, as pure functions.

    <prefix>/<job>/iteration-<I>/rank-<r>/gen-<g>/{data.bin,manifest.json}

The root computes every key itself from (prefix, job, iteration, rank, generation), to record a shard, to
plan a restore from it and to delete it; the agent uses the same function to know where to upload. A key
is never taken from a worker: a worker-named key would let one job point the root's deletes (made with
the root's own credentials) at another job's checkpoints. Standard library only: the root's domain layer
imports this module.
"""

from __future__ import annotations

MAX_KEY_LENGTH = 1000  # PersistedShard.key and PersistedCheckpoint.location are String(1000)


def check_key(key: str) -> str:
    """`key` unchanged if it is a plain relative key: non-empty '/'-separated segments, none of them '.'
    or '..', no leading '/', no backslash or control character. Raises ValueError otherwise.

    S3 itself would store '../x' literally, but the local tier maps keys to paths, and a key that means
    the same thing in both is easier to reason about than one that does not."""
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"persistent-tier key of {len(key)} characters (1..{MAX_KEY_LENGTH} allowed)")
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in key):
        raise ValueError(f"persistent-tier key {key!r} holds a backslash or a control character")
    if any(segment in ("", ".", "..") for segment in key.split("/")):
        raise ValueError(f"persistent-tier key {key!r} is absolute or has an empty, '.' or '..' segment")
    return key


def _join(*segments: str) -> str:
    return check_key("/".join(s for s in segments if s))


def job_prefix(prefix: str, job_id: str) -> str:
    """Everything of one job: `<prefix>/<job>` (the scope of every delete the root makes for that job)."""
    if not job_id or "/" in job_id:
        raise ValueError(f"job id {job_id!r} is not a single key segment")
    return _join(prefix.strip("/"), job_id)


def iteration_prefix(prefix: str, job_id: str, iteration: int) -> str:
    """Every rank's shards of one persisted checkpoint: `<prefix>/<job>/iteration-<I>`."""
    return _join(job_prefix(prefix, job_id), f"iteration-{_count(iteration)}")


def rank_prefix(prefix: str, job_id: str, iteration: int, rank: int) -> str:
    """One rank's shards of one iteration, every generation's: `.../iteration-<I>/rank-<r>`."""
    return _join(iteration_prefix(prefix, job_id, iteration), f"rank-{_count(rank)}")


def shard_key(prefix: str, job_id: str, iteration: int, rank: int, generation: int = 1) -> str:
    """The key of one rank's shard (data.bin and manifest.json below it). The plan generation is part of
    it: after a rollback the same iteration number is another history, and a late upload of the old one
    must not overwrite the new."""
    return _join(rank_prefix(prefix, job_id, iteration, rank), f"gen-{_count(generation)}")


def checkpoint_prefix(key: str) -> str:
    """The prefix of every rank's shards of the checkpoint a shard key belongs to."""
    return key.rsplit("/", 2)[0]


def is_within(key: str, scope: str) -> bool:
    """`key` is a valid key strictly below `scope` (a key equal to its scope is not: deleting it would
    delete the whole scope)."""
    try:
        check_key(key)
        check_key(scope)
    except ValueError:
        return False
    return key.startswith(scope + "/")


def _count(value: int) -> int:
    # bool is an int; a negative number would still make a valid-looking key of another shape
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value
