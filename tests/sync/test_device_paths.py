"""Every codec's round through the aggregators' device code paths, traced on the ``meta``
device: the branches CUDA takes, where any op that mixes devices raises, and so does any read
of a value on the host (``.item()``, ``.numpy()``, ``bool()``, ``float()``: meta tensors hold
no data). What is faked is only the transport at the boundary: the collectives of all-reduce,
and the copies between the device and the UDP client's host buffers (whose lanes then go
through the real data plane, as zeros).
"""

import pytest
import torch
import torch.distributed as dist

from gradsum.codecs import CODEC_NAMES, make_codec
from gradsum.codecs.base import DeviceChecks
from gradsum.codecs.bits import packed_nbytes
from gradsum.codecs.round import CodecRound, partition_bounds
from gradsum.dataplane import (
    Collective,
    DataPlane,
    JobHandle,
    JobSpec,
    RetryPolicy,
    server_profile,
    switch_profile,
)
from gradsum.dataplane.codec_wire import wire_format
from gradsum.dataplane.device_boundary import DeviceBoundary
from gradsum.dataplane.geometry import lanes_fitting
from gradsum.sync.allreduce import AllReduceAggregator

from ..dataplane.memnet import MemoryNetwork

META = torch.device("meta")
LENGTH = (1 << 20) + 12_345  # a whole partition and a ragged one
def run_steps(codec, reducer, worker=0, steps=2):
    round_ = CodecRound(codec, seed=3)
    for step in range(steps):  # a second step: error feedback and momentum carry over
        checks = DeviceChecks()  # never read: reading a meta flag would raise
        average = round_.run(torch.empty(LENGTH, device=META), reducer, worker=worker,
                             key="bucket", step=step, checks=checks)  # fmt: skip
        assert average.device == META and average.shape == (LENGTH,)


@pytest.fixture
def fake_collectives(monkeypatch):
    """all-reduce's collectives as no-ops that keep shapes (each output takes the input)."""
    seen = []

    def all_reduce(tensor, op=None, group=None):
        seen.append(("all_reduce", tensor.device, tensor.dtype))

    def all_gather(outputs, tensor, group=None):
        seen.append(("all_gather", tensor.device, tensor.dtype))
        for out in outputs:
            out.copy_(tensor)

    def all_to_all_single(output, tensor, group=None):
        output.copy_(tensor)

    def all_gather_single(output, tensor, group=None):
        output.view(-1, tensor.numel()).copy_(tensor.expand(output.numel() // tensor.numel(), -1))

    for name, fn in [("all_reduce", all_reduce), ("all_gather", all_gather),
                     ("all_to_all_single", all_to_all_single),
                     ("all_gather_single", all_gather_single)]:  # fmt: skip
        # raising=False: a torch without all_gather_single gets the fake all the same
        monkeypatch.setattr(dist, name, fn, raising=False)
    return seen


def allreduce(world: int, deterministic: bool = False) -> AllReduceAggregator:
    aggregator = AllReduceAggregator.__new__(AllReduceAggregator)  # no process group needed
    aggregator.rank, aggregator.world_size = 0, world
    aggregator.group, aggregator.control, aggregator.deterministic = None, None, deterministic
    return aggregator


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_round_runs_on_the_device_through_allreduce(fake_collectives, name):
    run_steps(make_codec(name, workers=2), allreduce(2))
    data = [(what, device) for what, device, dtype in fake_collectives if dtype != torch.int64]
    assert data and all(device == META for _, device in data), data  # the gradient's device
    sizes = [device for _, device, dtype in fake_collectives if dtype == torch.int64]
    assert all(device.type == "cpu" for device in sizes)  # host sizes: the Gloo control group


def test_fp32_in_worker_order_runs_on_the_device(fake_collectives):
    run_steps(make_codec("none", workers=2), allreduce(2, deterministic=True))


def test_fp32_in_worker_order_gathers_under_the_older_name_where_torch_lacks_the_new(
    fake_collectives, monkeypatch
):
    """torch builds without ``all_gather_single`` (2.11, as on the GPU machines) gather the
    shares with ``all_gather_into_tensor``."""
    gathered = []

    def all_gather_into_tensor(output, tensor, group=None):
        gathered.append(tensor.numel())
        output.view(-1, tensor.numel()).copy_(tensor.expand(output.numel() // tensor.numel(), -1))

    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    run_steps(make_codec("none", workers=2), allreduce(2, deterministic=True))
    assert gathered and all(n > 0 for n in gathered)


@pytest.fixture
def fake_boundary(monkeypatch):
    """The copies of the UDP client's device boundary, keeping shapes: down to the host as
    zeros, up to the device as empty tensors."""
    moved = []

    def to_host(self, tensor, into=None):
        assert tensor.device == self.device == META, tensor.device
        moved.append(("down", tensor.numel() * tensor.element_size()))
        if into is not None:
            into.zero_()
            return into
        return torch.zeros(tensor.numel(), dtype=tensor.dtype)

    def to_device(self, host):
        assert host.device.type == "cpu"
        moved.append(("up", host.numel() * host.element_size()))
        return torch.empty(host.shape, dtype=host.dtype, device=self.device)

    monkeypatch.setattr(DeviceBoundary, "to_host", to_host)
    monkeypatch.setattr(DeviceBoundary, "to_device", to_device)
    return moved


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_round_runs_on_the_device_through_the_udp_client(fake_boundary, name):
    codec = make_codec(name, workers=1)
    fmt = wire_format(codec, seed=3)
    profile = switch_profile if codec.aggregation.integer_only else server_profile
    elements = lanes_fitting(max(fmt.in_bits, fmt.out_bits)) if fmt.lanes else 1 << 13
    address, worker = ("10.0.0.1", 48864), ("10.0.1.1", 5000)
    network = MemoryNetwork(seed=5)
    aggregator = DataPlane(profile())
    aggregator.register(JobSpec(7, (worker,), 8, elements, fmt.op))
    network.add_aggregator(address, aggregator)

    def run():
        reducer = Collective(fmt, [JobHandle(address, 7, 0, 8, elements, 1)],
                             network.transport(worker),
                             policy=RetryPolicy(timeout=0.01, max_timeout=0.05), streaming=True)
        partition = reducer.partition_size()
        round_ = CodecRound(codec, seed=3, partition_elements=partition)
        length = LENGTH if fmt.lanes else 3 * partition + 17  # a datagram per DSE piece
        for step in range(2):
            average = round_.run(torch.empty(length, device=META), reducer, worker=0,
                                 key="bucket", step=step, checks=DeviceChecks())  # fmt: skip
            assert average.device == META

    network.run_workers({worker: run})
    down = sum(n for way, n in fake_boundary if way == "down")
    if fmt.lanes:  # only packed lanes came down (THC: 4 bits a coordinate), and the summaries
        bounds = partition_bounds(LENGTH)
        lanes = sum(packed_nbytes(codec.lanes(b - a), fmt.in_bits) for a, b in bounds)
        summaries = 0
        if codec.needs_summary:
            reference = make_codec(name, workers=1)
            summaries = sum(4 * reference.summarize(torch.zeros(b - a), None).numel()
                            for a, b in bounds)  # fmt: skip
        if codec.stages == 1:
            assert down == 2 * (lanes + summaries)
        else:  # a low-rank codec's stages carry its factors, far fewer lanes than the bucket's
            assert 0 < down < lanes / 10
