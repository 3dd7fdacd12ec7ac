"""Benchmark of checkpoint replication between agents; the last line printed is JSON.

    .venv/bin/python benchmarks/replication.py           # 1 GiB checkpoints, 3 repetitions (best)
    .venv/bin/python benchmarks/replication.py --quick   # 64 MiB, 2 repetitions: checks that it runs

* raw_socket_gbps: two processes, plain blocking sockets (sendall of 8 MiB pieces / recv_into a
  preallocated buffer): the loopback limit on this host.
* replicate_gbps: a committed 1 GiB checkpoint in one agent's shared memory pushed over the data plane
  (authenticated, per-stripe checksums verified by the receiver, committed) into another process's replica
  slot: from commit to verified replica.
* peer_fetch_gbps: a replacement machine fetching a 1 GiB checkpoint from a peer into its own store,
  verified as it arrives.
* training_slowdown_pct: a real training loop (MLP with about 150 MB of model and Adam state, about 1 s
  per iteration: the paper's ratio of GPT-2 100B, 9.4 GB of state per 62 s iteration) checkpointed every
  iteration and replicated to one peer agent, against the same loop without checkpoints. The training
  thread computes on one core and the agent (replication, the peer's receive and verification) has the
  other: the shape of a GPU machine, whose host CPUs are free while the GPU computes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker_lib import Checkpointer  # noqa: E402
from worker_lib.agent.dataplane import PeerConnection, data_plane_key  # noqa: E402
from worker_lib.agent.holdings import Holdings  # noqa: E402
from worker_lib.agent.replication import Replicator  # noqa: E402
from worker_lib.store.slots import SlotStore  # noqa: E402

MiB = 1 << 20
JOB, TOKEN = "bench", "castor-job.bench.secret"
PIECE = 8 * MiB

RAW_RECEIVER = """
import socket, sys
size, piece = int(sys.argv[1]), int(sys.argv[2])
buffer = memoryview(bytearray(piece))
with socket.create_server(("127.0.0.1", 0)) as server:
    print(server.getsockname()[1], flush=True)
    connection, _ = server.accept()
    with connection:
        for _ in range(int(sys.argv[3])):
            received = 0
            while received < size:
                received += connection.recv_into(buffer[: min(piece, size - received)])
            connection.sendall(b"k")
