"""An emulated cluster on one host: each "machine" is a Linux network namespace with one NIC (a veth pair) on
a bridge, rate-limited with `tc`, so that checkpoint and training traffic cross a link slower than memory.

Layout (PREFIX = castor-<pid>-<n>-, all names unique to this process):

    root namespace             PREFIX-br namespace            PREFIX-m<i> namespaces
    cst<pid>h<n> 10.213.S.254 --- br0 --- v<i> (tbf) ---------- eth0 10.213.S.<i+1> (tbf)

The root namespace gets one address on the bridge (`host`); servers the tests start for the machines bind
on it (or are forwarded to it from 127.0.0.1 with `expose`), so nothing listens on a public interface. Each
machine's NIC is limited in both directions (tbf on its eth0 for egress and on the bridge's port towards it
for ingress): a full-duplex NIC of `rate_gbit`. The link to the root namespace is not limited.

Faults are routes inside the namespaces (`prohibit` routes: iptables and nft are often missing, and a route
is enough to cut TCP both ways): `partition_from_root` cuts a machine from the host address (root service,
etcd, Postgres) but not its peers, `partition_from_peers` cuts it from every other machine but not the root,
and `heal` removes both.

Cleanup: `close()` deletes the namespaces (which deletes every veth and the bridge with them); it runs on
leaving the `with` block, at exit (atexit) and on SIGTERM/SIGINT. `sweep()`, run before every new cluster,
deletes leftovers of a killed run: namespaces `castor-<pid>-...` and links `cst<pid>h...` whose pid is dead.

It needs root or CAP_NET_ADMIN; `unavailable()` says why not where `ip netns add` fails.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

PREFIX = "castor-"
_NETNS_NAME = re.compile(r"^castor-(\d+)-")
_HOST_LINK = re.compile(r"^cst(\d+)h\d+(@\S+)?$")
_counter = itertools.count()
_live: list[NetEmu] = []
_handlers_installed = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unavailable() -> str | None:
    """Why this host cannot run the emulated cluster, or None when it can (a namespace and a veth pair can
    be made and `tc` can rate-limit)."""
    for tool in ("ip", "tc"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return (
            f"`ip netns add` fails ({result.stderr.strip()}): the emulated cluster needs root or "
            "CAP_NET_ADMIN (and CAP_SYS_ADMIN for the namespace mounts)"
        )
    try:
        made = _ip(
            "-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb", check=False
        )
        if made.returncode != 0:
            return f"cannot make a veth pair ({made.stderr.strip()})"
        tbf = _run(
            "ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
            "rate", "1gbit", "burst", "128kb", "latency", "20ms", check=False,
        )  # fmt: skip
        if tbf.returncode != 0:
            return f"`tc qdisc add ... tbf` fails ({tbf.stderr.strip()})"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


REQUIRE_VARIABLE = "CASTOR_REQUIRE_NETNS"


def require() -> None:
    """In a test: skip, saying why, where the emulated cluster cannot run here; fail instead where
    CASTOR_REQUIRE_NETNS=1 (./scripts/test sets it, so CI never skips these tests silently)."""
    import pytest

    reason = unavailable()
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"the emulated cluster cannot run here and {REQUIRE_VARIABLE}=1: {reason}")
    pytest.skip(f"emulated cluster unavailable: {reason}")


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay, jitter, loss): many container kernels lack it."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    if _ip("netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        _ip("-n", probe, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb", check=False)
        return (
            _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "netem", "delay",
                 "1ms", check=False).returncode == 0
        )  # fmt: skip
    finally:
        _ip("netns", "del", probe, check=False)


def sweep() -> list[str]:
    """Delete what a killed run left behind: namespaces `castor-<pid>-...` and root-namespace links
    `cst<pid>h...` whose pid is no longer alive. Returns the names removed."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NETNS_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        name = parts[1].strip()
        match = _HOST_LINK.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("link", "del", name.split("@")[0], check=False)
            removed.append(name)
    return removed


def _free_subnet() -> int:
    """A third octet S such that 10.213.S.0/24 is used by nothing in the root namespace."""
    used = (
        _ip("-4", "-o", "addr", "show", check=False).stdout + _ip("-4", "route", "show", check=False).stdout
    )
    start = os.getpid() % 250
    for offset in range(250):
        octet = (start + offset) % 250 + 1
        if f"10.213.{octet}." not in used:
            return octet
    raise RuntimeError("no free 10.213.x.0/24 subnet")


