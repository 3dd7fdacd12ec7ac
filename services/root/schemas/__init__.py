"""Wire models of the REST API (requests and responses), one module per surface: `public` (operators and
pages), `worker` (agents) and `shared`. ORM rows never leave the service directly.

The models are defined in worker_lib.api, torch-free, so that the one API client (worker_lib.client) the
agent and the CLI share returns the very models the service validates and documents with; the
service's own additions (a failure's computed recovery time) live here. Every name is re-exported:
`from services.root import schemas; schemas.JobOut`.
"""

from __future__ import annotations

from services.root.schemas.public import *  # noqa: F403
from services.root.schemas.public import __all__ as _public
from services.root.schemas.shared import *  # noqa: F403
from services.root.schemas.shared import __all__ as _shared
from services.root.schemas.worker import *  # noqa: F403
from services.root.schemas.worker import __all__ as _worker

__all__ = [*_shared, *_public, *_worker]
