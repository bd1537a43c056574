"""Local steps from a user's own loop (``gradsum.sync.LocalStepsSync``, the README's snippet):
the same rounds as ``gradsum train --local-steps``, over real processes and a Gloo group."""

from types import SimpleNamespace

import pytest
import torch

from gradsum.sync.local_steps import LocalStepsSync, _taken_decay

from .distributed import run_distributed
from .workers import train_with_gradient_sync, train_with_local_steps


@pytest.mark.slow
def test_one_local_step_per_round_from_a_users_loop_is_data_parallel_training_bit_for_bit():
    """h=1, outer SGD at 1 without momentum, inner SGD at 1/8: every step's THC round averages
    the same gradients, scaled by a power of two, as plain data parallel's; h=2 does not."""
    steps, lr = 6, 0.125
    plain = run_distributed(train_with_gradient_sync, 2, "thc", steps, None, lr)
    local = run_distributed(train_with_local_steps, 2, "thc", steps, "diloco(h=1,lr=1,momentum=0)",
                            lr)  # fmt: skip
    for rank in (0, 1):
        assert torch.equal(local[rank]["after"], plain[rank]["snapshots"][-1])
    every_other = run_distributed(train_with_local_steps, 2, "thc", steps,
                                  "diloco(h=2,lr=1,momentum=0)", lr)  # fmt: skip
    assert not torch.equal(every_other[0]["after"], plain[0]["snapshots"][-1])


@pytest.mark.slow
def test_close_leaves_every_worker_at_the_same_synced_weights_with_a_round_in_flight():
    """The bug it fears: a run that ends mid-round leaves each worker's model at its own local
    weights (its own batches' steps), so the model a user saves differs by rank."""
    spec = "diloco(h=2,lr=0.7,momentum=0.9,overlap=1)"  # 4 steps: the second round in flight
    first, second = run_distributed(train_with_local_steps, 2, "thc", 4, spec, 0.1, 0.01)
    assert first["in_flight"] and second["in_flight"]
    assert not torch.equal(first["before"], second["before"])  # each worker's own steps
    assert torch.equal(first["after"], second["after"])
    assert torch.equal(first["after"], first["start"])
    # the inner SGD's coupled decay, applied to the weights instead of the accumulators
    assert first["decay"] == (0.01, None) and first["inner_decay"] == [0.0]


def test_the_inner_optimizers_weight_decay_moves_to_the_weights():
    """AdamW's decay is decoupled at its learning rate, SGD's coupled into the gradient, and
    the optimizer itself keeps none (it steps the round's accumulators, not the weights)."""
    tensors = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    adamw = torch.optim.AdamW(tensors, lr=1e-3, weight_decay=0.1)
    assert _taken_decay(adamw) == (0.1, 1e-3)
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.0]
    sgd = torch.optim.SGD(tensors, lr=0.1, weight_decay=0.01)
    assert _taken_decay(sgd) == (0.01, None)
    assert _taken_decay(torch.optim.SGD(tensors, lr=0.1)) == (0.0, None)
    mixed = torch.optim.SGD([{"params": tensors[:1], "weight_decay": 0.01},
                             {"params": tensors[1:]}], lr=0.1)  # fmt: skip
    with pytest.raises(ValueError, match=r"weight decays \[0.0, 0.01\]"):
        _taken_decay(mixed)


def test_a_sync_that_sends_during_backward_is_refused():
    sync = SimpleNamespace(on_backward=True, parameters=[], groups=[])
    with pytest.raises(ValueError, match="build it with on_backward=False"):
        LocalStepsSync(sync, "diloco(h=2)", lambda acc: torch.optim.SGD(acc, lr=0.1))


class _OwnAverage:
    """A sync of one worker: every round's average is what the worker sent."""

    on_backward = False

    def __init__(self, parameters):
        self.parameters, self.groups, self.step = parameters, [[0], [1]], 0

    def release(self, tensors=None, groups=None):
        self.step += 1

    def wait(self):
        pass

    def uncompressed(self):
        import contextlib

        return contextlib.nullcontext()


def test_a_parameter_backward_does_not_reach_has_a_zero_gradient():
    """As DDP's find_unused_parameters: the round still carries it, and it does not move."""
    used, unused = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    local = LocalStepsSync(_OwnAverage([used, unused]), "diloco(h=2,lr=1,momentum=0)",
                           lambda acc: torch.optim.SGD(acc, lr=0.5))  # fmt: skip
    for g in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.5, 0.5])):
        used.grad = g.clone()
        local.step()
        used.grad, unused.grad = None, None
    assert torch.equal(used.detach(), 1 - 0.5 * torch.tensor([1.5, 2.5, 3.5]))
    assert torch.equal(unused.detach(), torch.ones(2)) and local.state.rounds == 1
