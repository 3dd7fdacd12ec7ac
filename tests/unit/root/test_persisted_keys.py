"""What the root computes for persisted checkpoints: the ranks a machine runs, locations, expiry prefixes."""

from __future__ import annotations

from services.root.domain.persisted import Tier, checkpoint_location, expired_prefixes, hosted_ranks, shard_of
from worker_lib.persistent_keys import shard_key

JOB = "0b6c7f5e-53a1-4d5e-9f3a-0c1d2e3f4a5b"


def test_a_machine_runs_procs_per_machine_consecutive_ranks() -> None:
    assert list(hosted_ranks(0, 1)) == [0]
    assert list(hosted_ranks(0, 4)) == [0, 1, 2, 3]
    assert list(hosted_ranks(3, 4)) == [12, 13, 14, 15]


def test_keys_and_locations_are_the_ones_the_stores_use() -> None:
    s3 = Tier("s3", "castor", bucket="ckpt")
    local = Tier("local", "castor", path="/var/lib/castor/persistent/")
    assert shard_of(s3, JOB, 20, 3, 2) == shard_key("castor", JOB, 20, 3, 2)
    assert checkpoint_location(s3, JOB, 20) == f"s3://ckpt/castor/{JOB}/iteration-20"
    assert (
        checkpoint_location(local, JOB, 20) == f"file:///var/lib/castor/persistent/castor/{JOB}/iteration-20"
    )


def test_expiry_deletes_each_recorded_rank_of_the_iteration_once() -> None:
    tier = Tier("s3", "castor", bucket="ckpt")
    assert expired_prefixes(tier, JOB, 10, [1, 0, 1]) == [
        f"castor/{JOB}/iteration-10/rank-0",
        f"castor/{JOB}/iteration-10/rank-1",
    ]
