"""The operator commands (`castor jobs ...`, `castor failures ...`, `castor checkpoints export`): each talks
to a running root service over its public REST API with the admin token (services.cli.client). The
parsers are declared in services.cli.main; this module is imported only when one of these commands runs,
so `castor --help` does not pay for httpx. `--json` prints the API's JSON as one document instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from services.cli.checkpoints import checkpoints_export
from services.cli.client import CliClient, CliError, resolve_connection
from services.cli.failures import failures_list, failures_show
from services.cli.jobs import (
    jobs_create,
    jobs_delete,
    jobs_list,
    jobs_show,
    jobs_stop,
    jobs_wait,
)
from services.cli.watch import jobs_watch

COMMANDS: dict[str, Callable[[CliClient, argparse.Namespace], int]] = {
    "jobs_create": jobs_create,
    "jobs_list": jobs_list,
    "jobs_show": jobs_show,
    "jobs_stop": jobs_stop,
    "jobs_delete": jobs_delete,
    "jobs_wait": jobs_wait,
    "jobs_watch": jobs_watch,
    "failures_list": failures_list,
    "failures_show": failures_show,
    "checkpoints_export": checkpoints_export,
}


def run(args: argparse.Namespace) -> int:
    """Run the operator command `args.ops` (a COMMANDS key); expected problems become one line on stderr
    and exit code 1."""
    command = COMMANDS[args.ops]
    try:
        connection = resolve_connection(args.root, args.token)
        with CliClient(connection, timeout=args.request_timeout) as client:
            return command(client, args)
    except CliError as exc:
        print(f"castor: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `castor jobs list | head`: stop quietly, and keep the interpreter from complaining at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
