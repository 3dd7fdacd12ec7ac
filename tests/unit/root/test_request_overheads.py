"""What the root pays per request beyond Castor's own work, kept small for a thousand agents' requests
(docs/figures.md, "Scale"): no route or dependency hops to a worker thread (FastAPI runs a plain `def` on
one: about half of a cached directive's CPU), and the garbage collector's thresholds raised while the root
runs (full collections every 2-3 s at 1,000 machines with Python's defaults)."""

from __future__ import annotations

import gc
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from services.root.app import GC_THRESHOLDS, create_app


def _runs_on_the_loop(call: Any) -> bool:
    # A dependency that is an instance (HTTPBearer) is called through its class's __call__; one that is a
    # class is constructed, which FastAPI does on a worker thread (type.__call__ is no coroutine).
    target = call if inspect.isroutine(call) else type(call).__call__
    return inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target)


def _dependencies(dependant: Dependant) -> Iterator[Any]:
    for sub in dependant.dependencies:
        if sub.call is not None:
            yield sub.call
        yield from _dependencies(sub)


def _api_routes(routes: list[BaseRoute]) -> Iterator[APIRoute]:
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        included = getattr(route, "original_router", None)  # FastAPI keeps an included router whole
        if included is not None:
            yield from _api_routes(included.routes)


@pytest.fixture
def routes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[APIRoute]:
    monkeypatch.setenv("CASTOR_STATE_DIR", str(tmp_path))
    found = list(_api_routes(create_app().routes))
    assert any(route.path.endswith("/directive") for route in found)  # the agents' routes are walked
    return found


def test_every_route_and_dependency_runs_on_the_event_loop(routes: list[APIRoute]) -> None:
    on_threads = [
        f"{route.path}: {getattr(call, '__qualname__', call)}"
        for route in routes
        for call in (route.endpoint, *_dependencies(route.dependant))
        if not _runs_on_the_loop(call)
    ]
    assert not on_threads, f"these run on a worker thread per request: {on_threads}"


def test_the_check_sees_a_plain_function_dependency() -> None:
    def plain() -> None:
        return None

    async def coroutine() -> None:
        return None

    assert not _runs_on_the_loop(plain)
    assert _runs_on_the_loop(coroutine)


@pytest.fixture
def python_gc_thresholds() -> Iterator[tuple[int, int, int]]:
    """Python's own thresholds for the test, whatever an earlier test left; the process's back after."""
    found = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield (700, 10, 10)
    gc.set_threshold(*found)


async def test_the_root_raises_the_gc_thresholds_when_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_gc_thresholds: tuple[int, int, int]
) -> None:
    monkeypatch.setenv("CASTOR_STATE_DIR", str(tmp_path))
    app = create_app()
    assert gc.get_threshold() == python_gc_thresholds
    async with app.router.lifespan_context(app):
        assert gc.get_threshold() == GC_THRESHOLDS
