"""The manifest: everything about a checkpoint except the raw tensor bytes, as JSON (never pickle).

A slot holds `slot-<k>.bin` (the data region) and `slot-<k>.json` (this manifest). The data region is the
concatenation of 64-byte aligned tensor regions; `stripes` cut it into ranges that are copied and hashed
independently, and `digest` (xxh3_64 over the stripe digests) identifies the content, so two copies of a
checkpoint on different tiers can be compared without reading their bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import xxhash

FORMAT = 1
CHECKSUM = "xxh3_64"

JsonValue: TypeAlias = "dict[str, JsonValue] | list[JsonValue] | str | int | float | bool | None"


class UnsupportedManifestError(ValueError):
    """A manifest that decodes but is of a format (or checksum) this code does not read: another version's,
    not damaged."""


@dataclass(frozen=True, slots=True)
class TensorView:
    """How a tensor sits in a region it shares with other tensors (the same storage in the saved state)."""

    storage_offset: int  # in elements of the tensor's dtype, from the start of the region
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the state: its bytes are `nbytes` at `offset` of the data region.

    Without `view` the bytes are the tensor's values in row-major order. With `view`, the region is a span
    of a storage shared by several entries (same `offset`), and the tensor is a strided view into it.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    view: TensorView | None = None
    device: str = "cpu"  # the device type it was saved from; restore puts it back there when it can


@dataclass(frozen=True, slots=True)
class Stripe:
    start: int
    end: int
    digest: str  # xxh3_64 of data[start:end], 16 hex digits


@dataclass(frozen=True)
class Manifest:
    iteration: int
    data_bytes: int
    tensors: tuple[TensorEntry, ...]
    stripes: tuple[Stripe, ...]
    digest: str
    tree: JsonValue = None
    meta: dict[str, JsonValue] = field(default_factory=dict)
    committed_at: float = 0.0
    format: int = FORMAT
    checksum: str = CHECKSUM
    # The tree's JSON text when the writer has it already (see worker_lib.store.tree.tree_json); not part of
    # the manifest's value.
    tree_json: str | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> bytes:
        # It runs at every commit (a few hundred kB for a sharded model of 600 tensors). The tensor entries
        # are the layout's, the same tuple from save to save, so their JSON is kept with them; the rest is
        # built here, without json's cycle check (trees come from the state codec, which refuses cycles):
        # that check took more than half of the encoding time.
        head = _dumps(
            {
                "format": self.format,
                "iteration": self.iteration,
                "committed_at": self.committed_at,
                "meta": self.meta,
                "data_bytes": self.data_bytes,
            }
        )
        tree = self.tree_json if self.tree_json is not None else _dumps(self.tree)
        tail = _dumps(
            {
                "checksum": self.checksum,
                "stripes": [[s.start, s.end, s.digest] for s in self.stripes],
                "digest": self.digest,
            }
        )
        return f'{head[:-1]},"tree":{tree},"tensors":{_entries_json(self.tensors)},{tail[1:]}'.encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Decode a manifest; ValueError when it is not valid JSON or not a format this code reads."""
        try:
            raw = json.loads(data)
            if raw["format"] != FORMAT or raw["checksum"] != CHECKSUM:
                raise UnsupportedManifestError(
                    f"unsupported manifest format {raw['format']!r} / checksum {raw['checksum']!r}"
                )
            return cls(
                format=raw["format"],
                iteration=int(raw["iteration"]),
                committed_at=float(raw["committed_at"]),
                meta=dict(raw["meta"]),
                data_bytes=int(raw["data_bytes"]),
                tree=raw["tree"],
                tensors=tuple(_entry_from_json(item) for item in raw["tensors"]),
                checksum=raw["checksum"],
                stripes=tuple(Stripe(int(s), int(e), str(d)) for s, e, d in raw["stripes"]),
                digest=str(raw["digest"]),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed manifest: {exc!r}") from exc


def content_digest(stripe_digests: Iterable[str]) -> str:
    """The checkpoint's content id: xxh3_64 over the concatenated hex stripe digests."""
    return xxhash.xxh3_64_hexdigest("".join(stripe_digests).encode("ascii"))


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False, check_circular=False)


# The JSON of the last tensor entries encoded, by identity: a steady-state save commits its layout's
# entries again and again. The tuple is held, so its id is not reused while it is cached.
_ENTRIES: list[tuple[tuple[TensorEntry, ...], str]] = []


def _entries_json(entries: tuple[TensorEntry, ...]) -> str:
    for cached, text in _ENTRIES:
        if cached is entries:
            return text
    text = _dumps([_entry_to_json(entry) for entry in entries])
    _ENTRIES.insert(0, (entries, text))
    del _ENTRIES[4:]  # a few: several Checkpointers in one process each keep theirs
    return text


def _entry_to_json(entry: TensorEntry) -> dict[str, Any]:
    out: dict[str, Any] = {
        "key": entry.key,
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "offset": entry.offset,
        "nbytes": entry.nbytes,
    }
    if entry.view is not None:
        out["view"] = {"storage_offset": entry.view.storage_offset, "stride": list(entry.view.stride)}
    if entry.device != "cpu":
        out["device"] = entry.device
    return out


def _entry_from_json(raw: dict[str, Any]) -> TensorEntry:
    view = raw.get("view")
    return TensorEntry(
        key=str(raw["key"]),
        dtype=str(raw["dtype"]),
        shape=tuple(int(n) for n in raw["shape"]),
        offset=int(raw["offset"]),
        nbytes=int(raw["nbytes"]),
        view=None
        if view is None
        else TensorView(int(view["storage_offset"]), tuple(int(n) for n in view["stride"])),
        device=str(raw.get("device", "cpu")),
    )
