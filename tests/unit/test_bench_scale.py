"""benchmarks/scale.py's own logic, without a root: its flags, what a simulated machine's inventory holds and
which machines a group loss stops (the e2e benchmark test runs its --quick mode against a real root)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("castor_bench_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_defaults_are_the_issues_size_and_the_failure_scenarios_are_opt_in(scale: ModuleType) -> None:
    args = scale.parse_args([])
    assert (args.machines, args.procs, args.steady, args.past_failures) == (1000, 8, 600.0, 100)
    assert (args.interval, args.timeout, args.lease_ttl, args.suspect_grace) == (1.0, 3.0, 1, None)
    assert not (args.etcd or args.group_loss or args.process_exit or args.leader_kill or args.no_loss)

    quick = scale.parse_args(["--quick", "--etcd", "--group-loss", "--process-exit", "--leader-kill"])
    assert (quick.machines, quick.steady, quick.past_failures) == (50, 5.0, 20)
    assert quick.etcd and quick.group_loss and quick.process_exit and quick.leader_kill

    tuned = scale.parse_args(["--machines", "100", "--lease-ttl", "2", "--suspect-grace", "0"])
    assert (tuned.machines, tuned.lease_ttl, tuned.suspect_grace) == (100, 2, 0.0)


def test_an_inventory_holds_the_machines_ranks_and_its_replicas_at_the_failures_iteration(
    scale: ModuleType,
) -> None:
    stats = scale.Stats()
    stats.replicas_of = {3: [2]}
    stats.frozen = 41
    machine = scale.SimulatedMachine(3, client=None, procs=2, interval_s=1.0, stats=stats)
    held = {(h["rank"], h["tier"], h["iteration"]) for h in machine.holdings()}
    assert held == {(6, "local", 41), (7, "local", 41), (4, "replica", 41), (5, "replica", 41)}
    # The same checkpoint has the same digest on every machine holding it (the planner compares them).
    other = scale.SimulatedMachine(2, client=None, procs=2, interval_s=1.0, stats=stats)
    digests = {h["rank"]: h["digest"] for h in other.holdings()}
    assert all(h["digest"] == digests[h["rank"]] for h in machine.holdings() if h["rank"] in digests)

    fresh = scale.SimulatedMachine(3, client=None, procs=2, interval_s=1.0, stats=stats, instance_id="new")
    assert fresh.holdings() == [], "a replacement's memory is empty until it trained"
    fresh.trained = 2
    assert {h["rank"] for h in fresh.holdings()} == {4, 5, 6, 7}


def test_a_group_loss_stops_every_member_of_one_group_never_machine_0s(scale: ModuleType) -> None:
    run: Any = scale.Run(scale.parse_args(["--machines", "6"]), None, "db", [(None, "http://root")])
    run.stats.replicas_of = {0: [1], 1: [0], 2: [3], 3: [2], 4: [5], 5: [4]}
    run.machines = [
        scale.SimulatedMachine(r, client=None, procs=8, interval_s=1.0, stats=run.stats) for r in range(6)
    ]
    assert [m.rank for m in asyncio.run(run.a_group())] == [4, 5]
    run.machines[4].alive = False  # lost before: its group is not whole
    assert [m.rank for m in asyncio.run(run.a_group())] == [2, 3]


def test_a_simulated_agents_requests_fail_over_and_raise_the_roots_answer_as_its_client_does(
    scale: ModuleType,
) -> None:
    """AgentHttp (the simulated machines' client, on aiohttp) keeps worker_lib.client.RootClient's policy:
    a 5xx or a dead replica goes to the next, a 4xx is raised at once with the root's error code, and a
    budget spent is RootUnavailable."""
    from aiohttp import ClientSession, web

    from worker_lib.client import RootRejected, RootUnavailable

    calls: list[str] = []

    async def failing(request: web.Request) -> web.Response:
        calls.append("failing")
        return web.json_response({"error": {"code": "not_leader", "message": "busy"}}, status=503)

    async def answering(request: web.Request) -> web.Response:
        calls.append("answering")
        if request.match_info["rank"] == "9":
            error = {"code": "not_registered", "message": "instance 'x' is not machine 9"}
            return web.json_response({"error": error}, status=409)
        return web.json_response({"received": await request.json()})

    async def serve(handler: Any) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_post("/api/v1/worker/jobs/j/machines/{rank}/progress", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner, f"http://127.0.0.1:{port}"

    async def scenario() -> None:
        (bad, bad_url), (good, good_url) = await serve(failing), await serve(answering)
        async with ClientSession() as session:
            client = scale.AgentHttp([bad_url, good_url], "j", "token", session)
            answer = await client.request("POST", "/machines/1/progress", body={"event": "resumed"})
            assert b'"resumed"' in answer and calls == ["failing", "answering"]
            assert client.current == 1, "the replica that answered is the one asked next"
            with pytest.raises(RootRejected) as rejected:
                await client.request("POST", "/machines/9/progress", body={})
            assert (rejected.value.status, rejected.value.code) == (409, "not_registered")
            assert calls[-1] == "answering", "a 4xx is the root's answer: not retried elsewhere"
            alone = scale.AgentHttp([bad_url], "j", "token", session, retry_for_s=0.0)
            with pytest.raises(RootUnavailable, match="503"):
                await alone.request("POST", "/machines/1/progress", body={})
        await bad.cleanup()
        await good.cleanup()

    asyncio.run(scenario())