@dataclass
class NetMachine:
    index: int
    netns: str
    address: str
    port_link: str  # the bridge's port towards this machine (in the bridge namespace)

    def exec_prefix(self) -> list[str]:
        """Prepend to a command to run it inside this machine."""
        return ["ip", "netns", "exec", self.netns]

    def env(self) -> dict[str, str]:
        """Variables for processes of this machine: gloo must use the machine's NIC (it would otherwise
        resolve the host name to an address that does not exist inside the namespace)."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}


@dataclass
class NetEmu:
    machines_count: int
    rate_gbit: float | None = 1.0
    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss_pct: float | None = None
    prefix: str = field(init=False)
    host: str = field(init=False)
    machines: list[NetMachine] = field(default_factory=list, init=False)
    bridge_netns: str = field(init=False)
    host_link: str = field(init=False)
    _forwarders: list[_Forwarder] = field(default_factory=list, init=False)
    _closed: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        n = next(_counter)
        self.prefix = f"{PREFIX}{os.getpid()}-{n}-"
        self.bridge_netns = self.prefix + "br"
        self.host_link = f"cst{os.getpid()}h{n}"
        self.subnet = _free_subnet()
        self.host = f"10.213.{self.subnet}.254"

    # -- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> NetEmu:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> NetEmu:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep()
        _install_handlers()
        _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge_netns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        _ip("-n", br, "link", "set", "lo", "up")
        # The root namespace's leg: created in the bridge namespace and its peer moved to the root one, so
        # that deleting the bridge namespace deletes it too.
        _ip(
            "-n",
            br,
            "link",
            "add",
            "hostport",
            "type",
            "veth",
            "peer",
            "name",
            self.host_link,
            "netns",
            str(os.getpid()),
        )
        _ip("-n", br, "link", "set", "hostport", "master", "br0")
        _ip("-n", br, "link", "set", "hostport", "up")
        _ip("addr", "add", f"{self.host}/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        for index in range(self.machines_count):
            netns = f"{self.prefix}m{index}"
            port = f"v{index}"
            _ip("netns", "add", netns)
            _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
            _ip("-n", br, "link", "set", port, "master", "br0")
            _ip("-n", br, "link", "set", port, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            address = f"10.213.{self.subnet}.{index + 1}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            machine = NetMachine(index, netns, address, port)
            self.machines.append(machine)
            self.shape(machine)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for forwarder in self._forwarders:
            forwarder.close()
        for machine in self.machines:
            _ip("netns", "del", machine.netns, check=False)
        _ip("netns", "del", self.bridge_netns, check=False)
        # The host leg goes with the bridge namespace; remove it in case its peer was never moved there.
        if _ip("link", "show", self.host_link, check=False).returncode == 0:
            _ip("link", "del", self.host_link, check=False)
        with contextlib.suppress(ValueError):
            _live.remove(self)

    # -- shaping -----------------------------------------------------------------------------------------

    def shape(self, machine: NetMachine, rate_gbit: float | None = None) -> None:
        """(Re)apply the NIC limit of one machine in both directions: tbf at `rate_gbit` (this cluster's
        rate by default), under netem when a delay, jitter or loss is set."""
        rate = rate_gbit if rate_gbit is not None else self.rate_gbit
        for netns, dev in ((machine.netns, "eth0"), (self.bridge_netns, machine.port_link)):
            _run("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            parent = ["root"]
            if self.delay_ms or self.loss_pct:
                netem = ["netem"]
                if self.delay_ms:
                    netem += ["delay", f"{self.delay_ms}ms"] + (
                        [f"{self.jitter_ms}ms"] if self.jitter_ms else []
                    )
                if self.loss_pct:
                    netem += ["loss", f"{self.loss_pct}%"]
                _run(
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "handle",
                    "1:",
                    *netem,
                )
                parent = ["parent", "1:1"]
            if rate:
                bytes_per_s = rate * 1e9 / 8
                # A bucket of ~2 ms of traffic (at least 128 KiB: one GSO super-packet must fit), and a
                # queue of 20 ms: enough for TCP to fill the link, short enough to keep latency sane.
                burst = max(int(bytes_per_s * 0.002), 128 * 1024)
                _run(
                    "ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf",
                    "rate", f"{int(rate * 1000)}mbit", "burst", str(burst), "latency", "20ms",
                )  # fmt: skip

    # -- faults ------------------------------------------------------------------------------------------

    def partition_from_root(self, machine: NetMachine) -> None:
        """Cut the machine from the root namespace (root service, etcd, Postgres) but not from its peers."""
        _ip("-n", machine.netns, "route", "replace", "prohibit", f"{self.host}/32")

    def partition_from_peers(self, machine: NetMachine) -> None:
        """Cut the machine from every other machine (both ways) but not from the root namespace."""
        for other in self.machines:
            if other is not machine:
                _ip("-n", machine.netns, "route", "replace", "prohibit", f"{other.address}/32")
                _ip("-n", other.netns, "route", "replace", "prohibit", f"{machine.address}/32")

    def heal(self, machine: NetMachine | None = None) -> None:
        """Remove every partition route of `machine` (of every machine by default)."""
        targets = [machine] if machine else self.machines
        for target in targets:
            for other in [*self.machines, None]:
                if other is target:
                    continue
                address = other.address if other else self.host
                _ip("-n", target.netns, "route", "del", "prohibit", f"{address}/32", check=False)
                if other is not None:
                    _ip("-n", other.netns, "route", "del", "prohibit", f"{target.address}/32", check=False)

    # -- processes and servers ---------------------------------------------------------------------------

    def popen(self, machine: NetMachine, command: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        env = {**(kwargs.pop("env", None) or os.environ), **machine.env()}
        return subprocess.Popen([*machine.exec_prefix(), *command], env=env, **kwargs)

    def run(self, machine: NetMachine, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        env = {**(kwargs.pop("env", None) or os.environ), **machine.env()}
        return subprocess.run([*machine.exec_prefix(), *command], env=env, **kwargs)

    def expose(self, port: int) -> int:
        """Make a server that listens on 127.0.0.1:`port` reachable from the machines at host:`port` (a
        TCP forwarder in this process, bound to the host address only). Returns the port."""
        forwarder = _Forwarder((self.host, port), ("127.0.0.1", port))
        self._forwarders.append(forwarder)
        return port


class _Forwarder:
    """host:port -> 127.0.0.1:port, one thread per direction per connection (control-plane traffic only)."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.target = target
        self.server = socket.create_server(listen)
        self.server.settimeout(0.5)
        self.closed = False
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _close_all() -> None:
    for emu in list(_live):
        emu.close()


