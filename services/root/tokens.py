"""Bearer tokens. A worker token names its job, so a request can be checked against the right job without
a lookup table: `castor-job.<job id hex>.<secret>`; the database keeps only the secret's SHA-256."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import uuid
from dataclasses import dataclass

WORKER_TOKEN_PREFIX = "castor-job"


@dataclass(frozen=True)
class WorkerToken:
    job_id: uuid.UUID
    secret: str


def issue_worker_token(job_id: uuid.UUID) -> tuple[str, str]:
    """A new token for `job_id` and the hash to store."""
    secret = secrets.token_urlsafe(32)
    return f"{WORKER_TOKEN_PREFIX}.{job_id.hex}.{secret}", hash_secret(secret)


def parse_worker_token(token: str) -> WorkerToken | None:
    prefix, _, rest = token.partition(".")
    job_hex, _, secret = rest.partition(".")
    if prefix != WORKER_TOKEN_PREFIX or not secret:
        return None
    try:
        return WorkerToken(uuid.UUID(hex=job_hex), secret)
    except ValueError:
        return None


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def same_token(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())
