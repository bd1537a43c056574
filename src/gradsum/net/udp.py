"""UDP sockets as the aggregation services need them: big buffers, clear errors, numeric hosts."""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import sys
import zlib

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
    enable_multicast(sock, bind)
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


# -- multicast results ----------------------------------------------------------------------------
# A switch multicasts each completed slot: one send that the network (a bridge, or the kernel's
# loopback) replicates to every worker, as a hardware switch's multicast engine does, instead of
# n unicast copies. Workers receive results on a second socket bound to the job's group.


def multicast_group(aggregator: Address, job: int) -> Address:
    """The group a job's results are multicast to: derived from the aggregator's address and the
    job id, which every worker knows, so no worker has to be told. 239/8 is administratively
    scoped (RFC 2365); a collision between two jobs only costs copies (workers check the source
    and job of every packet)."""
    host, port = aggregator
    octets = zlib.crc32(f"{host}:{port}/{job}".encode()).to_bytes(4, "little")[:3]
    return f"239.{octets[0]}.{octets[1]}.{octets[2]}", port


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def enable_multicast(sock: socket.socket, bind: Address) -> None:
    """Let an aggregator's socket send to groups: out of its bound interface, looped back to
    listeners on this host, and never beyond the first hop (a loopback socket's datagrams, TTL 0,
    never leave the host at all)."""
    if sock.family != socket.AF_INET:
        return
    host = bind[0]
    if host not in ("", "0.0.0.0"):
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(host))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 0 if is_loopback(host) else 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)


def open_group_socket(group: Address, interface: str) -> socket.socket:
    """A socket that receives what is sent to ``group`` on the interface holding ``interface``
    (an address of this host; "0.0.0.0": the kernel's choice)."""
    host, port = group
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # all local workers bind it
        set_buffer(sock, socket.SO_RCVBUF, SOCKET_BUFFER)
        sock.bind((host, port))
        local = interface if interface not in ("", "::") else "0.0.0.0"
        request = struct.pack("4s4s", socket.inet_aton(host), socket.inet_aton(local))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, request)
    except OSError as error:
        sock.close()
        raise OSError(
            error.errno,
            f"cannot join multicast group {host}:{port} on {interface}: {error.strerror} "
            "(run the workers without multicast results)",
        ) from None
    sock.setblocking(False)
    return sock


UDP_GRO = 104  # linux/udp.h (Linux 5.0): join a sender's datagrams into one read
_GRO_CONTROL = socket.CMSG_SPACE(4)


def enable_gro(sock: socket.socket) -> bool:
    """Let one read return several datagrams of one sender (see ``receive_datagrams``): a
    chunk sent as one GSO message (``net/_pump.c``) then arrives as it left, instead of being
    cut into datagrams by the receiving kernel. False where the kernel has no UDP_GRO."""
    try:
        sock.setsockopt(socket.SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    return True


def receive_datagrams(sock: socket.socket, buffer: bytearray) -> tuple[list[slice], Address]:
    """Read into ``buffer``; return the datagram slices of it (several when UDP_GRO joined
    them: all of one size but the last) and their source."""
    size, control, _, source = sock.recvmsg_into([buffer], _GRO_CONTROL)
    segment = size
    for level, kind, data in control:
        if level == socket.SOL_UDP and kind == UDP_GRO and len(data) >= 4:
            segment = int.from_bytes(data[:4], sys.byteorder) or size
    if segment >= size:
        return [slice(0, size)], source
    return [slice(at, min(at + segment, size)) for at in range(0, size, segment)], source
