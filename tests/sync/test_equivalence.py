"""One gradient path: every codec gives the same decoded average on every aggregator.

The matrix is every codec x {the in-process reference, all-reduce over Gloo, a switch, a switch
of 2 pipelines, a parameter server of 1 and of 4 shards}, for a tensor of 1,000 coordinates
(one ragged partition) and one of several whole partitions and a ragged one, over 3 steps so
that error feedback, momentum and the per-step random streams all take part. Same inputs, seed
and step: the averages are bit-identical to the reference's, whose SUM is ``codec.aggregate``
(an integer or float sum, or decode-sum-encode with the aggregator's own random stream).

The several partitions are as small as prove the same as 2**20 ones: a codec that compresses
per datagram (decode-sum-encode at a server) runs 3 * 8,192 + 1,234 coordinates, 8,192 to a
partition, one datagram's worth as on a server; a codec of lanes runs 3 * 2**14 + 1,234 in
partitions of 2**14, in slots of 4,096 lanes, so that a job streams more chunks than it has
slots (each slot reused, its version flipped) and every shard of a 4-shard server and both
pipelines of a switch carry some. One cell runs the default partition and the largest slots a
datagram holds, 3 * 2**20 + 12,345 coordinates of THC over a 4-shard server (and over
all-reduce): what the sizes themselves change.

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
LANES_PARTITION = 1 << 14  # the "several" cells of lane codecs: 3 partitions and a ragged one
SLOT_LANES = 4096  # their slots: 13 chunks of a "several" THC tensor, for 8 slots
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
           3 * DSE_PARTITION + 1_234: [(64, 128), (1024,), (96, 160), (1_234,)],
           3 * LANES_PARTITION + 1_234: [(128, 256), (1024,), (120, 128), (1_234,)],
           3 * PARTITION_ELEMENTS + 12_345: [(1024, 1024), (2048,), (1024, 2048),
                                             (10_297,)]}  # fmt: skip


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
    """3 steps where state carries over or the tensor is small; a larger tensor's stateless
    rounds repeat nothing the first step does not show."""
    return STEPS if name.partition("+")[0] in STATEFUL or size == 1000 else 1


def gradient(worker: int, step: int, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(size, generator=generator) * (1 + step)


def decoded_at_a_server(name: str) -> bool:
    return built(name, workers=1).lane_fields is None


def partition_for(name: str, service: bool) -> int:
    """What ``Aggregator.partition_size`` gives: 2**20, or one datagram's worth for payloads a
    parameter server decodes (all-reduce needs no such limit)."""
    return DSE_PARTITION if service and decoded_at_a_server(name) else PARTITION_ELEMENTS


# The cells' tensors: (coordinates, partition) by codec, for a service or all-reduce.
def geometry(name: str, cell: str, service: bool) -> tuple[int, int]:
    if cell == "small":
        return 1000, partition_for(name, service)
    if cell == "several":
        if decoded_at_a_server(name):
            return 3 * DSE_PARTITION + 1_234, DSE_PARTITION
        return 3 * LANES_PARTITION + 1_234, LANES_PARTITION
    return 3 * PARTITION_ELEMENTS + 12_345, PARTITION_ELEMENTS  # "default-partition"


CELLS = ["small", "several"]


def reference(name: str, size: int, partition: int) -> list[torch.Tensor]:
    codec = built(name, size)
    return [
        run_round(codec, [gradient(w, step, size) for w in range(WORKERS)], seed=SEED,
                  step=step, key=KEY, partition_elements=partition).average
        for step in range(steps_for(name, size))
    ]  # fmt: skip


def over_service(name: str, service: str, size: int, partition: int) -> tuple[dict, list[dict]]:
    """Every worker's averages over the rounds through the service's jobs, and each
    aggregator's counters of the job."""
    profile, count = SERVICES[service]
    network = MemoryNetwork(seed=5)
    fmt = wire_format(built(name), seed=SEED)
    elements = lanes_fitting(max(fmt.in_bits, fmt.out_bits)) if fmt.lanes else DSE_PARTITION
    if fmt.lanes and partition < PARTITION_ELEMENTS:
        elements = min(elements, SLOT_LANES)
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
        round_ = CodecRound(codec, SEED, partition)
        return [round_.run(gradient(w, step, size), reducer, worker=w, key=KEY, step=step)
                for step in range(steps_for(name, size))]  # fmt: skip

    results = network.run_workers({addresses[w]: (lambda w=w: worker(w)) for w in range(WORKERS)})
    counters = [dict(aggregator.jobs[7].pool.stats) for aggregator in aggregators.values()]
    return {w: results[addresses[w]] for w in range(WORKERS)}, counters


