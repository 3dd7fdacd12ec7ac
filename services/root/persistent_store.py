"""The root's access to the persistent tier: deleting checkpoints past the retention limit."""

from __future__ import annotations

import logging

from services.root.flows.machines import persistent_tier
from services.root.settings import Settings
from worker_lib.persistent import object_store
from worker_lib.persistent_keys import job_prefix

log = logging.getLogger(__name__)


async def delete_persisted(settings: Settings, job_id: str, prefixes: list[str]) -> None:
    """Delete `prefixes`, each strictly inside the job's own `<prefix>/<job>` (the store refuses any
    other: the root deletes with its own credentials, for every job)."""
    tier = persistent_tier(settings)
    store, scope = object_store(tier.model_dump()), job_prefix(tier.prefix, job_id)
    for prefix in prefixes:
        try:
            await store.delete(prefix, within=scope)
        except Exception as exc:  # retention is best effort: a leftover object costs storage, not data
            log.warning("could not delete the persisted checkpoint %s: %s", prefix, exc)