def _install_handlers() -> None:
    """Close every live cluster at exit and on SIGTERM/SIGINT (then behave as the previous handler would)."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed = True
    atexit.register(_close_all)
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: FrameType | None, previous: Any = previous) -> None:
            _close_all()
            if callable(previous):
                previous(sig, frame)
            elif previous == signal.SIG_IGN:
                return
            else:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        signal.signal(signum, handler)


@contextlib.contextmanager
def cluster(machines: int, rate_gbit: float | None = 1.0, **options: Any) -> Iterator[NetEmu]:
    emu = NetEmu(machines, rate_gbit, **options)
    with emu:
        yield emu


# -- throughput (iperf-like) ---------------------------------------------------------------------------------

_SINK = r"""
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
buf = bytearray(1 << 20)
view = memoryview(buf)
total, first, last = 0, None, None
while True:
    n = conn.recv_into(view)
    if not n:
        break
    now = time.monotonic()
    if first is None:
        first = now
    total += n
    last = now
print(total, (last or 0) - (first or 0), flush=True)
"""

_SOURCE = r"""
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[3])):
    sock.sendall(chunk)
sock.close()
"""


def measure_gbps(emu: NetEmu, sender: NetMachine, receiver: NetMachine, megabytes: int = 64) -> float:
    """Raw TCP goodput from `sender` to `receiver` in Gbit/s: one stream of `megabytes` MiB, timed at the
    receiver from its first to its last byte."""
    python = os.environ.get("CASTOR_PYTHON") or _python()
    sink = emu.popen(receiver, [python, "-c", _SINK, receiver.address], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port = int(sink.stdout.readline())
        emu.run(
            sender,
            [python, "-c", _SOURCE, receiver.address, str(port), str(megabytes)],
            check=True,
            timeout=120,
        )
        total, seconds = sink.stdout.readline().split()
        sink.wait(30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    return int(total) * 8 / max(float(seconds), 1e-9) / 1e9


def _python() -> str:
    import sys

    return sys.executable


def can_connect(emu: NetEmu, source: NetMachine, address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection from inside `source` to address:port is accepted (a refusal from a live host
    counts as reachable: the network let it through)."""
    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(({address!r}, {port}), timeout={timeout_s}).close()\n"
        "except ConnectionRefusedError:\n"
        "    pass\n"
        "except OSError:\n"
        "    sys.exit(1)\n"
    )
    return (
        emu.run(source, [_python(), "-c", code], capture_output=True, timeout=timeout_s + 30).returncode == 0
    )


def wait_gone(netns_prefix: str, timeout_s: float = 5.0) -> bool:
    """Whether no namespace with this prefix remains (deletion is synchronous, this only double-checks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if netns_prefix not in _ip("netns", "list", check=False).stdout:
            return True
        time.sleep(0.1)
    return False
