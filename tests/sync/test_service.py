"""Training through gradsum's own switch and parameter server, with real daemons and processes:
every worker holds bitwise-identical parameters after every step."""

import pytest
import torch

from gradsum.net.loopback import DaemonProcess

from .distributed import run_distributed
from .service_workers import train_through_service


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
