"""The sharding signature that restores compare (worker_lib.sharded.spec_signature): equal exactly when
sharding_difference finds nothing, so a cached match never hides a difference the error would name."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from worker_lib.sharded import ShardingMismatchError, sharding_difference, spec_signature

SAVED: dict[str, Any] = {
    "tensor": 3,
    "mesh": {"device": "cpu", "shape": [2, 2], "dims": ["replicate", "shard"], "ranks": [[0, 1], [2, 3]]},
    "coordinate": [1, 0],
    "placements": [["replicate"], ["shard", 0]],
    "shape": [9, 6],
    "stride": [6, 1],
    "local_shape": [5, 6],
    "offsets": [0, 0],
}

CHANGES: list[tuple[str, Any, str]] = [
    ("mesh.ranks", [[0, 2], [1, 3]], "ranks [[0, 1], [2, 3]] vs [[0, 2], [1, 3]]"),
    ("mesh.dims", ["dp", "shard"], "checkpoint mesh (2, 2) replicate,shard vs this process (2, 2) dp,shard"),
    ("mesh.device", "cuda", "device cpu vs cuda"),
    ("placements", [["replicate"], ["shard", 1]], "placements"),
    ("shape", [10, 6], "global shape [9, 6] vs this process [10, 6]"),
    ("coordinate", [1, 1], "mesh coordinate of this rank [1, 0] vs this process [1, 1]"),
    ("offsets", [5, 0], "shard offsets"),
    ("local_shape", [4, 6], "shard shape"),
]


def changed(field: str, value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(SAVED)
    node = spec
    *parents, last = field.split(".")
    for name in parents:
        node = node[name]
    node[last] = value
    return spec


def test_a_spec_read_back_from_a_manifest_has_the_live_signature() -> None:
    live = changed("tensor", -1)  # the live side has no tensor index
    assert spec_signature(json.loads(json.dumps(SAVED))) == spec_signature(live)
    assert sharding_difference(SAVED, live) is None


@pytest.mark.parametrize(("field", "value", "words"), CHANGES)
def test_every_difference_changes_the_signature_and_is_named(field: str, value: Any, words: str) -> None:
    other = changed(field, value)
    assert spec_signature(other) != spec_signature(SAVED)
    problem = sharding_difference(SAVED, other)
    assert problem is not None and words in problem


def test_the_mismatch_error_is_a_value_error() -> None:
    assert issubclass(ShardingMismatchError, ValueError)
