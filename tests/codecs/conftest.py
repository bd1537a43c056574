from dataclasses import replace

import pytest
import torch

from gradsum.codecs import CODEC_NAMES


def gaussian_inputs(workers: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(length, generator=generator) for _ in range(workers)]


@pytest.fixture(params=CODEC_NAMES)
def codec_name(request):
    return request.param


@pytest.fixture
def both(monkeypatch):
    """both(fn) -> (fn() on the native path, fn() on the torch path)."""

    def run(fn):
        monkeypatch.setenv("GRADSUM_NATIVE", "1")
        fast = fn()
        monkeypatch.setenv("GRADSUM_NATIVE", "0")
        slow = fn()
        monkeypatch.setenv("GRADSUM_NATIVE", "1")
        return fast, slow

    return run


class OneWorker:
    """A reducer of one worker, in process: MAX and SUM of one; ``counted``: the sums come back
    with a contributor count per lane, as a switch's partial aggregation delivers them."""

    def __init__(self, counted: bool = False):
        self.counted = counted

    def max(self, summaries):
        return list(summaries)

    def sum(self, phase):
        for i in reversed(range(len(phase))):  # any order
            summed = phase.codec.aggregate([phase.encode(i)], phase.aggregator_context(i))
            if self.counted:
                counts = torch.ones(phase.lanes(i))
                summed = replace(summed, contributors=1, counts=counts)
            phase.deliver(i, summed)
