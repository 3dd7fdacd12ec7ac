"""The `castor` command line: the parser of every command and the handlers of the server-side ones
(serve, demo, db); the operator commands are in services.cli.ops, `castor simulate` in
services.cli.simulate, the agent in worker_lib.agent.cli."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.root.settings import Settings

# The demo's faults (services/demo.py FAULTS) lose machine 2 and then placement group 0 (machines 0 and 1),
# at a quarter, half and three quarters of the run, with a persisted checkpoint every 10 iterations.
MIN_DEMO_MACHINES_WITH_FAULTS = 4
MIN_DEMO_ITERATIONS = 40


def admin_token_notice(settings: Settings) -> str:
    """Where the admin token is, for the start-up banner. The token itself is shown only by the start that
    generates it (the operator has to learn it once); afterwards the banner names the file instead, so
    the token does not end up in every log of the service."""
    if settings.admin_token:
        return "admin token: the one in CASTOR_ADMIN_TOKEN"
    path = (settings.state_dir / "admin-token").resolve()
    existed = path.exists()
    token = settings.resolved_admin_token()
    if existed:
        return f"admin token: in {path}"
    return f"admin token: {token}  (generated now and shown only this once; kept in {path})"


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from services.root.app import create_app
    from services.root.settings import Settings

    overrides = {key: value for key, value in (("host", args.host), ("port", args.port)) if value is not None}
    settings = Settings(**overrides)
    app = create_app(settings)
    print(f"Castor root service on http://{settings.host}:{settings.port}", flush=True)
    print(admin_token_notice(settings), flush=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, access_log=False)
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The embedded one-machine setup: SQLite in the state dir, REST heartbeats, local machines; a training
    job that survives injected failures (see services/demo.py)."""
    import asyncio
    import faulthandler
    import signal

    from services.demo import exit_process, force_stop, serve_demo
    from services.root.settings import Settings

    smallest = MIN_DEMO_MACHINES_WITH_FAULTS if not args.no_faults else 2
    if not args.serve_only and args.machines < smallest:
        print(
            f"castor demo: error: --machines must be at least {smallest}"
            + (" to inject every fault (or add --no-faults)" if not args.no_faults else " (m = 2)"),
            file=sys.stderr,
        )
        return 2
    if not args.serve_only and args.iterations < (MIN_DEMO_ITERATIONS if not args.no_faults else 1):
        print(
            f"castor demo: error: --iterations must be at least {MIN_DEMO_ITERATIONS} to space three faults "
            "(or add --no-faults)",
            file=sys.stderr,
        )
        return 2
    # Flags override CASTOR_HOST / CASTOR_PORT; without them the environment (or the default) decides.
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides, etcd_endpoints=[], cloud="local", s3_bucket=None)
    url = f"http://{settings.host}:{settings.port}"
    print(f"Castor root service (embedded mode) on {url}", flush=True)
    print(f"  database:    {settings.resolved_database_url}", flush=True)
    print(f"  {admin_token_notice(settings)}", flush=True)
    print("  Sign in to the pages with the admin token.", flush=True)
    print("  Ctrl-C stops it.", flush=True)
    if args.serve_only:
        import uvicorn

        from services.root.app import create_app

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning")
        return 0
    # `kill -USR1 <pid>` prints every thread's stack: how to see what a demo that seems stuck is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C (SIGINT) stops the demo even when it was started with SIGINT ignored, as a background job of a
    # non-interactive shell is: asyncio.Runner turns SIGINT into the cancellation the demo's shutdown
    # relies on only where Python's default handler is installed, and an ignored one is inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Not asyncio.run: its teardown cancels leftover tasks and joins the default executor's threads without
    # a deadline, after serve_demo has already stopped everything it started (bounded, with a watchdog).
    runner = asyncio.Runner()
    try:
        code = runner.run(
            serve_demo(settings, args.machines, args.iterations, not args.no_faults, args.exit_when_done)
        )
    except KeyboardInterrupt:  # the first Ctrl-C stops everything; a second one interrupts that
        force_stop()
        code = 0
    exit_process(code)  # everything is stopped: skip the interpreter's slow teardown (see exit_process)


