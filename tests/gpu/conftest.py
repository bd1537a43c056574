"""tests/gpu: what only a CUDA device shows. Every test here is marked ``gpu`` and skipped
without one (CI and the development machine have none); ``python -m gradsum.bench.gpu_check``
runs them with the GPU benchmarks."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
