"""Link probes to run on testbed hosts (with ``Testbed.start_call``/``call``): TCP throughput and
UDP loss. Each side waits for the other within a timeout, so a receiver may be started first and
a sender right after it without any other synchronisation.
"""

from __future__ import annotations

import socket
import struct
import time

CONNECT_RETRY_S = 0.05
_HELLO = b"hello"
_READY = b"ready"
_SEQ = struct.Struct("!I")
_UDP_RCVBUF = 4 << 20  # so that a slow receiver loses nothing: only the link may


def tcp_receive(port: int, nbytes: int, timeout: float = 30.0, skip: float = 0.1) -> dict:
    """Accept one connection on ``port`` and read ``nbytes``. The rate is measured after the
    first ``skip`` fraction of the bytes (past slow start and the shaper's initial burst);
    ``timeline`` holds (``time.monotonic()``, bytes so far) after every read, so flows measured
    in different processes can be compared over the same interval."""
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout)
        connection, _ = server.accept()
    with connection:
        connection.settimeout(timeout)
        buffer = bytearray(1 << 20)
        received, mark, first_byte_at, timeline = 0, None, 0.0, []
        while received < nbytes:
            count = connection.recv_into(buffer)
            if count == 0:
                break
            if received == 0:
                first_byte_at = time.monotonic()
                timeline.append((first_byte_at, 0))
            received += count
            timeline.append((time.monotonic(), received))
            if mark is None and received >= skip * nbytes:
                mark = (time.perf_counter(), received)
        end = time.perf_counter()
    if mark is None or received <= mark[1]:
        raise RuntimeError(f"received only {received} of {nbytes} bytes")
    seconds = end - mark[0]
    return {
        "bytes": received,
        "seconds": seconds,
        "bits_per_s": (received - mark[1]) * 8 / seconds,
        # system-wide clock, comparable across processes: for aggregates over several flows
        "first_byte_at": first_byte_at,
        "end_at": time.monotonic(),
        "timeline": timeline,
    }


def tcp_send(
    address: str, port: int, nbytes: int, timeout: float = 30.0, start_at: float | None = None
) -> int:
    """Connect to ``address:port`` (retrying until the receiver listens) and send ``nbytes``,
    beginning at ``start_at`` (``time.monotonic()``, one clock for every namespace) if given, so
    that senders started as separate processes push at the same time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = socket.create_connection((address, port), timeout=timeout)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(CONNECT_RETRY_S)
    chunk = bytes(1 << 20)
    with connection:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.monotonic()))
        sent = 0
        while sent < nbytes:
            piece = memoryview(chunk)[: min(len(chunk), nbytes - sent)]
            connection.sendall(piece)
            sent += len(piece)
    return sent


def udp_receive(port: int, count: int, timeout: float = 30.0, idle: float = 0.5) -> int:
    """Count the distinct datagrams (of ``count`` sent by ``udp_send``) that arrive on ``port``;
    answers the sender's hellos. Returns once all arrived or nothing came for ``idle`` s."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _UDP_RCVBUF)
        sock.bind(("0.0.0.0", port))
        sock.settimeout(timeout)
        while len(seen) < count and time.monotonic() < deadline:
            try:
                data, peer = sock.recvfrom(65536)
            except TimeoutError:
                break
            if data == _HELLO:
                sock.sendto(_READY, peer)
            elif len(data) >= _SEQ.size:
                seen.add(_SEQ.unpack_from(data)[0])
                sock.settimeout(idle)
    return len(seen)


def udp_send(
    address: str,
    port: int,
    count: int,
    size: int = 200,
    rate_pps: float = 20_000,
    timeout: float = 30.0,
) -> int:
    """Wait until ``udp_receive`` answers, then send ``count`` numbered datagrams of ``size``
    bytes, paced at ``rate_pps`` so that no queue overflows and only the link's loss shows."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        _handshake(sock, (address, port), timeout)
        padding = bytes(max(0, size - _SEQ.size))
        start = time.perf_counter()
        for seq in range(count):
            sock.sendto(_SEQ.pack(seq) + padding, (address, port))
            ahead = start + (seq + 1) / rate_pps - time.perf_counter()
            if ahead > 0.001:
                time.sleep(ahead)
    return count


def _handshake(sock: socket.socket, peer: tuple[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    sock.settimeout(0.1)
    while time.monotonic() < deadline:
        sock.sendto(_HELLO, peer)
        try:
            if sock.recv(64) == _READY:
                return
        except (TimeoutError, ConnectionRefusedError):
            continue
    raise TimeoutError(f"no UDP receiver answered at {peer[0]}:{peer[1]} within {timeout:g} s")


def udp_rtt(address: str, port: int, samples: int = 20, timeout: float = 30.0) -> list[float]:
    """Round-trip times (s) of hello/ready exchanges with ``udp_receive(port, 1)``, which this
    then releases by sending it datagram 0."""
    rtts = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        _handshake(sock, (address, port), timeout)
        while len(rtts) < samples:
            _drain(sock)  # late replies to retried hellos would shorten the next sample
            start = time.perf_counter()
            _handshake(sock, (address, port), timeout)
            rtts.append(time.perf_counter() - start)
        sock.sendto(_SEQ.pack(0), (address, port))
    return rtts


def _drain(sock: socket.socket) -> None:
    sock.setblocking(False)
    try:
        while True:
            sock.recv(64)
    except (BlockingIOError, ConnectionRefusedError):
        pass
    finally:
        sock.setblocking(True)
