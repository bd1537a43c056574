"""GradientSync averages gradients whatever their memory layout (channels-last, transposed)."""

import copy
import threading

import pytest
import torch

from gradsum.schedule import ClusterSpec, LayerProfile, ModelProfile, make_planner
from gradsum.sync.gradient_sync import GradientSync, row_major_blocks

from .fakes import answering_session


class _TwoWorkers:
    """An aggregator shared by two simulated workers in one process: both calls of a transfer
    (same key and step) meet here and both return the mean of the two tensors."""

    def __init__(self, timeout: float = 30.0):
        self.timeout = timeout
        self._changed = threading.Condition()
        self._meetings: dict = {}

    def __call__(self, flat, *, key, step, shard):
        slot = (key, step)
        with self._changed:
            if slot in self._meetings:  # second worker: the first one waits for this mean
                first = self._meetings[slot]
                first["mean"] = (first["tensor"] + flat) / 2
                self._changed.notify_all()
                return first["mean"].clone()
            meeting = self._meetings[slot] = {"tensor": flat.clone(), "mean": None}
            if not self._changed.wait_for(lambda: meeting["mean"] is not None, self.timeout):
                raise TimeoutError(f"transfer {slot} waited {self.timeout} s for the other worker")
            return self._meetings.pop(slot)["mean"]


class _ChannelsLastNet(torch.nn.Module):
    """A convolution (channels-last once the model is converted) feeding a weight stored
    transposed, so two of its three gradients are not contiguous in row-major order."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Parameter(torch.randn(5, 64).t())  # shape (64, 5), strides (1, 64)

    def forward(self, x):
        return torch.relu(self.conv(x)).flatten(1) @ self.head


def _workers():
    torch.manual_seed(0)
    model = _ChannelsLastNet().to(memory_format=torch.channels_last)
    inputs = [torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(r)) for r in (1, 2)]
    inputs = [x.to(memory_format=torch.channels_last) for x in inputs]
    return [model, copy.deepcopy(model)], inputs


def _backward(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()


def _slicing_plan(parameters, slice_elements):
    """Priority slices of ``slice_elements``: groups that cut tensors mid-row, one layer per
    parameter in backward order (last parameter first)."""
    count = len(parameters)
    layers = tuple(
        LayerProfile(f"p{i}", parameters[i].numel(), 1e-3, 0.0, (i,))
        for i in reversed(range(count))
    )
    profile = ModelProfile("channels-last", layers)
    planner = make_planner("priority", slice_elements=slice_elements)
    return planner(profile, ClusterSpec(workers=2, shards=2))


@pytest.mark.parametrize("grouping", ["one group per parameter", "slices across tensors"])
def test_non_contiguous_gradients_are_averaged_in_place(grouping):
    models, inputs = _workers()
    expected = []
    for model, x in zip(models, inputs, strict=True):
        _backward(model, x)
        expected.append([p.grad.clone() for p in model.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected, strict=True)]
    conv_weight, head = models[0].conv.weight, models[0].head
    assert not conv_weight.grad.is_contiguous()  # channels-last: the case this test is about
    assert conv_weight.grad.is_contiguous(memory_format=torch.channels_last)
    assert not head.grad.is_contiguous()

    meeting = _TwoWorkers()
    plan = (
        _slicing_plan(list(models[0].parameters()), 7)
        if grouping == "slices across tensors"
        else None
    )
    syncs = [GradientSync(m, answering_session(meeting), plan=plan, timeout=30) for m in models]
    try:
        for model, x in zip(models, inputs, strict=True):  # sends run on the senders' threads
            _backward(model, x)
        for sync in syncs:
            sync.wait()
    finally:
        for sync in syncs:
            sync.close()
    for model in models:
        for (name, p), want in zip(model.named_parameters(), mean, strict=True):
            assert torch.equal(p.grad, want), f"{name}: the average did not reach param.grad"
        assert not model.conv.weight.grad.is_contiguous(), "the layout must be left as it was"


def test_contiguous_gradients_are_sent_without_a_copy():
    grad = torch.randn(4, 6)
    (block,) = row_major_blocks(grad, 5, 17)
    assert block.data_ptr() == grad.view(-1)[5:].data_ptr()  # a view: the average lands in place


@pytest.mark.parametrize("seed", range(20))
def test_row_major_blocks_are_views_covering_exactly_the_range(seed):
    generator = torch.Generator().manual_seed(seed)
    shape = torch.randint(1, 5, (int(torch.randint(1, 5, (1,), generator=generator)),),
                          generator=generator).tolist()  # fmt: skip
    permutation = torch.randperm(len(shape), generator=generator).tolist()
    base = torch.arange(float(torch.tensor(shape).prod())).view(shape)
    tensor = base.permute(permutation)  # any memory order: strides are a permutation of base's
    start, stop = sorted(torch.randint(0, tensor.numel() + 1, (2,), generator=generator).tolist())
    blocks = row_major_blocks(tensor, start, stop)
    flat = torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.empty(0)
    assert torch.equal(flat, tensor.reshape(-1)[start:stop])
    assert len(blocks) <= max(1, 2 * tensor.dim() - 1)
    for block in blocks:  # views of the tensor: writing into them writes the gradient
        assert block.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    for block in blocks:
        block.fill_(-1)
    marked = (tensor.reshape(-1) == -1).nonzero().flatten().tolist()
    assert marked == list(range(start, stop))


def _doubled(flat, **_):
    """One worker's 'average' that doubles, so every write-back shows."""
    return flat * 2


class _WithEmptyParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.empty = torch.nn.Parameter(torch.empty(0, 4).t())

    def forward(self, x):
        return self.linear(x) + self.empty.sum()


def test_an_empty_parameter_is_a_group_of_its_own():
    model = _WithEmptyParameter()
    model(torch.ones(1, 3)).sum().backward()
    expected = [p.grad.clone() * 2 for p in model.parameters()]
    model.zero_grad()
    sync = GradientSync(model, answering_session(_doubled), timeout=30)
    try:
        model(torch.ones(1, 3)).sum().backward()
        sync.wait()
    finally:
        sync.close()
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad, want)
