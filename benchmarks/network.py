"""Benchmark of replication over an emulated network link (tests/netemu.py); the last line printed is JSON.

    sudo .venv/bin/python benchmarks/network.py           # 512 MiB checkpoints, 1 and 10 Gbit/s NICs
    sudo .venv/bin/python benchmarks/network.py --quick   # 48 MiB, 1 Gbit/s only: checks that it runs

It needs root or CAP_NET_ADMIN (network namespaces, veth pairs, tc); it exits with status 2 saying why
where those are missing. Two machines, each its own network namespace with a NIC limited to the rate in
both directions (tbf), on one bridge:

* link_gbps: raw TCP throughput from one machine to the other on that link, measured in the same run (one
  stream of plain blocking sockets, timed at the receiver): what the emulated NIC carries.
* replicate_gbps: a committed checkpoint in machine 0's shared memory pushed over Castor's data plane
  (worker_lib.agent.dataplane: authenticated, per-stripe checksums verified by the receiver, committed)
  into machine 1's replica slot, from commit to verified replica: the goodput of one replica transfer.
* replicate_vs_link: the ratio of the two (target >= 0.9).

With the 10 Gbit/s rate as well (the default, not --quick) the same figures carry a `_10` suffix; at that
rate this host's CPU (the checksums, Python's copies) may be the bound rather than the link.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import netemu  # noqa: E402

MiB = 1 << 20
JOB, TOKEN = "bench", "castor-job.bench.secret"

DATAPLANE_PEER = """
import sys, time
from worker_lib.agent.dataplane import DataPlaneServer, data_plane_key
from worker_lib.agent.holdings import Holdings
holdings, key, job = Holdings(sys.argv[1]), data_plane_key(sys.argv[2]), sys.argv[3]
server = DataPlaneServer(holdings, key, job, host=sys.argv[4]).start()
print(server.port, flush=True)
time.sleep(3600)
"""

SENDER = """
import json, sys, time
from pathlib import Path
import torch
from worker_lib import Checkpointer
from worker_lib.agent.dataplane import PeerConnection, data_plane_key
from worker_lib.agent.holdings import Holdings
scratch, address, port, size, reps, token, job = sys.argv[1:8]
size, reps = int(size), int(reps)
sender = Holdings(Path(scratch))
tensors = {f"t{i}": torch.randn(size // 4 // 16) for i in range(16)}
best = 0.0
with (
    Checkpointer(sender.directory("local", 0), blocking=True) as checkpointer,
    PeerConnection(address, int(port), data_plane_key(token), job) as peer,
):
    for iteration in range(reps):
        # A new commit every repetition: the peer would refuse a checkpoint it already holds.
        checkpointer.save(iteration, tensors)
        with sender.open_read(0) as (manifest, data):
            start = time.perf_counter()
            outcome = peer.send_put(0, manifest, data)
            assert outcome == "sent", f"the peer did not take the checkpoint: {outcome}"
            peer.finish_put()  # the peer verified and committed it
            seconds = time.perf_counter() - start
        best = max(best, manifest.data_bytes * 8 / seconds / 1e9)
sender.close()
print(json.dumps({"replicate_gbps": best, "checkpoint_bytes": manifest.data_bytes}), flush=True)
"""


def replicate_gbps(emu: netemu.NetEmu, scratch: Path, size: int, reps: int) -> tuple[float, int]:
    sender, receiver = emu.machines[0], emu.machines[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peer = emu.popen(
        receiver,
        [sys.executable, "-c", DATAPLANE_PEER, str(scratch / "receiver"), TOKEN, JOB, receiver.address],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        assert peer.stdout is not None
        port = peer.stdout.readline().strip()
        args = [str(scratch / "sender"), receiver.address, port, str(size), str(reps), TOKEN, JOB]
        result = emu.run(
            sender,
            [sys.executable, "-c", SENDER, *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=600,
        )
        if result.returncode != 0:
            raise RuntimeError(f"the sender failed: {result.stderr[-3000:]}")
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        return float(figures["replicate_gbps"]), int(figures["checkpoint_bytes"])
    finally:
        peer.kill()
        peer.wait()


def measure(rate_gbit: float, size: int, reps: int) -> dict[str, float | int]:
    with (
        netemu.cluster(2, rate_gbit=rate_gbit) as emu,
        tempfile.TemporaryDirectory(prefix="castor-bench-net-", dir="/dev/shm") as scratch,
    ):
        a, b = emu.machines
        link = max(netemu.measure_gbps(emu, a, b, megabytes=size // MiB) for _ in range(reps))
        replicate, data_bytes = replicate_gbps(emu, Path(scratch), size, reps)
    return {
        "link_gbps": link,
        "replicate_gbps": replicate,
        "replicate_vs_link": replicate / link,
        "checkpoint_bytes": data_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="48 MiB checkpoints at 1 Gbit/s only")
    args = parser.parse_args()
    reason = netemu.unavailable()
    if reason:
        print(f"benchmarks/network.py: the emulated cluster cannot run here: {reason}", file=sys.stderr)
        sys.exit(2)
    size = 48 * MiB if args.quick else 512 * MiB
    reps = 2
    results: dict[str, object] = {"rate_gbit": 1.0, "reps": reps, "statistic": "best"}
    results.update(measure(1.0, size, reps))
    if not args.quick:
        results.update({f"{k}_10": v for k, v in measure(10.0, size, reps).items()})
    for key, value in results.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