"""

DATAPLANE_PEER = """
import sys, time
from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
from worker_lib.agent.holdings import Holdings
holdings, key, job = Holdings(sys.argv[1]), data_plane_key(sys.argv[2]), sys.argv[3]
server = DataPlaneServer(holdings, key, job, host="127.0.0.1").start()
print(server.port, flush=True)
time.sleep(3600)
"""


def spawn(script: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def stop(process: subprocess.Popen[str]) -> None:
    process.kill()
    process.wait()


def raw_socket_gbps(size: int, reps: int) -> float:
    payload = memoryview(bytearray(os.urandom(PIECE)) * (size // PIECE))
    process, port = spawn(RAW_RECEIVER, str(size), str(PIECE), str(reps))
    best = 0.0
    try:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for _ in range(reps):
                start = time.perf_counter()
                for offset in range(0, size, PIECE):
                    sock.sendall(payload[offset : offset + PIECE])
                assert sock.recv(1) == b"k"
                best = max(best, size / (time.perf_counter() - start) / 1e9)
    finally:
        stop(process)
    return best


def make_checkpoint(directory: Path, size: int, iterations: int = 1) -> None:
    tensors = {f"t{i}": torch.randn(size // 4 // 16) for i in range(16)}
    with Checkpointer(directory, blocking=True) as checkpointer:
        for iteration in range(iterations):
            checkpointer.save(iteration, tensors)


def replicate_gbps(scratch: Path, size: int, reps: int) -> float:
    sender = Holdings(scratch / "sender")
    tensors = {f"t{i}": torch.randn(size // 4 // 16) for i in range(16)}
    process, port = spawn(DATAPLANE_PEER, str(scratch / "receiver"), TOKEN, JOB)
    best = 0.0
    try:
        with (
            Checkpointer(sender.directory("local", 0), blocking=True) as checkpointer,
            PeerConnection("127.0.0.1", port, data_plane_key(TOKEN), JOB) as peer,
        ):
            for iteration in range(reps):
                # A new commit every repetition: the peer would refuse a checkpoint it already holds.
                checkpointer.save(iteration, tensors)
                with sender.open_read(0) as (manifest, data):
                    assert manifest.iteration == iteration
                    start = time.perf_counter()
                    outcome = peer.send_put(0, manifest, data)
                    assert outcome == "sent", f"the peer did not take the checkpoint: {outcome}"
                    peer.finish_put()  # the peer verified and committed it
                    seconds = time.perf_counter() - start
                best = max(best, manifest.data_bytes / seconds / 1e9)
    finally:
        stop(process)
        sender.close()
    return best


def peer_fetch_gbps(scratch: Path, size: int, reps: int) -> float:
    peer_root = scratch / "peer"
    make_checkpoint(Holdings(peer_root).directory("replica", 0), size)
    process, port = spawn(DATAPLANE_PEER, str(peer_root), TOKEN, JOB)
    best = 0.0
    destination = SlotStore(scratch / "replacement" / "local" / "rank-0")
    try:
        for _ in range(reps):
            with PeerConnection("127.0.0.1", port, data_plane_key(TOKEN), JOB) as peer:
                start = time.perf_counter()
                manifest = peer.get(0, destination)
                best = max(best, manifest.data_bytes / (time.perf_counter() - start) / 1e9)
    finally:
        stop(process)
        destination.close()
    return best


class Mlp(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.body = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)


def training_slowdown(scratch: Path, width: int, batch: int, iterations: int) -> dict[str, float]:
    """Iteration time with per-iteration checkpoints replicated to one peer agent vs without."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Mlp(width, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs = torch.randn(batch, width)

    def step() -> None:
        loss = model(inputs).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step()  # creates the optimizer state: the checkpoint's full size from the first save
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size()
        for s in optimizer.state_dict()["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )

    scratch.mkdir(parents=True, exist_ok=True)
    process, port = spawn(DATAPLANE_PEER, str(scratch / "peer"), TOKEN, JOB)
    holdings = Holdings(scratch / "machine")
    replicator = Replicator(holdings, data_plane_key(TOKEN), JOB, [1], lambda m: ("127.0.0.1", port)).start()
    # The agent's side of a commit: the Checkpointer announces it with a datagram, the agent replicates.
    notices = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notices.bind(str(scratch / "agent.sock"))
    listener = threading.Thread(target=forward_notices, args=(notices, replicator), daemon=True)
    listener.start()
    os.environ["CASTOR_AGENT_NOTIFY"] = str(scratch / "agent.sock")
    checkpointer = Checkpointer(holdings.directory("local", 0))
    try:
        baseline, with_checkpoints = [], []
        for _ in range(iterations):
            start = time.perf_counter()
            step()
            baseline.append(time.perf_counter() - start)
        for iteration in range(iterations):
            start = time.perf_counter()
            step()  # the optimizer step waits for the previous save's copy (a step pre-hook)
            checkpointer.save(iteration, {"model": model, "optimizer": optimizer})
            with_checkpoints.append(time.perf_counter() - start)
        checkpointer.wait()
        replicated = replicator.flush([0], timeout_s=60)
    finally:
        checkpointer.close()
        del os.environ["CASTOR_AGENT_NOTIFY"]
        notices.close()
        replicator.stop()
        stop(process)
        holdings.close()
    base, ckpt = statistics.median(baseline[1:]), statistics.median(with_checkpoints[1:])
    return {
        "state_mb": state_bytes / 1e6,
        "iteration_s": base,
        "iteration_with_checkpoints_s": ckpt,
        "training_slowdown_pct": 100 * (ckpt - base) / base,
        "replicas_sent": replicator.stats.sent,
        "replicas_skipped": replicator.stats.skipped,
        "replicated_all": replicated,
    }


def forward_notices(notices: socket.socket, replicator: Replicator) -> None:
    while True:
        try:
            notice = json.loads(notices.recv(4096))
        except OSError:
            return
        replicator.notice_commit(int(notice["rank"]), int(notice["iteration"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="64 MiB checkpoints, 2 repetitions, short training"
    )
    args = parser.parse_args()
    size = 64 * MiB if args.quick else 1024 * MiB
    reps = 2 if args.quick else 3  # more than one: every repetition must move the bytes again
    with tempfile.TemporaryDirectory(prefix="castor-bench-", dir="/dev/shm") as scratch_dir:
        scratch = Path(scratch_dir)
        results: dict[str, object] = {"checkpoint_bytes": size, "reps": reps, "statistic": "best"}
        results["raw_socket_gbps"] = raw_socket_gbps(size, reps)
        results["replicate_gbps"] = replicate_gbps(scratch / "replicate", size, reps)
        results["peer_fetch_gbps"] = peer_fetch_gbps(scratch / "fetch", size, reps)
        training = training_slowdown(
            scratch / "training",
            width=512 if args.quick else 2500,
            batch=64 if args.quick else 1024,
            iterations=4 if args.quick else 20,
        )
        results.update(training)
    raw = float(results["raw_socket_gbps"])  # type: ignore[arg-type]
    results["replicate_vs_raw"] = float(results["replicate_gbps"]) / raw  # type: ignore[arg-type]
    results["peer_fetch_vs_raw"] = float(results["peer_fetch_gbps"]) / raw  # type: ignore[arg-type]
    for key, value in results.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
