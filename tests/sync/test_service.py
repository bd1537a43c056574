"""Training through gradsum's own switch and parameter server, with real daemons and processes:
every worker holds bitwise-identical parameters after every step."""

import pytest
import torch

from gradsum.net.loopback import DaemonProcess

from .distributed import run_distributed
from .service_workers import train_through_service, warm_up_then_compress


def _address(daemon: DaemonProcess) -> str:
    return f"{daemon.address[0]}:{daemon.address[1]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "codec", "ddp"),
    [("switch", "thc", False), ("switch", "bfp", True), ("server", "topk", False)],
)
def test_replicas_identical_after_every_step(kind, codec, ddp):
    steps = 10
    with DaemonProcess(kind) as daemon:
        aggregator = "switch" if kind == "switch" else "ps"
        first, second = run_distributed(
            train_through_service, 2, aggregator, [_address(daemon)], codec, steps, ddp
        )
    for a, b in zip(first["snapshots"], second["snapshots"], strict=True):
        assert torch.equal(a, b)
    assert sum(first["losses"][-3:]) < sum(first["losses"][:3])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["allreduce", "switch", "server"])
def test_ddp_hook_warm_up_steps_are_uncompressed_on_every_aggregator(kind):
    """``start_step``: fp32 (bfp on a switch, which adds integers only) first, then THC."""
    start, steps = 2, 4
    if kind == "allreduce":
        errors = run_distributed(warm_up_then_compress, 2, kind, [], start, steps)
    else:
        with DaemonProcess(kind) as daemon:
            aggregator = "switch" if kind == "switch" else "ps"
            errors = run_distributed(
                warm_up_then_compress, 2, aggregator, [_address(daemon)], start, steps
            )
    for per_step in errors:
        assert all(e < 1e-6 for e in per_step[:start]), per_step  # fp32 or bfp: exact enough
        # THC's 4 bits: not exact, and no further than its grid (about 0.1 on these buckets)
        assert all(1e-3 < e < 0.3 for e in per_step[start:]), per_step


def test_transport_stats_sum_every_clients_jobs():
    """A worker's counters over its clients (one per codec's jobs) and their jobs (one per
    switch pipeline or PS shard)."""
    from types import SimpleNamespace

    from gradsum.sync.aggregator import Aggregator
    from gradsum.sync.service import ServiceAggregator

    class Client:
        def __init__(self, *per_job):
            self.per_job = per_job

        def stats(self):
            return {f"10.0.0.{i}:7000/1": counters for i, counters in enumerate(self.per_job)}

    aggregator = ServiceAggregator.__new__(ServiceAggregator)  # no jobs needed
    aggregator._channels = [  # (wire format, its channel): two codecs' jobs
        ("thc", SimpleNamespace(clients=[Client({"packets_sent": 10, "retransmissions": 1},
                                                {"packets_sent": 5, "timeouts": 2})])),
        ("none", SimpleNamespace(clients=[Client({"packets_sent": 7, "retransmissions": 0})])),
    ]  # fmt: skip
    assert aggregator.transport_stats() == {"packets_sent": 22, "retransmissions": 1, "timeouts": 2}
    assert Aggregator(0, 1).transport_stats() == {}  # no gradsum transport: nothing to count