def assert_identical(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape, f"{what}, step {step}: shape {tuple(a.shape)}"
        differ = int((a != b).sum())
        assert differ == 0, f"{what}, step {step}: {differ} of {a.numel()} coordinates differ"


def integer_only(name: str) -> bool:
    return built(name, workers=1).aggregation.integer_only


def check_service(name: str, service: str, cell: str) -> None:
    if service.startswith("switch") and not integer_only(name):
        fmt = wire_format(built(name))
        spec = JobSpec(7, (("10.0.1.1", 5000),), 8, 256, fmt.op)
        with pytest.raises(Exception, match="integer operations only"):
            DataPlane(switch_profile()).register(spec)  # a switch adds integers, nothing else
        return
    size, partition = geometry(name, cell, service=True)
    want = reference(name, size, partition)
    averages, counters = over_service(name, service, size, partition)
    for w, got in averages.items():
        assert_identical(got, want, f"{name} over {service}, worker {w}, {size} coordinates")
    # every shard and pipeline carried part of the rounds (PowerSGD's factors of these
    # matrices are a few thousand lanes, one chunk: one shard carries them)
    if cell != "small" and name != "powersgd":
        assert all(c.get("completed", 0) > 0 for c in counters), (service, counters)


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.parametrize("service", list(SERVICES))
@pytest.mark.parametrize("name", NAMES)
def test_services_give_the_reference_average_bit_for_bit(name, service, cell):
    check_service(name, service, cell)


@pytest.mark.slow
def test_the_default_partition_through_a_sharded_server_gives_the_reference_bit_for_bit():
    check_service("thc", "ps-4", "default-partition")


ALLREDUCE_CELLS = [(name, cell) for cell in CELLS for name in NAMES] + [
    ("thc", "default-partition")
]


def allreduce_rounds(rank: int, world: int, cells) -> dict:
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.session import Session

    aggregator = AllReduceAggregator()
    exact = AllReduceAggregator(deterministic=True)
    out = {}
    for name, cell in cells:
        size, partition = geometry(name, cell, service=False)
        if name == "none":
            session = Session(make_codec("none", workers=world), exact, seed=SEED,
                              partition_elements=partition)  # fmt: skip
            out["none-in-worker-order", cell] = [
                session.synchronize(gradient(rank, step, size), key=KEY, step=step)
                for step in range(steps_for("none", size))
            ]
        session = Session(built(name, size, workers=world), aggregator, seed=SEED,
                          partition_elements=partition)  # fmt: skip
        out[name, cell] = [
            session.synchronize(gradient(rank, step, size), key=KEY, step=step)
            for step in range(steps_for(name, size))
        ]
    return out


@pytest.mark.slow
def test_allreduce_over_gloo_gives_the_reference_average_bit_for_bit():
    results = run_distributed(allreduce_rounds, WORKERS, ALLREDUCE_CELLS, timeout=600)
    for name, cell in ALLREDUCE_CELLS:
        size, partition = geometry(name, cell, service=False)
        want = reference(name, size, partition)
        for rank, result in enumerate(results):
            what = f"{name} over all-reduce, worker {rank}, {size} coordinates"
            assert_identical(result[name, cell], results[0][name, cell], what)
            if name == "none":  # the ring's order; in worker order, bit for bit
                assert_float_sum(result[name, cell], want, size, what)
                exact = result["none-in-worker-order", cell]
                assert_identical(exact, want, f"{what}, deterministic")
            else:
                assert_identical(result[name, cell], want, what)


def assert_float_sum(got: list[torch.Tensor], want: list[torch.Tensor], size: int, what: str):
    """fp32 through Gloo: its ring adds the workers' values in an order of its own, so the sum
    is the reference's up to float32 rounding (at most 3 roundings of |x| sums: 4 workers)."""
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        magnitude = torch.stack([gradient(w, step, size).abs() for w in range(WORKERS)]).sum(0)
        bound = 3 * torch.finfo(torch.float32).eps * magnitude / WORKERS
        assert bool(((a - b).abs() <= bound).all()), f"{what}, step {step}"