def _agent(args: argparse.Namespace) -> int:
    from worker_lib.agent import cli

    return cli.run(args)


def _db(args: argparse.Namespace) -> int:
    from alembic import command

    from services.root.db import migrate
    from services.root.settings import Settings

    url = Settings().resolved_database_url
    if args.db_command == "upgrade":
        migrate.upgrade(url, args.revision)
    elif args.db_command == "downgrade":
        migrate.downgrade(url, args.revision)
    elif args.db_command == "current":
        command.current(migrate.alembic_config(url), verbose=False)
    elif args.db_command == "revision":
        command.revision(migrate.alembic_config(url), message=args.message, autogenerate=True)
    return 0


def _ops(args: argparse.Namespace) -> int:
    from services.cli import ops

    return ops.run(args)


JOB_STATES = ("pending", "running", "recovering", "failed", "completed", "stopped")


def _connection_options() -> argparse.ArgumentParser:
    """--root, --token and --json, shared by every operator command (on the leaf parsers, so they may
    come after the subcommand: `castor jobs list --json`)."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection")
    group.add_argument(
        "--root",
        metavar="URL",
        help="root service URL [CASTOR_ROOT_URL, default http://127.0.0.1:8080]",
    )
    group.add_argument(
        "--token",
        help="admin token [CASTOR_ADMIN_TOKEN, else $CASTOR_STATE_DIR/admin-token or .castor/admin-token]",
    )
    group.add_argument(
        "--request-timeout", type=float, default=10.0, metavar="S", help="seconds per request (default 10)"
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON (one document)")
    return common


def _add_ops_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _connection_options()

    def leaf(
        group: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        ops: str,
        help: str,
        description: str | None = None,
        epilog: str | None = None,
    ) -> argparse.ArgumentParser:
        sub = group.add_parser(
            name,
            parents=[common],
            help=help,
            description=description or help,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.set_defaults(handler=_ops, ops=ops)
        return sub

    jobs = commands.add_parser(
        "jobs", help="create, list, inspect, wait for, watch, stop and delete jobs (admin token)"
    )
    job_commands = jobs.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")
    create = leaf(
        job_commands,
        "create",
        "jobs_create",
        help="create a job; prints its worker token (shown once) and the agent command",
        description="castor jobs create NAME --machines N [options] [--launch -- COMMAND...]",
        epilog="examples:\n"
        "  castor jobs create gpt-small --machines 4\n"
        "  castor jobs create gpt-small --machines 4 --launch -- python train.py --lr 3e-4\n"
        "options go before --; everything after it is the training command",
    )
    create.add_argument("name", help="unique job name: letters, digits, '.', '_', '-'")
    create.add_argument("--machines", "-n", type=int, required=True, metavar="N", help="number of machines")
    create.add_argument("--replicas", "-m", type=int, default=2, help="checkpoint copies, own included (2)")
    create.add_argument("--procs-per-machine", type=int, default=1, help="training processes per machine (1)")
    create.add_argument(
        "--persist-every",
        type=int,
        default=100,
        metavar="K",
        help="persist every K iterations; 0: never (100)",
    )
    create.add_argument(
        "--keep-persisted", type=int, default=3, metavar="P", help="persisted checkpoints kept (3)"
    )
    create.add_argument(
        "--checkpoint-bytes-max",
        type=int,
        metavar="BYTES",
        help="the most bytes of one rank's checkpoint; agents check /dev/shm for it and refuse larger "
        "replicas (default: an equal share of each agent's shared memory)",
    )
    create.add_argument("--placement", choices=("auto", "group", "mixed", "ring"), default="auto")
    create.add_argument(
        "--replication-policy",
        choices=("interleaved", "eager"),
        default="interleaved",
        help="interleaved: replica traffic only in the idle spans of training's communication (default); "
        "eager: as fast as the link allows",
    )
    create.add_argument(
        "--replication-bandwidth-gbps",
        type=float,
        metavar="GBPS",
        help="cap on each agent's replication traffic in Gbit/s (default: none)",
    )
    create.add_argument(
        "--launch",
        action="store_true",
        help="the root's local cloud operator starts the machines: give the training command after --",
    )
    create.add_argument("--cwd", help="with --launch: working directory of the training (default: here)")
    create.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="with --launch: extra environment"
    )
    create.add_argument(
        "--no-warm-start",
        dest="warm_start",
        action="store_false",
        help="start every training process cold, never from a warm interpreter (agents get --no-warm-start)",
    )
    create.set_defaults(launch_command=[])

    listing = leaf(job_commands, "list", "jobs_list", help="list jobs, newest first")
    listing.add_argument("--state", choices=JOB_STATES, help="only jobs in this state")
    listing.add_argument("--limit", type=int, default=50, help="at most this many (1-500, default 50)")
    listing.add_argument("--offset", type=int, default=0, help="skip this many")

    show = leaf(job_commands, "show", "jobs_show", help="a job, its machines, placement and recent failures")
    show.add_argument("job", metavar="ID_OR_NAME")
    show.add_argument("--history", action="store_true", help="include replaced machines")
    show.add_argument("--failures", type=int, default=5, metavar="N", help="recent failures shown (5)")

    stop = leaf(job_commands, "stop", "jobs_stop", help="stop a job's training for good; its history stays")
    stop.add_argument("job", metavar="ID_OR_NAME")

    delete = leaf(job_commands, "delete", "jobs_delete", help="delete a job and its history")
    delete.add_argument("job", metavar="ID_OR_NAME")
    delete.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")

    wait = leaf(
        job_commands, "wait", "jobs_wait", help="wait until a job reaches a state (progress on a TTY)"
    )
    wait.add_argument("job", metavar="ID_OR_NAME")
    wait.add_argument(
        "--state",
        choices=("running", "completed", "recovering", "failed", "stopped"),
        default="completed",
        help="the state to wait for (default completed); another final state is an error",
    )
    wait.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (default: never)")
    wait.add_argument("--interval", type=float, default=1.0, metavar="S", help="poll every S seconds (1)")
    wait.add_argument("--quiet", "-q", action="store_true", help="no progress line")

    watch = leaf(
        job_commands,
        "watch",
        "jobs_watch",
        help="a live view of a job's machines, replication and recovery until it ends (Ctrl-C to leave)",
        epilog="Exits 0 when the job completes or is stopped, 1 when it fails. Without a terminal it prints\n"
        "a line per state change and the full view once at the end.",
    )
    watch.add_argument("job", metavar="ID_OR_NAME")
    watch.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh every S seconds (1)")

    failures = commands.add_parser(
        "failures", help="failure events of a job and their recovery (admin token)"
    )
    failure_commands = failures.add_subparsers(dest="failures_command", required=True, metavar="COMMAND")
    failures_list = leaf(failure_commands, "list", "failures_list", help="a job's failures, newest first")
    failures_list.add_argument("job", metavar="JOB")
    failures_show = leaf(
        failure_commands, "show", "failures_show", help="phase timings, tier and recovery plan of a failure"
    )
    failures_show.add_argument("job", metavar="JOB")
    failures_show.add_argument("failure_id", type=int, metavar="FAILURE_ID")

    checkpoints = commands.add_parser(
        "checkpoints",
        help="export a job's persisted checkpoints to torch.distributed.checkpoint (admin token)",
    )
    checkpoint_commands = checkpoints.add_subparsers(
        dest="checkpoints_command", required=True, metavar="COMMAND"
    )
    export = leaf(
        checkpoint_commands,
        "export",
        "checkpoints_export",
        help="write a persisted checkpoint as a standard DCP directory (progress bar on a TTY)",
        description="castor checkpoints export JOB [--iteration I] --to DIR",
        epilog="Downloads every rank's shard of the persisted checkpoint (checksums verified) and writes a\n"
        "directory that dcp.load(state, storage_reader=FileSystemReader(DIR)) reads at any world size.\n"
        "Iterations held only in memory are exported from the job itself: worker_lib.export_dcp.\n"
        "examples:\n"
        "  castor checkpoints export gpt-small --iteration 1200 --to /data/gpt-small-1200",
    )
    export.add_argument("job", metavar="JOB")
    export.add_argument("--iteration", type=int, metavar="I", help="default: the newest complete one")
    export.add_argument("--to", required=True, metavar="DIR", help="output directory (new or empty)")
    export.add_argument(
        "--scratch",
        metavar="DIR",
        help="where the shards are downloaded to first, removed afterwards (default: next to --to)",
    )
    export.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="S3 endpoint of the persistent tier [AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL; default AWS]",
    )


def _split_launch_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """`castor jobs create ... --launch -- COMMAND...`: argparse cannot take a positional NAME and a
    trailing command in one subparser, so the command after the first `--` is cut off here."""
    if argv[:2] == ["jobs", "create"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def build_parser(*, agent_arguments: bool = True) -> argparse.ArgumentParser:
    """The whole CLI. agent_arguments=False leaves out the agent's options, whose module imports torch:
    main() asks for them only when the command is `agent`, so that the other commands start fast."""
    parser = argparse.ArgumentParser(prog="castor", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the root service (settings from CASTOR_* variables)")
    serve.add_argument("--host", help="bind address (default: CASTOR_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: CASTOR_PORT or 8080)")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(handler=_serve)

    demo = commands.add_parser("demo", help="run the embedded one-machine demo on 127.0.0.1:8080")
    demo.add_argument("--host", help="bind address (default: CASTOR_HOST or 127.0.0.1)")
    demo.add_argument("--port", type=int, help="port (default: CASTOR_PORT or 8080)")
    demo.add_argument(
        "--machines",
        type=int,
        default=4,
        help=f"local machines (default 4; at least {MIN_DEMO_MACHINES_WITH_FAULTS} for every fault)",
    )
    demo.add_argument(
        "--iterations",
        type=int,
        default=400,
        help=f"training iterations (default 400; at least {MIN_DEMO_ITERATIONS} with faults)",
    )
    demo.add_argument("--no-faults", action="store_true", help="train without injecting failures")
    demo.add_argument("--exit-when-done", action="store_true", help="exit after the summary (for tests)")
    demo.add_argument("--serve-only", action="store_true", help="only the root service, no training job")
    demo.set_defaults(handler=_demo)

    agent = commands.add_parser(
        "agent",
        help="run a machine's worker agent and its training processes",
        description="castor agent --root URL --job ID --token TOKEN -- python train.py ARGS",
    )
    if agent_arguments:
        from worker_lib.agent import cli as agent_cli

        agent_cli.add_arguments(agent)
    agent.set_defaults(handler=_agent)

    _add_ops_commands(commands)

    from services.cli import simulate  # the command's code lives there (no torch, no network)

    simulate.add_parser(commands)

    db = commands.add_parser("db", help="database migrations (database from CASTOR_DATABASE_URL)")
    db_commands = db.add_subparsers(dest="db_command", required=True)
    upgrade = db_commands.add_parser("upgrade", help="migrate to a revision (default: head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    downgrade = db_commands.add_parser("downgrade", help="migrate down to a revision (e.g. base)")
    downgrade.add_argument("revision")
    db_commands.add_parser("current", help="show the database's revision")
    revision = db_commands.add_parser("revision", help="autogenerate a migration from the models")
    revision.add_argument("-m", "--message", required=True)
    db.set_defaults(handler=_db)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    arguments = list(sys.argv[1:] if argv is None else argv)
    arguments, launch_command = _split_launch_command(arguments)
    args = build_parser(agent_arguments=arguments[:1] == ["agent"]).parse_args(arguments)
    if launch_command:
        args.launch_command = launch_command
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)
