"""A THC round makes no host sync: its scalars stay 0-d device tensors, its checks one device
flag that the caller reads once, its widths hold by construction.

Counted with the shim of tests/host_syncs.py on the torch path (GRADSUM_NATIVE=0), which is the
path a GPU runs; the CPU's native kernels take Python floats, which on the CPU waits for nothing.
"""

import math

import pytest
import torch

from gradsum.codecs import make_codec
from gradsum.codecs.base import DeviceChecks, NonFiniteGradientError
from gradsum.codecs.round import PARTITION_ELEMENTS, CodecRound

from ..host_syncs import count_host_syncs
from .conftest import OneWorker

LENGTH = PARTITION_ELEMENTS + 12_345  # a whole 2**20 partition and a ragged one


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "0")


def test_the_shim_counts_every_kind_of_host_read():
    x = torch.arange(4.0)
    with count_host_syncs() as syncs:
        x[0].item(), x.tolist(), x.numpy(), x.cpu(), x.to("cpu")
        bool(x[1]), float(x[1]), int(x[1]), torch.equal(x, x), x.nonzero(), x[x > 1]
        x.to(torch.float64), x + 1, torch.isfinite(x).all()  # none of these reads a value
    assert syncs.count == 11, syncs.calls


def test_the_shim_sees_an_eager_check(torch_path):
    codec = make_codec("thc", workers=1, error_feedback=False)
    with count_host_syncs() as syncs:
        codec.summarize(torch.randn(1000), None)  # no deferring round: checked at once
    assert syncs.count >= 1


@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
def test_a_thc_round_makes_no_host_sync(torch_path, name):
    codec = make_codec(name, workers=1)  # thc with its (rotated-domain) error feedback
    round_ = CodecRound(codec, seed=3)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(LENGTH, generator=generator) for _ in range(2)]
    round_.run(grads[0], OneWorker(), worker=0, key="b", step=0)  # builds tables and rotations
    checks = DeviceChecks()
    with count_host_syncs() as syncs:
        average = round_.run(grads[1], OneWorker(), worker=0, key="b", step=1, checks=checks)
    assert syncs.calls == []
    with count_host_syncs() as syncs:
        checks.raise_if_failed()
    assert syncs.count == 1  # the round's one read: its flag
    error = (average - grads[1]).norm() / grads[1].norm()
    assert error < 0.5 if name == "thc" else error < 1.5  # a real estimate came back


@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_deferred_check_still_names_the_coordinate(torch_path, name, bad):
    x = torch.randn(5000)
    x[4321] = bad
    checks = DeviceChecks()
    CodecRound(make_codec(name, workers=1)).run(x, OneWorker(), worker=0, key="b", step=0,
                                                checks=checks)  # fmt: skip
    with pytest.raises(NonFiniteGradientError, match=r"\[4321\]"):
        checks.raise_if_failed()


def test_an_overflowing_norm_takes_float64_on_the_device_path(torch_path):
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(4)) * (2e38 / 256)
    checks = DeviceChecks()
    with checks.deferring():
        norm = make_codec("thc", workers=1).summarize(x, None)
    checks.raise_if_failed()
    assert 1e38 < float(norm) < torch.finfo(torch.float32).max
