"""UDP_GRO on loopback: a GSO send of several datagrams arrives as one read, split here again."""

import socket
import struct

import pytest

from gradsum.net.udp import UDP_GRO, enable_gro, open_socket, receive_datagrams

UDP_SEGMENT = 103


def send_segments(sender: socket.socket, to, segments: list[bytes]) -> None:
    """One sendmsg that the kernel cuts into ``segments`` (all of one size but the last)."""
    size = struct.pack("H", len(segments[0]))
    sender.sendmsg([b"".join(segments)], [(socket.SOL_UDP, UDP_SEGMENT, size)], 0, to)


def test_joined_datagrams_are_split_where_the_sender_cut_them():
    with open_socket(("127.0.0.1", 0)) as receiver, open_socket(("127.0.0.1", 0)) as sender:
        if not enable_gro(receiver):
            pytest.skip("this kernel has no UDP_GRO")
        segments = [bytes([i]) * 1000 for i in range(3)] + [b"\x09" * 10]
        send_segments(sender, receiver.getsockname(), segments)
        receiver.settimeout(2)
        receiver.setblocking(True)
        buffer = bytearray(1 << 16)
        slices, source = receive_datagrams(receiver, buffer)
        assert source[:2] == sender.getsockname()
    assert [bytes(buffer[s]) for s in slices] == segments


def test_without_gro_each_datagram_is_its_own_read():
    with open_socket(("127.0.0.1", 0)) as receiver, open_socket(("127.0.0.1", 0)) as sender:
        segments = [b"a" * 500, b"b" * 500]
        send_segments(sender, receiver.getsockname(), segments)
        receiver.setblocking(True)
        receiver.settimeout(2)
        buffer = bytearray(1 << 16)
        reads = []
        for _ in segments:
            slices, _ = receive_datagrams(receiver, buffer)
            reads += [bytes(buffer[s]) for s in slices]
        assert receiver.getsockopt(socket.SOL_UDP, UDP_GRO) == 0
    assert reads == segments
