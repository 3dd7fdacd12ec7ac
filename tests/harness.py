"""Throwaway real services for the test suite: PostgreSQL 15, etcd 3.4 and a moto server (the AWS
endpoint), each on a free loopback port with its own temp directory, stopped by PID afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PG_BIN = Path(os.environ.get("CASTOR_PG_BIN", "/usr/lib/postgresql/15/bin"))
VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


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
    port = free_port()
    data = directory / "data"
    run = _as_postgres_user()
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
    options = (
        f"-c listen_addresses=127.0.0.1 -p {port} -k {directory} -c fsync=off "
        "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
    )
    subprocess.run(
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
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield Postgres(port, directory)
    finally:
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


@contextlib.contextmanager
def etcd() -> Iterator[Etcd]:
    directory = Path(tempfile.mkdtemp(prefix="castor-etcd."))
    client_port, peer_port = free_port(), free_port()
    # Short heartbeat/election so that a 1 s lease TTL is honoured (etcd raises shorter TTLs silently).
    process = subprocess.Popen(
        [
            "etcd",
            "--name",
            "castor-test",
            "--data-dir",
            str(directory / "data"),
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
            "--auto-compaction-retention=1m",
            "--logger",
            "zap",
            "--log-outputs",
            str(directory / "etcd.log"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(client_port, process)
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
    port = free_port()
    process = subprocess.Popen(
        [str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **AWS_TEST_ENV},
    )
    try:
        wait_for_port(port, process)
        yield Moto(port, process)
    finally:
        stop_process(process)
