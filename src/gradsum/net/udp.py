"""UDP sockets as the aggregation services need them: big buffers, clear errors, numeric hosts."""

from __future__ import annotations

import errno
import socket

from ..dataplane.jobspec import Address, SpecError, parse_address

DEFAULT_PORT = 48864  # 0xBEE0, SwitchML's port
SOCKET_BUFFER = 8 << 20  # the kernel caps this at net.core.{r,w}mem_max


class PortInUseError(OSError):
    """The address to bind is taken; the message says which."""


def parse_bind(text: str, flag: str = "--bind") -> Address:
    """``HOST:PORT`` (or ``HOST`` for the default port) -> a numeric address; ValueError names
    the flag."""
    if ":" not in text.strip("[]") or text.endswith("]"):
        text = f"{text}:{DEFAULT_PORT}"
    try:
        return resolve(parse_address(text))
    except (SpecError, OSError) as error:
        raise ValueError(f"{flag} {text!r}: {error}") from None


def resolve(address: Address) -> Address:
    """Numeric (ip, port) as ``recvfrom`` reports sources, so addresses compare exactly."""
    host, port = address
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # prefer IPv4 like our sockets
    return infos[0][4][0], infos[0][4][1]


def open_socket(bind: Address) -> socket.socket:
    family = socket.AF_INET6 if ":" in bind[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    try:
        sock.bind(bind)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise PortInUseError(
                error.errno, f"{bind[0]}:{bind[1]} is already in use (another daemon running?)"
            ) from None
        raise OSError(error.errno, f"cannot bind {bind[0]}:{bind[1]}: {error.strerror}") from None
    sock.setblocking(False)
    return sock


def local_address(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return host, port
