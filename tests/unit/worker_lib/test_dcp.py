"""torch.distributed.checkpoint through Castor: dcp.save / dcp.async_save into the memory tier, dcp.load
back bit-exact in new processes, and an export that plain dcp.load reads at another world size.

Two real processes over gloo (torch.multiprocessing, forkserver) train an FSDP2 model (DTensor parameters
and AdamW states) beside plain replicated tensors and a non-tensor value, and save through CastorWriter;
they are killed (SIGKILL), and two new processes (a restarted job) load through CastorReader and export.
The test process then loads each export alone (world size 1) with FileSystemReader into an unsharded model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from tests.unit.worker_lib.helpers import forkserver
from worker_lib import Checkpointer
from worker_lib.dcp import CastorReader, CastorWriter
from worker_lib.errors import CheckpointError
from worker_lib.export import export_dcp, export_shards
from worker_lib.store.slots import SlotStore

WORLD = 2


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 9)  # 9 rows: uneven FSDP2 shards
        self.b = nn.Linear(9, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.scale


class App(Stateful):
    """The torchtitan-style wrapper: model and optimizer through DCP's state_dict helpers."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def build(seed: int, mesh: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step)
        model(torch.randn(5, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def flat(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state by dotted path; DTensors as their local shard, or whole (`full`)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, DTensor):
            out[path] = value.to_local().detach().clone()
            out[path + ":full"] = value.full_tensor().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[path] = value.detach().clone()
        else:
            out.update(flat(value, path + "."))
    return out


def bit_differences(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> list[str]:
    if expected.keys() != actual.keys():
        return [f"keys differ: {sorted(expected.keys() ^ actual.keys())}"]
    return [
        key
        for key in expected
        if (expected[key].dtype, expected[key].shape) != (actual[key].dtype, actual[key].shape)
        or not torch.equal(
            expected[key].reshape(-1).view(torch.uint8), actual[key].reshape(-1).view(torch.uint8)
        )
    ]


def rank_main(rank: int, phase: str, port: int, root: str) -> None:
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    out = Path(root) / f"{phase}-{rank}.json"
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        result = (save_phase if phase == "save" else load_phase)(rank, mesh, Path(root))
        out.write_text(json.dumps(result))
        dist.barrier()  # every rank's result written, every checkpoint committed
        if phase == "save":
            os.kill(os.getpid(), signal.SIGKILL)  # the job dies as a kill -9 leaves it: no teardown at all
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))
    finally:
        out.with_suffix(".done").touch()
        os._exit(0)  # never release the gloo group at exit (torch 2.13 can deadlock there, see README)


def save_phase(rank: int, mesh: Any, root: Path) -> dict[str, Any]:
    model, optimizer = build(0, mesh)
    plain = {
        "table": torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1),
        "ids": torch.arange(5),
    }
    with Checkpointer(root / f"rank-{rank}") as checkpointer:
        train(model, optimizer, 2)
        state = {"app": App(model, optimizer), "plain": plain, "step": 2}
        dcp.save(state, storage_writer=CastorWriter(checkpointer, iteration=2))
        checkpointer.wait()
        train(model, optimizer, 1)
        state["step"] = 3
        # async_save: DCP stages a copy, then saves on its own thread; the checkpoint_id names the iteration.
        dcp.async_save(state, storage_writer=CastorWriter(checkpointer), checkpoint_id="step-3").result()
        checkpointer.wait()
        expected = flat(App(model, optimizer).state_dict()) | flat(plain, "plain.")
        torch.save(expected, root / f"expected-{rank}.pt")
    # The same state saved the Castor way (DTensor shards with their placement), for the offline export.
    with Checkpointer(root / f"native-{rank}") as checkpointer:
        checkpointer.save(3, {"model": model, "optimizer": optimizer, "step": 3})
        checkpointer.wait()
        native = flat({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        torch.save(native, root / f"native-{rank}.pt")
    with Checkpointer(root / f"rank-{rank}") as checkpointer:
        return {"committed": [m.iteration for m in checkpointer._store.committed()]}


def load_phase(rank: int, mesh: Any, root: Path) -> dict[str, Any]:
    # A restarted job: new processes, a model initialised differently, an optimizer without state.
    model, optimizer = build(7, mesh)
    plain = {"table": torch.zeros(3, 4, dtype=torch.float64), "ids": torch.zeros(5, dtype=torch.int64)}
    state = {"app": App(model, optimizer), "plain": plain, "step": -1}
    expected = torch.load(root / f"expected-{rank}.pt")
    with Checkpointer(root / f"rank-{rank}") as checkpointer:
        reader = CastorReader(checkpointer)
        selected = reader.select()
        dcp.load(state, storage_reader=reader)
        differences = bit_differences(
            expected, flat(App(model, optimizer).state_dict()) | flat(plain, "plain.")
        )
        # Training goes on: the loaded optimizer steps like the saved one would.
        train(model, optimizer, 1)
        export_dcp(checkpointer, root / "exported")
    # An export that one rank cannot do (it holds no iteration 3 here): every rank must fail, at once.
    with Checkpointer(root / f"{'rank' if rank == 0 else 'empty'}-{rank}") as checkpointer:
        try:
            export_dcp(checkpointer, root / "refused", iteration=3)
            refused = None
        except CheckpointError as exc:
            refused = str(exc)
    # A rank whose last save failed (as one running out of shared memory would): every rank hears of it.
    with Checkpointer(root / f"rank-{rank}") as checkpointer:
        if rank == 1:
            failed: Future[None] = Future()
            failed.set_exception(CheckpointError("the last save failed (simulated)"))
            checkpointer._pending = failed
        try:
            dcp.load(state, storage_reader=CastorReader(checkpointer))
            after_failure = None
        except CheckpointException as exc:
            after_failure = str(exc)
    return {
        "selected": selected,
        "step": state["step"],
        "differences": differences,
        "refused": refused,
        "after_failure": after_failure,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_phase(phase: str, root: Path) -> list[dict[str, Any]]:
    forkserver()  # children forked from a server with torch imported: ~50 ms to start, not seconds
    context = mp.start_processes(
        rank_main, args=(phase, free_port(), str(root)), nprocs=WORLD, join=False, start_method="forkserver"
    )
    assert context is not None
    deadline = time.monotonic() + 600
    try:
        while not context.join(timeout=5):
            assert time.monotonic() < deadline, f"{phase}: the ranks did not finish within 600 s"
    except mp.ProcessExitedException as exc:
        if not (phase == "save" and exc.signal_name == "SIGKILL"):
            raise
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [json.loads((root / f"{phase}-{rank}.json").read_text()) for rank in range(WORLD)]
    for result in results:
        assert "error" not in result, result["error"]
    return results


@pytest.fixture(scope="module")
def job() -> Iterator[tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]]:
    root = Path(tempfile.mkdtemp(prefix="castor-dcp-", dir="/dev/shm"))
    try:
        saved = run_phase("save", root)
        loaded = run_phase("load", root)
        yield root, saved, loaded
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_dcp_save_and_async_save_commit_castor_checkpoints(job: Any) -> None:
    _, saved, _ = job
    assert [result["committed"] for result in saved] == [[3, 2], [3, 2]]


def test_dcp_load_in_new_processes_is_bit_exact(job: Any) -> None:
    _, _, loaded = job
    for result in loaded:
        assert result["selected"] == 3
        assert result["step"] == 3
        assert result["differences"] == []


def test_an_export_one_rank_cannot_do_fails_on_every_rank(job: Any) -> None:
    """Before, the rank without the iteration raised while the others had entered dcp.save's collectives:
    they waited there until the process group's timeout (30 minutes by default)."""
    _, _, loaded = job
    assert (
        "rank 1 cannot export" in loaded[0]["refused"]
        and "no checkpoint of iteration 3" in loaded[0]["refused"]
    )
    assert "no checkpoint of iteration 3" in loaded[1]["refused"]


def test_a_load_after_one_ranks_save_failed_fails_on_every_rank(job: Any) -> None:
    """Before, the reader waited for the failed save on that rank only after the ranks had agreed on the
    iteration: it raised before the agreement, and the others waited in it until the group's timeout."""
    _, _, loaded = job
    for result in loaded:
        assert "the last save failed (simulated)" in result["after_failure"]


def whole(expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's expectations with every sharded tensor as the whole tensor."""
    return {k: expected.get(f"{k}:full", v) for k, v in expected.items() if not k.endswith(":full")}


def load_alone(directory: Path, state: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(directory)))


def check_dcp_export(root: Path, directory: Path) -> None:
    """The export of the CastorWriter checkpoint (iteration 3) loads alone into an unsharded model."""
    expected = whole(torch.load(root / "expected-0.pt"))
    model, optimizer = build(11)
    train(model, optimizer, 1)  # optimizer states exist, with other values
    plain = {"table": torch.zeros(3, 4, dtype=torch.float64), "ids": torch.zeros(5, dtype=torch.int64)}
    state = {"app": App(model, optimizer), "plain": plain, "step": -1}
    load_alone(directory, state)
    wanted = {key: value for key, value in expected.items() if not key.startswith("plain.")}
    assert any(key.endswith(":full") for key in torch.load(root / "expected-0.pt")), "sharded tensors"
    assert bit_differences(wanted, flat(App(model, optimizer).state_dict())) == []
    # Plain tensors count as replicated in DCP: the export holds one rank's copy (rank 1 saved 2x).
    assert torch.equal(plain["ids"], torch.arange(5))
    assert plain["table"].tolist() in (
        (torch.arange(12, dtype=torch.float64).reshape(3, 4) * k).tolist() for k in (1, 2)
    )
    assert state["step"] == 3


def export_offline(root: Path, prefix: str, directory: Path) -> list[tuple[int, int]]:
    """Every rank's store read by this one process (as the CLI does after downloading them)."""
    progress: list[tuple[int, int]] = []
    with contextlib.ExitStack() as stack:
        shards = [
            stack.enter_context(SlotStore(root / f"{prefix}-{rank}").open_read(3)) for rank in range(WORLD)
        ]
        export_shards(shards, directory, progress=lambda done, total: progress.append((done, total)))
    return progress


def test_export_loads_with_plain_filesystem_reader_at_world_size_one(job: Any) -> None:
    root, _, _ = job
    check_dcp_export(root, root / "exported")


def test_offline_export_of_every_rank_loads_at_world_size_one(job: Any) -> None:
    root, _, _ = job
    progress = export_offline(root, "rank", root / "offline")
    check_dcp_export(root, root / "offline")
    assert progress[-1][0] == progress[-1][1] > 0


def test_offline_export_of_fsdp2_checkpointer_saves(job: Any) -> None:
    root, _, _ = job
    export_offline(root, "native", root / "native-export")
    expected = whole(torch.load(root / "native-0.pt"))
    model, optimizer = build(11)
    train(model, optimizer, 1)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": -1}
    load_alone(root / "native-export", state)
    optimizer.load_state_dict(state["optimizer"])
    actual = flat({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert bit_differences(expected, actual) == []
    assert state["step"] == 3


def test_castor_reader_refuses_another_world_size_and_points_to_the_export(job: Any) -> None:
    root, _, _ = job
    model, optimizer = build(11)
    train(model, optimizer, 1)
    state = {"app": App(model, optimizer), "plain": {}, "step": -1}
    with Checkpointer(root / "rank-0") as checkpointer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as raised:
            dcp.load(state, storage_reader=CastorReader(checkpointer))
    ((failure, _),) = raised.value.failures.values()  # (exception, traceback) per failed rank
    assert isinstance(failure, CheckpointError)
    assert "another rank saved" in str(failure) and "export" in str(failure)


def test_export_of_a_plain_checkpointer_save(tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="castor-dcp-", dir="/dev/shm"))
    try:
        model, optimizer = build(3)
        train(model, optimizer, 2)
        expected = {key: value.clone() for key, value in model.state_dict().items()}
        with Checkpointer(directory) as checkpointer:
            # A tuple of tensors is one value to DCP (pickled whole): before, the export pickled the
            # placeholders of its tensors instead of them.
            rng = (torch.arange(3.0), [torch.tensor([7]), "seed"])
            checkpointer.save(5, {"model": model, "optimizer": optimizer, "epoch": 4, "rng": rng})
            checkpointer.wait()
            export_dcp(checkpointer, tmp_path / "out")
        fresh, _ = build(9)
        state = {"model": fresh.state_dict(), "epoch": 0, "rng": None}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(tmp_path / "out")))
        assert bit_differences(expected, fresh.state_dict()) == []
        assert state["epoch"] == 4
        loaded = state["rng"]
        assert isinstance(loaded, tuple) and torch.equal(loaded[0], rng[0])
        assert torch.equal(loaded[1][0], rng[1][0]) and loaded[1][1] == "seed"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_an_export_that_fails_midway_leaves_no_earlier_exports_metadata(tmp_path: Path) -> None:
    """Re-exporting into a directory: before, DCP rewrote the rank files and only then .metadata, so an
    export that failed midway left the earlier export's metadata over a mix of both, and a plain dcp.load
    read it without complaint."""
    directory = Path(tempfile.mkdtemp(prefix="castor-dcp-", dir="/dev/shm"))
    try:
        model, optimizer = build(3)
        with Checkpointer(directory) as checkpointer:
            for iteration in (1, 2):
                train(model, optimizer, 1)
                checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
                checkpointer.wait()
            export_dcp(checkpointer, tmp_path / "out", iteration=1)
            assert (tmp_path / "out" / ".metadata").exists()

            def interrupted(done: int, total: int) -> None:
                if done > 0:
                    raise OSError(28, "No space left on device")  # DCP reports it as CheckpointException

            with pytest.raises(CheckpointException, match="No space left"):
                export_dcp(checkpointer, tmp_path / "out", iteration=2, progress=interrupted)
        assert not (tmp_path / "out" / ".metadata").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
