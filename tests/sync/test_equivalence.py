"""One gradient path: every codec gives the same decoded average on every aggregator.

The matrix is every codec x {the in-process reference, all-reduce over Gloo, a switch, a switch
of 2 pipelines, a parameter server of 1 and of 4 shards}, for a tensor of 1,000 coordinates and
one of 3 * 2**20 + 12,345 (three whole partitions and a ragged one), over 3 steps so that error
feedback, momentum and the per-step random streams all take part. Same inputs, seed and step:
the averages are bit-identical to the reference's, whose SUM is ``codec.aggregate`` (an integer
or float sum, or decode-sum-encode with the aggregator's own random stream).

The switch and parameter-server cells run the real data plane (the workers' ``Collective``,
the aggregators' slot pools and ops) over the deterministic in-memory network; the UDP shells
around the same cores are tested in tests/net.
"""

import pytest
import torch

from gradsum.codecs import CODEC_NAMES, Codec, make_codec, run_round
from gradsum.codecs.round import PARTITION_ELEMENTS, CodecRound
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
from gradsum.dataplane.geometry import lanes_fitting

from ..dataplane.memnet import MemoryNetwork
from .distributed import run_distributed

WORKERS, STEPS, SEED, KEY = 4, 3, 11, ("bucket", 0)
SIZES = [1000, 3 * PARTITION_ELEMENTS + 12_345]
# the large cells take seconds each: the suite's slow part, run on the native path only
SIZE_PARAMS = [1000, pytest.param(SIZES[1], marks=pytest.mark.slow)]
SERVICES = {  # name: (profile, aggregators)
    "switch": (switch_profile, 1),
    "switch-2-pipelines": (switch_profile, 2),
    "ps-1": (server_profile, 1),
    "ps-4": (server_profile, 4),
}
POLICY = RetryPolicy(timeout=0.01, max_timeout=0.05, give_up_after=30.0)
DSE_PARTITION = 1 << 13  # a decode-sum-encode piece is one datagram (the UDP client's default)
STATEFUL = {"thc", "thc-uniform", "topk", "dgc", "powersgd"}  # error feedback, momentum (dgc)


# The tensors each flat gradient holds (what a DDP bucket or GradientSync describes): matrices,
# a matrix larger than a partition, and vectors between them; codecs that work per tensor
# (powersgd) split the buffer by them, the others ignore them.
LAYOUTS = {1000: [(20, 40), (100,), (10, 10)],
           SIZES[1]: [(1024, 1024), (2048,), (1024, 2048), (10_297,)]}  # fmt: skip


# Options that change a codec's rounding (or its lane widths: 8-bit THC, 510 grid steps, whose
# sums of 4 workers need 11-bit lanes downstream): run through the matrix as codecs
VARIANTS = {"thc+correlated": ("thc", {"correlated": True}),
            "thc-uniform+correlated": ("thc-uniform", {"correlated": True}),
            "thc+8-bits": ("thc", {"bits": 8})}  # fmt: skip
NAMES = (*CODEC_NAMES, *VARIANTS)


def built(name: str, size: int | None = None, workers: int = WORKERS) -> Codec:
    base, options = VARIANTS.get(name, (name, {}))
    codec = make_codec(base, workers=workers, **options)
    if size is not None:
        codec.describe(KEY, LAYOUTS[size])
    return codec


def steps_for(name: str, size: int) -> int:
    """3 steps where state carries over or the tensor is small; the large tensor's stateless
    rounds repeat nothing the first step does not show."""
    return STEPS if name.partition("+")[0] in STATEFUL or size < PARTITION_ELEMENTS else 1


