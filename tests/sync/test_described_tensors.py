"""Codecs that work per tensor learn the tensors of every flat buffer they are handed."""

import torch

from gradsum.codecs import make_codec
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.session import Session

from .fakes import Alone, Reducing


def test_gradient_sync_describes_each_group_by_its_parameters_shapes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))
    codec = make_codec("powersgd", workers=1, rank=2)
    sync = GradientSync(model, Session(codec, Reducing(Alone)), groups=[[0, 1, 2, 3]])
    model(torch.randn(8, 40)).sum().backward()
    sync.wait()
    sync.close()
    shapes = [tuple(p.shape) for p in model.parameters()]
    key = ("group", 0, sum(p.numel() for p in model.parameters()))
    assert codec.partitions(key, key[2], 1 << 20) == [(0, 1200), (1200, 1230), (1230, 1380),
                                                       (1380, 1385)]  # fmt: skip
    assert shapes[0] == (30, 40) and shapes[2] == (5, 30)
    # each weight is a partition of its own, with its own error feedback; the biases are sent
    # as they are and keep none
    assert sorted(m.numel() for m in codec.memory.values()) == [150, 1200]
