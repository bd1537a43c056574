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
