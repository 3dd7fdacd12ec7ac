"""`castor agent --root URL --job ID --token-file PATH [options] -- python train.py ARGS`

The worker token comes from a file (`--token-file`, CASTOR_WORKER_TOKEN_FILE) or the environment
(CASTOR_WORKER_TOKEN), never needs the command line: every user of the host can read a process's
arguments (/proc/<pid>/cmdline, ps). `--token` still works for old launch scripts, with a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

from worker_lib.agent.agent import Agent, AgentConfig
from worker_lib.agent.priority import NICE_ENV, NICE_MAX, REPLICATION_NICE, replication_nice
from worker_lib.agent.replication import aligned_rounds
from worker_lib.agent.watchdog import AUTO_FACTOR, AUTO_FLOOR_S, HangPolicy

# A stopped agent's cleanup takes seconds (training processes' grace period, warm spares, the replication
# threads' joins, up to about 30 s when each waits out its bound): past this the process exits anyway.
EXIT_DEADLINE_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--root",
        default=env("CASTOR_ROOT_URL"),
        help="root service URL(s), comma-separated for several replicas [CASTOR_ROOT_URL]",
    )
    parser.add_argument("--job", default=env("CASTOR_JOB_ID"), help="job id [CASTOR_JOB_ID]")
    parser.add_argument(
        "--token-file",
        type=Path,
        default=env("CASTOR_WORKER_TOKEN_FILE"),
        help="file holding the job's worker token (keep it mode 600) [CASTOR_WORKER_TOKEN_FILE]; "
        "or set CASTOR_WORKER_TOKEN",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="the job's worker token on the command line: discouraged, any user of the host can read it "
        "in the process list; use --token-file or CASTOR_WORKER_TOKEN",
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
        default=env("CASTOR_ADDRESS"),
        help="address peers and training processes (MASTER_ADDR) reach this machine at (default: the local "
        "address this host uses to reach the root) [CASTOR_ADDRESS]",
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
    parser.add_argument(
        "--hang-timeout",
        type=_hang_policy,
        default=env("CASTOR_HANG_TIMEOUT", "auto"),
        help="stop a training process that commits no checkpoint for this many seconds, so the job recovers; "
        f"'auto' (default): {AUTO_FACTOR:g} x its longest gap between commits, at least {AUTO_FLOOR_S:g} s; "
        "0: never [CASTOR_HANG_TIMEOUT]",
    )
    parser.add_argument(
        "--replication-nice",
        type=_nice,
        default=env(NICE_ENV, ""),
        help="run the threads that send and receive replicas this many steps below training's CPU "
        f"priority, 0 to {NICE_MAX}, so training gets the cores first; 0: the same priority "
        f"(default {REPLICATION_NICE}) [{NICE_ENV}]",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the training command")


def _nice(text: str | None) -> int:
    try:
        return replication_nice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _hang_policy(text: str) -> HangPolicy:
    try:
        return HangPolicy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def worker_token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, --token or CASTOR_WORKER_TOKEN (in that order). The variable is then
    removed from this process's environment, so nothing the agent starts inherits it."""
    from_env = os.environ.pop("CASTOR_WORKER_TOKEN", None)
    if args.token_file is not None:
        if args.token is not None:
            raise SystemExit("castor agent: give --token-file or --token, not both")
        try:
            token = str(args.token_file.read_text()).strip()
        except OSError as exc:
            reason = exc.strerror or exc
            raise SystemExit(f"castor agent: cannot read {args.token_file}: {reason}") from None
        if not token:
            raise SystemExit(f"castor agent: the token file {args.token_file} is empty")
        return token
    if args.token is not None:
        print(
            "castor agent: warning: --token shows the worker token to every user of this host (ps, "
            "/proc/<pid>/cmdline); use --token-file or CASTOR_WORKER_TOKEN",
            file=sys.stderr,
            flush=True,
        )
        return str(args.token)
    return from_env or None


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    args.token = worker_token(args)
    missing = [name for name in ("root", "job", "token") if not getattr(args, name)]
    if missing:
        names = {"root": "--root", "job": "--job", "token": "--token-file (or CASTOR_WORKER_TOKEN)"}
        raise SystemExit(f"castor agent: missing {', '.join(names[m] for m in missing)}")
    if not command:
        raise SystemExit("castor agent: give the training command after --, e.g. -- python train.py")
    try:
        aligned_rounds()  # read again by the heartbeats: a bad value stops the agent here, not there
    except ValueError as exc:
        raise SystemExit(f"castor agent: {exc}") from None
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
        hang=args.hang_timeout,
        replication_nice=args.replication_nice,
        exit_deadline_s=EXIT_DEADLINE_S,
    )
    return asyncio.run(Agent(config).run())
