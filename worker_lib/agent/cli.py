"""`castor agent --root URL --job ID --token TOKEN [options] -- python train.py ARGS`"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from pathlib import Path

from worker_lib.agent.agent import Agent, AgentConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--root",
        default=env("CASTOR_ROOT_URL"),
        help="root service URL(s), comma-separated for several replicas [CASTOR_ROOT_URL]",
    )
    parser.add_argument("--job", default=env("CASTOR_JOB_ID"), help="job id [CASTOR_JOB_ID]")
    parser.add_argument(
        "--token", default=env("CASTOR_WORKER_TOKEN"), help="the job's worker token [CASTOR_WORKER_TOKEN]"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="training processes on this machine (must match the job; default: the job's)",
    )
    parser.add_argument(
        "--instance-id",
        default=env("CASTOR_INSTANCE_ID", socket.gethostname()),
        help="this machine's identity, e.g. the EC2 instance id [CASTOR_INSTANCE_ID]",
    )
    parser.add_argument(
        "--address",
        default=env("CASTOR_ADDRESS", "127.0.0.1"),
        help="address peers and training processes reach this machine at [CASTOR_ADDRESS]",
    )
    parser.add_argument("--bind", default=env("CASTOR_BIND", "0.0.0.0"), help="data-plane bind address")
    parser.add_argument(
        "--data-port",
        type=int,
        default=int(env("CASTOR_DATA_PORT", "0")),
        help="data-plane port; 0 picks a free one [CASTOR_DATA_PORT]",
    )
    parser.add_argument("--machine-rank", type=int, default=None, help="ask for this machine rank")
    parser.add_argument(
        "--shm-dir",
        type=Path,
        default=env("CASTOR_AGENT_SHM_DIR"),
        help="shared-memory directory of this machine's checkpoints "
        "(default /dev/shm/castor/<job>/<instance>) [CASTOR_AGENT_SHM_DIR]",
    )
    parser.add_argument(
        "--keep-shm",
        action="store_true",
        default=env("CASTOR_KEEP_SHM") == "1",
        help="keep the checkpoints in shared memory after the job completed [CASTOR_KEEP_SHM=1]",
    )
    parser.add_argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="start training processes cold (no warm interpreters with torch imported)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    missing = [name for name in ("root", "job", "token") if not getattr(args, name)]
    if missing:
        raise SystemExit(f"castor agent: missing {', '.join('--' + m for m in missing)}")
    if not command:
        raise SystemExit("castor agent: give the training command after --, e.g. -- python train.py")
    config = AgentConfig(
        root_urls=args.root.split(","),
        job_id=args.job,
        token=args.token,
        command=command,
        instance_id=args.instance_id,
        address=args.address,
        bind=args.bind,
        data_port=args.data_port,
        machine_rank=args.machine_rank,
        procs_per_machine=args.nproc_per_node,
        shm_root=args.shm_dir,
        keep_shm=args.keep_shm,
        warm_start=args.warm_start,
    )
    return asyncio.run(Agent(config).run())