def gradient(worker: int, step: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(size, generator=generator) * (1 + step)


def partition_for(name: str, service: bool) -> int:
    """What ``Aggregator.partition_size`` gives: 2**20, or one datagram's worth for payloads a
    parameter server decodes (all-reduce needs no such limit)."""
    dse = built(name, workers=1).lane_fields is None
    return DSE_PARTITION if service and dse else PARTITION_ELEMENTS


def reference(name: str, size: int, partition: int) -> list[torch.Tensor]:
    codec = built(name, size)
    return [
        run_round(codec, [gradient(w, step, size) for w in range(WORKERS)], seed=SEED,
                  step=step, key=KEY, partition_elements=partition).average
        for step in range(steps_for(name, size))
    ]  # fmt: skip


def over_service(name: str, service: str, size: int) -> dict[int, list[torch.Tensor]]:
    """Every worker's averages over the rounds through the service's jobs."""
    profile, count = SERVICES[service]
    network = MemoryNetwork(seed=5)
    fmt = wire_format(built(name), seed=SEED)
    elements = lanes_fitting(max(fmt.in_bits, fmt.out_bits)) if fmt.lanes else DSE_PARTITION
    addresses = tuple(("10.0.1.1", 5000 + w) for w in range(WORKERS))
    aggregators = {("10.0.0.1", 48864 + p): DataPlane(profile()) for p in range(count)}
    for address, aggregator in aggregators.items():
        aggregator.register(JobSpec(7, addresses, 8, elements, fmt.op))
        network.add_aggregator(address, aggregator)

    def worker(w: int) -> list[torch.Tensor]:
        codec = built(name, size)
        handles = [JobHandle(a, 7, w, 8, elements, WORKERS) for a in aggregators]
        reducer = Collective(fmt, handles, network.transport(addresses[w]), policy=POLICY,
                             streaming=True)  # fmt: skip
        round_ = CodecRound(codec, SEED, partition_for(name, service=True))
        return [round_.run(gradient(w, step, size), reducer, worker=w, key=KEY, step=step)
                for step in range(steps_for(name, size))]  # fmt: skip

    results = network.run_workers({addresses[w]: (lambda w=w: worker(w)) for w in range(WORKERS)})
    return {w: results[addresses[w]] for w in range(WORKERS)}


def assert_identical(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, f"{what}, step {step}: shape {tuple(a.shape)}"
        differ = int((a != b).sum())
        assert differ == 0, f"{what}, step {step}: {differ} of {a.numel()} coordinates differ"


def integer_only(name: str) -> bool:
    return built(name, workers=1).aggregation.integer_only


@pytest.mark.parametrize("size", SIZE_PARAMS)
@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("name", NAMES)
def test_services_give_the_reference_average_bit_for_bit(name, service, size):
    if service.startswith("switch") and not integer_only(name):
        fmt = wire_format(built(name))
        spec = JobSpec(7, (("10.0.1.1", 5000),), 8, 256, fmt.op)
        with pytest.raises(Exception, match="integer operations only"):
            DataPlane(switch_profile()).register(spec)  # a switch adds integers, nothing else
        return
    want = reference(name, size, partition_for(name, service=True))
    for w, averages in over_service(name, service, size).items():
        assert_identical(averages, want, f"{name} over {service}, worker {w}, {size} coordinates")


def allreduce_rounds(rank: int, world: int, names, sizes) -> dict:
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.session import Session

    aggregator = AllReduceAggregator()
    exact = AllReduceAggregator(deterministic=True)
    out = {}
    for size in sizes:
        session = Session(make_codec("none", workers=world), exact, seed=SEED)
        out["none-in-worker-order", size] = [
            session.synchronize(gradient(rank, step, size), key=KEY, step=step)
            for step in range(steps_for("none", size))
        ]
        for name in names:
            session = Session(built(name, size, workers=world), aggregator, seed=SEED)
            out[name, size] = [
                session.synchronize(gradient(rank, step, size), key=KEY, step=step)
                for step in range(steps_for(name, size))
            ]
    return out


@pytest.mark.slow
def test_allreduce_over_gloo_gives_the_reference_average_bit_for_bit():
    results = run_distributed(allreduce_rounds, WORKERS, NAMES, SIZES, timeout=600)
    for size in SIZES:
        for name in NAMES:
            want = reference(name, size, partition_for(name, service=False))
            for rank, result in enumerate(results):
                what = f"{name} over all-reduce, worker {rank}, {size} coordinates"
                assert_identical(result[name, size], results[0][name, size], what)
                if name == "none":  # the ring's order; in worker order, bit for bit
                    assert_float_sum(result[name, size], want, size, what)
                    exact = result["none-in-worker-order", size]
                    assert_identical(exact, want, f"{what}, deterministic")
                else:
                    assert_identical(result[name, size], want, what)


def assert_float_sum(got: list[torch.Tensor], want: list[torch.Tensor], size: int, what: str):
    """fp32 through Gloo: its ring adds the workers' values in an order of its own, so the sum
    is the reference's up to float32 rounding (at most 3 roundings of |x| sums: 4 workers)."""
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        magnitude = torch.stack([gradient(w, step, size).abs() for w in range(WORKERS)]).sum(0)
        bound = 3 * torch.finfo(torch.float32).eps * magnitude / WORKERS
        assert bool(((a - b).abs() <= bound).all()), f"{what}, step {step}"
