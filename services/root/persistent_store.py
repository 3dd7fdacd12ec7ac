"""The root's access to the persistent tier: deleting checkpoints past the retention limit."""

from __future__ import annotations

import logging

from services.root.flows.machines import persistent_tier
from services.root.settings import Settings
from worker_lib.persistent import object_store

log = logging.getLogger(__name__)


async def delete_persisted(settings: Settings, prefixes: list[str]) -> None:
    store = object_store(persistent_tier(settings).model_dump())
    for prefix in prefixes:
        try:
            await store.delete(prefix)
        except Exception as exc:  # retention is best effort: a leftover object costs storage, not data
            log.warning("could not delete the persisted checkpoint %s: %s", prefix, exc)
