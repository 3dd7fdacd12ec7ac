"""Throwaway real services for the test suite: PostgreSQL 15, etcd 3.4 and a moto server (the AWS
endpoint), each on a free loopback port with its own temp directory, stopped by PID afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PG_BIN = Path(os.environ.get("CASTOR_PG_BIN", "/usr/lib/postgresql/15/bin"))
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """A process's user and system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_port(port: int, process: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    """Wait until something listens on 127.0.0.1:port; given the process that should, until it (or one of
    its children) does. A bare connect is not enough there: free_port() only finds a port that was free a
    moment ago, and another test's server that took it meanwhile would pass for ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        if process is not None and _proc_readable(process.pid):
            if _listens(process.pid, port):
                return
        else:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def start_listening(
    command_for: Callable[[list[int]], list[str]], ports: int = 1, timeout: float = 30, **popen: Any
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start a server on `ports` freshly chosen ports (`command_for` builds its command line from them) and
    wait until it listens on the first. A port is free when chosen, not necessarily when the server binds it
    (agents, gloo and clients take ephemeral ports meanwhile): a server that exits before it listens is
    started again on others, twice at most."""
    for attempt in range(3):
        chosen = [free_port() for _ in range(ports)]
        process: subprocess.Popen[bytes] = subprocess.Popen(command_for(chosen), **popen)
        try:
            wait_for_port(chosen[0], process, timeout=timeout)
            return process, chosen
        except RuntimeError:  # it exited: most likely one of its ports was taken
            if attempt == 2:
                raise
        except BaseException:
            stop_process(process)
            raise
    raise AssertionError("unreachable")


def _proc_readable(pid: int) -> bool:
    try:
        os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return True


_TCP_LISTEN = "0A"


def _listens(pid: int, port: int) -> bool:
    """Whether pid or a descendant holds a TCP socket listening on port (read from /proc, in the
    process's own network namespace)."""
    for member in _process_tree(pid):
        with contextlib.suppress(OSError):
            held = set()
            for fd in os.listdir(f"/proc/{member}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{member}/fd/{fd}")
                    if target.startswith("socket:["):
                        held.add(target[len("socket:[") : -1])
            if held & _listening_inodes(member, port):
                return True
    return False


def _listening_inodes(pid: int, port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as rows:
            next(rows, None)  # header
            for row in rows:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == _TCP_LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(inode)
    return inodes


def _process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                # The parent pid is the second field after the parenthesised command name.
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        tree.extend(frontier)
    return tree


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


@dataclass
class Postgres:
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def url_for(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def psql(self, sql: str) -> str:
        result = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-Atc", sql],
            check=True,
            capture_output=True,
            text=True,
        )
        return result.stdout

    def create_database(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url_for(name)


def _as_postgres_user() -> list[str]:
    # initdb and pg_ctl refuse to run as root.
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    directory = Path(tempfile.mkdtemp(prefix="castor-pg."))
    if os.geteuid() == 0:
        shutil.chown(directory, "postgres", "postgres")
    data = directory / "data"
    run = _as_postgres_user()
    started = False
    try:
        subprocess.run(
            [
                *run,
                str(PG_BIN / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        # The port is free when chosen, not necessarily when the server binds it (agents and gloo take
        # ephemeral ports meanwhile): a start that lost it is tried again on another.
        for attempt in range(3):
            port = free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -p {port} -k {directory} -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
            )
            start = subprocess.run(
                [
                    *run,
                    str(PG_BIN / "pg_ctl"),
                    "-D",
                    str(data),
                    "-l",
                    str(directory / "log"),
                    "-w",
                    "-o",
                    options,
                    "start",
                ],
                stdout=subprocess.DEVNULL,
            )
            started = start.returncode == 0
            if started:
                break
            if attempt == 2:
                log = (directory / "log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"Postgres did not start (pg_ctl exit {start.returncode}):\n{log}")
        yield Postgres(port, directory)
    finally:
        if started:
            subprocess.run(
                [*run, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Etcd:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def db_bytes(self) -> tuple[int, int | None]:
        return etcd_db_bytes(self.endpoint)


def etcd_status(endpoint: str) -> dict[str, Any]:
    """`etcdctl endpoint status`: the revision (`header.revision`), the database's sizes, the leader."""
    found = subprocess.run(
        ["etcdctl", f"--endpoints={endpoint}", "endpoint", "status", "-w", "json"],
        check=True,
        capture_output=True,
        text=True,
    )
    status: dict[str, Any] = json.loads(found.stdout)[0]["Status"]
    return status


def etcd_db_bytes(endpoint: str) -> tuple[int, int | None]:
    """etcd's database file size and the part of it in use (bytes; what compaction frees is reused, the
    file itself shrinks only on a defrag)."""
    status = etcd_status(endpoint)
    return int(status["dbSize"]), status.get("dbSizeInUse")


# The history etcd keeps (periodic auto-compaction), as docker-compose.yml runs it but shorter: an hour there.
ETCD_COMPACTION_RETENTION = "1m"


@contextlib.contextmanager
def etcd(compaction_retention: str = ETCD_COMPACTION_RETENTION) -> Iterator[Etcd]:
    directory = Path(tempfile.mkdtemp(prefix="castor-etcd."))

    # Short heartbeat/election so that a 1 s lease TTL is honoured (etcd raises shorter TTLs silently).
    def command(ports: list[int]) -> list[str]:
        client_port, peer_port = ports
        return [
            "etcd",
            "--name",
            "castor-test",
            "--data-dir",
            str(directory / f"data-{client_port}"),  # a start that lost a port leaves its own behind
            "--listen-client-urls",
            f"http://127.0.0.1:{client_port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client_port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer_port}",
            "--initial-cluster",
            f"castor-test=http://127.0.0.1:{peer_port}",
            "--initial-cluster-state",
            "new",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            # Heartbeats and leader refreshes write all the time: without compaction the history grows until
            # the space quota stops every write (and every lease lapses at once). Keep one minute of it.
            "--auto-compaction-mode=periodic",
            f"--auto-compaction-retention={compaction_retention}",
            "--logger",
            "zap",
            "--log-outputs",
            str(directory / "etcd.log"),
        ]

    process: subprocess.Popen[bytes] | None = None
    try:
        process, (client_port, _) = start_listening(
            command, ports=2, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 20
        while (
            subprocess.run(
                ["etcdctl", f"--endpoints=127.0.0.1:{client_port}", "endpoint", "health"], capture_output=True
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("etcd did not become healthy")
            time.sleep(0.1)
        yield Etcd(client_port, process)
    finally:
        if process is not None:
            stop_process(process)
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Moto:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        import httpx

        httpx.post(f"{self.url}/moto-api/reset").raise_for_status()


AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto() -> Iterator[Moto]:
    process, (port,) = start_listening(
        lambda ports: [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(ports[0])],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **AWS_TEST_ENV},
    )
    try:
        yield Moto(port, process)
    finally:
        stop_process(process)
