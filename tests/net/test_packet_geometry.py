"""Packets sized for a path MTU: the largest that fit one frame, a chunk's worth per GSO send."""

import pytest

from gradsum.codecs.registry import make_codec
from gradsum.dataplane.codec_wire import wire_format
from gradsum.dataplane.geometry import MAX_GSO_BYTES, packet_geometry, window_slots
from gradsum.dataplane.packet import HEADER_SIZE
from gradsum.net.client import SwitchClient

IPV4_UDP = 28


def fmt(codec: str, **options):
    return wire_format(make_codec(codec, workers=4, **options), options)


def bits(codec: str) -> int:
    """The wider of the job's two wire widths, which sizes its packets."""
    f = fmt(codec)
    return max(f.in_bits, f.out_bits)


@pytest.mark.parametrize("codec", ["bfp", "thc"])
@pytest.mark.parametrize("mtu", [1500, 9000, 65535])
def test_the_largest_packet_that_fits_the_frame_and_as_many_as_one_send_holds(codec, mtu):
    f = fmt(codec)
    bits = max(f.in_bits, f.out_bits)
    lanes, segments = packet_geometry(max(f.in_bits, f.out_bits), 1 << 20, mtu)
    packet = HEADER_SIZE + lanes * bits // 8
    assert lanes % 8 == 0
    assert packet <= mtu - IPV4_UDP < packet + 8 * bits // 8  # 8 lanes more would not fit
    assert segments * packet <= MAX_GSO_BYTES < (segments + 1) * packet or segments == 64


def test_the_testbeds_jumbo_frames_carry_seven_packets_of_2232_bfp_lanes_per_send():
    assert packet_geometry(bits("bfp"), 1 << 20, 9000) == (2232, 7)


def test_without_an_mtu_a_chunk_is_one_packet_of_the_requested_lanes():
    assert packet_geometry(bits("bfp"), 16368, None) == (16368, 1)
    assert packet_geometry(bits("bfp"), 1024, 9000) == (1024, 15)  # fewer lanes than fit


def test_an_mtu_with_no_room_for_a_packet_is_refused():
    with pytest.raises(ValueError, match="mtu 64"):
        packet_geometry(bits("bfp"), 1 << 20, 64)


def test_a_job_of_mtu_sized_packets_registers_a_slot_per_packet_and_refuses_quorums():
    with SwitchClient([("127.0.0.1", 9)], fmt("bfp"), job=1, worker=0, workers=2, slots=4,
                      mtu=9000) as c:  # fmt: skip
        spec = c.job_spec([("127.0.0.1", 1000), ("127.0.0.1", 1001)])
        assert (spec.slots, spec.elements) == (4 * 7, 2232)
        with pytest.raises(ValueError, match="partial aggregation"):
            c.job_spec([("127.0.0.1", 1000), ("127.0.0.1", 1001)], quorum=1, deadline=0.1)


@pytest.mark.parametrize(("codec", "options"), [("thc", {}), ("thc", {"bits": 8}), ("bfp", {})])
def test_a_window_in_bytes_holds_as_many_chunks_as_fit_and_no_more(codec, options):
    # THC's 64 KiB datagrams at 4 and 8 bits (results of 7 and 11), bfp's of 32: a 256 KiB
    # window keeps at most 256 KiB of a worker's chunks, or of their results, in flight
    window = 256 * 1024
    with SwitchClient([("127.0.0.1", 9)], fmt(codec, **options), job=1, worker=0, workers=4,
                      window_bytes=window) as c:  # fmt: skip
        f = c.format
        wide = max(f.in_bits, f.out_bits)
        datagram = HEADER_SIZE + IPV4_UDP + (c.elements * wide + 7) // 8
        assert c.slots * datagram <= window < (c.slots + 1) * datagram
        assert 1 <= c.slots < 32
        spec = c.job_spec([("127.0.0.1", 1000 + w) for w in range(4)])
        assert spec.slots == c.slots


def test_a_window_is_never_under_one_chunk_nor_over_the_slots():
    assert window_slots(1, 74856, 1, 7, 32) == 1
    assert window_slots(1 << 30, 74856, 1, 7, 32) == 32
    with SwitchClient([("127.0.0.1", 9)], fmt("bfp"), job=1, worker=0, workers=2, slots=4,
                      mtu=9000, window_bytes=1 << 30) as c:  # fmt: skip
        assert c.slots == 4  # the bytes allow more than the slots asked for
    with pytest.raises(ValueError, match="window_bytes must be positive"):
        window_slots(0, 1024, 1, 32, 32)
