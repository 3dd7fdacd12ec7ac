"""The root service: `create_app(settings)` builds the FastAPI app (API, status pages, health)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request

from services.root import metrics
from services.root.api import public, worker
from services.root.api.deps import AppState
from services.root.app_info import VERSION as API_VERSION
from services.root.clients import CloudOperator
from services.root.clients.aws import AwsOperator
from services.root.clients.etcd import EtcdCoordinator
from services.root.clients.local import LocalOperator
from services.root.db.database import Database
from services.root.db.migrate import upgrade_async
from services.root.errors import install_error_handlers
from services.root.logs import escape_control_characters
from services.root.middleware import BodyLimitMiddleware, HeadMiddleware
from services.root.orchestration import Orchestrator
from services.root.settings import Settings
from services.root.web import routes as web_routes

log = logging.getLogger(__name__)

# The garbage collector's thresholds while the root runs (see the lifespan): young collections every
# 20,000 net allocations (Python's default: 700), then as Python does.
GC_THRESHOLDS = (20_000, 10, 10)


def cloud_operator(settings: Settings) -> CloudOperator:
    if settings.cloud == "aws":
        if not settings.asg_name:
            raise ValueError("CASTOR_CLOUD=aws needs CASTOR_ASG_NAME")
        return AwsOperator(
            settings.asg_name,
            region=settings.aws_region,
            endpoint_url=settings.aws_endpoint_url,
            use_standby=settings.use_standby,
        )
    root_urls = settings.root_urls or settings.resolved_public_url
    return LocalOperator(
        root_urls,
        settings.state_dir.resolve(),
        settings.local_shm_base,
        max_machines=settings.local_max_machines,
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    escape_control_characters()  # agents' strings (instance ids, causes) reach the service's log lines

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = settings.resolved_database_url
        if settings.migrate_on_start:
            await upgrade_async(url)
        database = Database(url)
        operator = cloud_operator(settings)
        coordinator = (
            EtcdCoordinator(settings.etcd_endpoints, settings.etcd_prefix)
            if settings.etcd_endpoints
            else None
        )
        orchestrator = Orchestrator(database, settings, operator, coordinator)
        app.state.castor = AppState(
            settings=settings,
            database=database,
            admin_token=settings.resolved_admin_token(),
            operator=operator,
            orchestrator=orchestrator,
        )
        # What startup built (torch comes in through worker_lib: some 300,000 objects) never becomes
        # garbage; frozen, it is left out of every later full collection, which would otherwise stop the
        # event loop for most of a second whenever a big request allocates enough to trigger one.
        gc.collect()
        gc.freeze()
        # And collect young objects every 20,000 net allocations instead of 700. A thousand agents' requests
        # in flight keep their objects alive across young collections, which promoted them to the oldest
        # generation and triggered a full collection every 2-3 s at 1,000 machines (0.1-0.3 s each, 8 s of
        # a 2-minute run); with these thresholds, 4 in such a run (docs/figures.md, "Scale").
        # They stay the process's after the app stops: restoring them would need every app the process
        # ran to stop in order (tests run several, and one whose loop closed first never stops).
        gc.set_threshold(*GC_THRESHOLDS)
        background = asyncio.create_task(orchestrator.run(), name="orchestrator")
        try:
            yield
        finally:
            background.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await background
            if coordinator is not None:
                await coordinator.close()
            if isinstance(operator, AwsOperator):
                await operator.close()  # its long-lived Auto Scaling client
            await database.dispose()

    app = FastAPI(
        title="Castor root service",
        version=API_VERSION,
        description=(
            "Control plane of Castor: per-iteration in-memory checkpoints replicated across machines "
            "(GEMINI, SOSP 2023), failure detection and recovery. The public API takes the admin token; "
            "the worker API takes a job's worker token."
        ),
        lifespan=lifespan,
        # Stable operation ids (the route function's name) for generated clients.
        generate_unique_id_function=lambda route: route.name,
        # The documentation's order: the operator's API first, though the agents' routes are matched first.
        openapi_tags=[
            {"name": "jobs", "description": "The public API (admin token): jobs, machines, failures."},
            {"name": "worker", "description": "The worker API (a job's worker token): what agents call."},
            {"name": "health", "description": "Liveness and leadership of this replica."},
        ],
    )
    install_error_handlers(app)
    # The agents' routes first: a router tries its routes in order, and agents send nearly all requests.
    app.include_router(worker.router)
    app.include_router(public.router)
    web_routes.install(app)  # status pages
    app.add_middleware(HeadMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    metrics.install(app)  # /metrics and request latencies (outermost: sees every request as sent)

    @app.get("/healthz", tags=["health"])
    async def healthz(request: Request) -> dict[str, str | bool]:
        """Liveness, and whether this replica is the leader (runs detection and recoveries)."""
        state: AppState = request.app.state.castor
        return {"status": "ok", "leader": state.orchestrator.is_leader}

    return app
