"""UDP sockets as the aggregation services need them: big buffers, clear errors, numeric hosts."""

from __future__ import annotations

import errno
import socket

from ..dataplane.jobspec import Address, SpecError, parse_address

DEFAULT_PORT = 48864  # 0xBEE0, SwitchML's port
SOCKET_BUFFER = 32 << 20  # with CAP_NET_ADMIN; otherwise the kernel caps it at net.core.*mem_max
# SO_{SND,RCV}BUFFORCE (socket(7)): a privileged process may exceed net.core.{w,r}mem_max, so a
# switch's receive buffer holds every worker's window rather than 4 MiB of it.
_FORCE = {socket.SO_SNDBUF: 32, socket.SO_RCVBUF: 33}


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
        set_buffer(sock, option, SOCKET_BUFFER)
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


def set_buffer(sock: socket.socket, option: int, nbytes: int) -> int:
    """Ask for an ``nbytes`` socket buffer, beyond ``net.core.*mem_max`` where privileged;
    return what the kernel granted (it doubles the request for bookkeeping)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, _FORCE[option], nbytes)
    except OSError:  # not privileged: capped at net.core.{w,r}mem_max
        sock.setsockopt(socket.SOL_SOCKET, option, nbytes)
    return sock.getsockopt(socket.SOL_SOCKET, option)


def granted_receive_buffer() -> int:
    """The receive buffer ``open_socket`` gets in this process (bytes, as the kernel counts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        return set_buffer(sock, socket.SO_RCVBUF, SOCKET_BUFFER)


def local_address(sock: socket.socket) -> Address:
    host, port = sock.getsockname()[:2]
    return host, port
