"""The address a machine advertises to its peers (data plane) and, on machine rank 0, to the training
processes as MASTER_ADDR: by default the local address this host uses to reach the root service.

That is the address of the interface the route to the root leaves by, so it is one the cluster's network
can reach, and it is loopback only when the root itself is on this host. Connecting a UDP socket sends
nothing: the kernel only picks the route and the source address, which getsockname() then reads.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


def address_towards(host: str, port: int = 443) -> str:
    """The local address the kernel would use as the source of a connection to host:port."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return str(probe.getsockname()[0])


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def default_address(root_urls: list[str] | str) -> str:
    """The advertised address when none is configured: the local address towards the first root URL that
    resolves. If none does (no route yet), the address the host name resolves to, and loopback only when the
    roots are themselves on loopback."""
    urls = root_urls.split(",") if isinstance(root_urls, str) else root_urls
    hosts = []
    for url in urls:
        parts = urlsplit(url.strip())
        if not parts.hostname:
            continue
        hosts.append(parts.hostname)
        try:
            return address_towards(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        except OSError as exc:
            log.warning("no route to the root at %s (%s)", url, exc)
    if hosts and all(is_loopback(host) for host in hosts):
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
