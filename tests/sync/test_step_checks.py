"""A step's device checks are read once, when the step's gradients are all back (GradientSync
.wait, the DDP hook's last bucket), not once per group: no host sync per round."""

import pytest
import torch

from gradsum.codecs import NonFiniteGradientError, make_codec
from gradsum.codecs.base import DeviceChecks
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.session import Session

from ..codecs.test_host_syncs import OneWorker
from .fakes import Reducing


def local_session(codec) -> Session:
    """One worker, the in-process reference's reducer."""
    return Session(codec, Reducing(OneWorker))


@pytest.fixture
def reads(monkeypatch):
    counted = []
    original = DeviceChecks.raise_if_failed

    def counting(self):
        counted.append(self)
        return original(self)

    monkeypatch.setattr(DeviceChecks, "raise_if_failed", counting)
    return counted


@pytest.mark.pins_native
def test_gradient_sync_reads_a_steps_checks_once(reads, monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "0")  # the device path: checks are deferred
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    sync = GradientSync(model, local_session(make_codec("thc", workers=1)))  # 4 groups
    try:
        for _ in range(2):
            model(torch.randn(8, 64)).square().mean().backward()
            sync.wait()
        assert len(reads) == 2  # one a step, for 4 groups' rounds

        x = torch.randn(8, 64)
        x[2, 5] = float("nan")  # the first layer's weight gradient: NaN in column 5
        model(x).square().mean().backward()  # every round completes: nothing raised yet
        with pytest.raises(NonFiniteGradientError, match="NaN or Inf"):
            sync.wait()
        assert len(reads) == 3
    finally:
        sync.close()
