"""One machine's directive carries its own ranks' sources and the machines holding its replicas, nothing else
(services.root.domain.directives, services.root.flows.directives.Built)."""

from __future__ import annotations

import pytest

from services.root import schemas
from services.root.domain.directives import JobDirectiveIndex
from services.root.domain.placement import plan_placement
from services.root.errors import Invalid
from services.root.flows.directives import Built

MACHINES, PROCS = 1000, 8


def job_directive(machines: int, procs: int) -> schemas.DirectiveOut:
    """A recovery's directive: every rank restores from a peer, every machine is live."""
    return schemas.DirectiveOut(
        revision=7,
        job_state="recovering",
        status="ready",
        generation=3,
        iteration=120,
        world_size=machines * procs,
        procs_per_machine=procs,
        rendezvous=schemas.Rendezvous(master_addr="10.0.0.1", master_port=29500),
        sources=[
            schemas.PlanSource(
                rank=rank,
                tier="peer",
                source_rank=(rank // procs + 1) % machines,
                address=f"10.0.{(rank // procs + 1) % machines // 256}.{(rank // procs + 1) % 256}",
                data_port=7000,
                digest=f"{rank:064x}",
            )
            for rank in range(machines * procs)
        ],
        machines=[
            schemas.Peer(
                rank=m,
                address=f"10.0.{m // 256}.{m % 256}",
                data_port=7000,
                state="healthy",
                instance_id=f"i-{m}",
            )
            for m in range(machines)
        ],
        persist=None,
    )


@pytest.mark.parametrize("replicas, strategy", [(2, "group"), (3, "ring"), (3, "mixed")])
def test_a_machine_s_directive_holds_only_its_ranks_and_its_group(replicas: int, strategy: str) -> None:
    placement = plan_placement(MACHINES, replicas, strategy)  # type: ignore[arg-type]
    whole = job_directive(MACHINES, PROCS)
    built = Built(0.0, 0, whole, placement)
    whole_bytes = len(built.body(None))
    for machine in (0, 1, 417, MACHINES - 1):
        mine = built.for_machine(machine)
        holders = set(placement.holders(machine))
        if strategy == "group":
            assert holders == set(placement.group_of(machine).members)
        assert mine.machine == machine
        assert [s.rank for s in mine.sources] == list(range(machine * PROCS, (machine + 1) * PROCS))
        assert [s.digest for s in mine.sources] == [
            f"{r:064x}" for r in range(machine * PROCS, (machine + 1) * PROCS)
        ]
        # Itself (is its rank still bound to it?) and every peer its ranks replicate to (the agent's
        # addresses come from here): the group's members, or its successors in a ring, not the ring.
        assert {m.rank for m in mine.machines} == holders == {machine, *placement.sends_to(machine)}
        assert len(mine.machines) == replicas
        # The plan's fields are the job's.
        assert (mine.revision, mine.status, mine.generation, mine.iteration, mine.world_size) == (
            7,
            "ready",
            3,
            120,
            MACHINES * PROCS,
        )
        assert mine.rendezvous == whole.rendezvous
        body = built.body(machine)
        assert schemas.DirectiveOut.model_validate_json(body) == mine
        assert len(body) * 100 < whole_bytes, (len(body), whole_bytes)
    # The whole job's directive is still there for an agent that names no machine.
    assert len(whole.sources) == MACHINES * PROCS and len(whole.machines) == MACHINES


def test_machines_not_live_are_left_out_and_a_machine_out_of_range_is_refused() -> None:
    placement = plan_placement(4, 2, "group")
    whole = job_directive(4, 2)
    whole = whole.model_copy(update={"machines": [m for m in whole.machines if m.rank != 1]})
    built = Built(0.0, 0, whole, placement)
    assert [m.rank for m in built.for_machine(0).machines] == [0]  # its peer, machine 1, is not registered
    with pytest.raises(Invalid):
        built.for_machine(4)


def test_the_index_groups_sources_by_the_machine_running_their_rank() -> None:
    sources = [schemas.PlanSource(rank=r, tier="local") for r in (5, 0, 3, 4, 1, 2)]
    machines = [schemas.Peer(rank=m, address=None, data_port=None, state=None) for m in (2, 0, 1)]
    index = JobDirectiveIndex.of(sources, machines, procs_per_machine=2)
    mine, peers = index.for_machine(1, group=(0, 1))
    assert [s.rank for s in mine] == [2, 3] and [m.rank for m in peers] == [0, 1]
    assert index.for_machine(2, group=()) == ([sources[0], sources[3]][::-1], [machines[0]])
