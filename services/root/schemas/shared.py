"""What both API surfaces share: the field types bounding request values and the models both carry. They are
defined in worker_lib.api.shared (the clients share them); the service reads them from here."""

from __future__ import annotations

from worker_lib.api.shared import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_READ_DEPTH,
    ByteCount,
    Count,
    CountKey,
    JsonObject,
    Peer,
    PersistentTier,
    PlacementGroupOut,
    PlacementOut,
    PlanSource,
    Port,
    RankPlacement,
    Rate,
    Text,
    readable_json,
)

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_READ_DEPTH",
    "ByteCount",
    "Count",
    "CountKey",
    "JsonObject",
    "Peer",
    "PersistentTier",
    "PlacementGroupOut",
    "PlacementOut",
    "PlanSource",
    "Port",
    "RankPlacement",
    "Rate",
    "Text",
    "readable_json",
]
