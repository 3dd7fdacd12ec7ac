"""What both surfaces of the root's REST API share: the field types that bound request values (strict
counts, text a database can store, small JSON objects) and the models both carry (placement, plan sources,
peers, the persistent tier)."""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field


class WireModel(BaseModel):
    """A model of an answer the agent or the CLI reads (`directive.status`): by attribute, which mypy checks;
    not by key, as a JSON document (`model_dump(mode="json")` gives that, where one is needed)."""


# Numbers that end up in INTEGER / BIGINT columns: larger ones would be refused by the database with a
# server error, so they are refused here, as bad input, with a 422 naming the field.
INT32_MAX = 2**31 - 1


INT64_MAX = 2**63 - 1


INT64_MIN = -(2**63)


# Numbers in request bodies are strict: `true` or "1" is not a count (pydantic's lax mode would take them
# as 1). Only JSON object keys (always strings on the wire) are parsed into integers: CountKey.
Count = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]  # ranks, iterations, generations, counters


CountKey = Annotated[int, Field(ge=0, le=INT32_MAX)]


ByteCount = Annotated[int, Field(strict=True, ge=0, le=INT64_MAX)]


# Durations in seconds (lags, ages, stalls): finite and at most about 31 years, so that sums and rounding of
# them on the root stay finite.
MAX_SECONDS = 1e9


Rate = Annotated[float, Field(strict=True, ge=0, le=MAX_SECONDS, allow_inf_nan=False)]


# A checkpoint frequency (commits per minute). The root divides by it (the iteration time, 60 / rate) and
# multiplies by it (how far the fastest rank runs ahead of a persist announcement), so a finite but absurd
# value (1e21, or 5e-324 whose interval is infinite) would become an iteration beyond the database's
# columns or an infinite time. Nothing real comes near either bound: the agent clamps to the upper one
# (two commits a nanosecond apart), and its rate is over the last minute, so never below one a minute.
MAX_CHECKPOINTS_PER_MINUTE = 1e7


MIN_CHECKPOINTS_PER_MINUTE = 1e-6  # one every two years; 0 (none) is allowed


def _not_vanishing(value: float) -> float:
    if 0 < value < MIN_CHECKPOINTS_PER_MINUTE:
        raise ValueError(f"must be 0 or at least {MIN_CHECKPOINTS_PER_MINUTE:g} checkpoints per minute")
    return value


CheckpointRate = Annotated[
    float,
    Field(strict=True, ge=0, le=MAX_CHECKPOINTS_PER_MINUTE, allow_inf_nan=False),
    AfterValidator(_not_vanishing),
]


Port = Annotated[int, Field(strict=True, ge=1, le=65535)]


# What a free-form JSON field of a request (a progress report's details) may hold: it is stored as is and
# shown by every read of it, so it must stay small, shallow and valid JSON for every database.
MAX_JSON_DEPTH = 8


MAX_JSON_BYTES = 16 * 1024


# Stored JSON is cut at this depth when read (wrappers the root adds around a report's details included),
# so rows written before these limits existed can still be shown.
MAX_READ_DEPTH = 32


# Python strings can hold UTF-16 surrogates that pair with nothing (JSON's "\ud800"); they have no UTF-8
# encoding, so Postgres (and SQLite's driver) cannot store them.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if _SURROGATE.search(value):
        raise ValueError("must not contain lone UTF-16 surrogates (text must be valid UTF-8)")
    return value


# Text stored in the database: Postgres refuses NUL characters in text columns, and every database
# refuses text that has no UTF-8 encoding.
Text = Annotated[str, AfterValidator(_valid_text)]


def _check_json(value: Any, depth: int) -> None:
    if isinstance(value, dict | list):
        if depth >= MAX_JSON_DEPTH:
            raise ValueError(f"must not nest objects and arrays more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, item in value.items():
                _valid_text(key)
                _check_json(item, depth + 1)
        else:
            for item in value:
                _check_json(item, depth + 1)
    elif isinstance(value, str):
        _valid_text(value)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("must not hold integers beyond 64 bits")
    elif isinstance(value, float):
        # json.loads reads NaN and Infinity, and 1e400 as infinity; no database stores them as JSON.
        if not math.isfinite(value):
            raise ValueError("must hold finite numbers only (no NaN, Infinity or numbers beyond a double)")
    else:
        raise ValueError(f"must hold JSON values only, not {type(value).__name__}")


def _bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    _check_json(value, 0)
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
    if size > MAX_JSON_BYTES:
        raise ValueError(f"must not exceed {MAX_JSON_BYTES} bytes as JSON (it has {size})")
    return value


# A free-form JSON object from a client (at most MAX_JSON_DEPTH deep and MAX_JSON_BYTES long).
JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]


def readable_json(value: Any, depth: int = 0) -> Any:
    """Stored JSON as it can always be serialized: cut below MAX_READ_DEPTH, non-finite numbers as null,
    lone surrogates replaced. Reads of rows stored before the request limits existed never fail."""
    if isinstance(value, dict | list):
        if depth >= MAX_READ_DEPTH:
            return "..."
        if isinstance(value, dict):
            return {readable_json(str(k), depth): readable_json(v, depth + 1) for k, v in value.items()}
        return [readable_json(item, depth + 1) for item in value]
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float):
        return value
    return readable_json(str(value), depth)


class PlacementGroupOut(WireModel):
    index: int
    kind: Literal["group", "ring"]
    members: list[int]


class RankPlacement(WireModel):
    rank: int
    holders: list[int] = Field(description="Machines holding this rank's checkpoint, its own first.")
    sends_to: list[int] = Field(description="Peers receiving a replica of this rank's checkpoint.")


class PlacementOut(WireModel):
    strategy: Literal["group", "mixed", "ring"]
    machines: int
    replicas: int
    groups: list[PlacementGroupOut]
    ranks: list[RankPlacement]
    recovery_probability: dict[str, float] = Field(
        description="k -> probability of recovering from CPU memory when k machines fail at once (exact)."
    )


class PlanSource(WireModel):
    rank: int
    tier: Literal["local", "peer", "persistent"]
    source_rank: int | None = Field(None, description="Machine to fetch from (peer tier).")
    address: str | None = None
    data_port: int | None = None
    location: str | None = Field(None, description="Object location (persistent tier).")
    digest: str | None = Field(None, description="Expected content digest of the checkpoint.")


class Peer(WireModel):
    rank: int
    address: str | None
    data_port: int | None
    state: str | None
    instance_id: str | None = Field(
        None, description="The instance bound to this rank (an agent that finds another here was replaced)."
    )


class PersistentTier(WireModel):
    kind: Literal["s3", "local"]
    prefix: str
    bucket: str | None = None
    region: str | None = None
    endpoint_url: str | None = None
    path: str | None = None
