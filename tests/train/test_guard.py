"""The divergence guard: a non-finite loss or gradient, or a loss jump past its factor, stops
training naming the step and the method; with --fallback none the step is retried through the
aggregator's lossless codec and counted."""

import math

import pytest
import torch

from gradsum.codecs import make_codec
from gradsum.sync.aggregator import Channel
from gradsum.sync.allreduce import AllReduceAggregator
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.session import Session
from gradsum.train.config import TrainConfig
from gradsum.train.guard import DivergenceError, DivergenceGuard
from gradsum.train.loop import Worker, _gradients_finite
from gradsum.train.models import build_model
from gradsum.train.trainer import Report, Schedule, Trainer


def test_the_guard_names_non_finite_losses_and_jumps_past_its_factor():
    guard = DivergenceGuard("switch:thc", factor=3.0, warmup=5, patience=1)  # one step decides
    assert guard.loss_problem(float("nan")) == "the loss is nan"
    assert guard.loss_problem(float("inf")) == "the loss is inf"
    for _ in range(4):
        guard.accept(2.0)
    assert guard.loss_problem(100.0) is None  # too few losses for a running mean yet
    guard.accept(2.0)
    assert guard.loss_problem(5.9) is None
    problem = guard.loss_problem(6.1)
    assert problem.startswith("the loss jumped to 6.1, 3.0x its running mean 2")
    error = guard.diverged(17, problem)
    assert "at step 17 with switch:thc" in str(error) and "--fallback none" in str(error)
    assert guard.gradient_problem(False) == "the averaged gradient is not finite"
    assert not guard.should_retry(problem)
    retrying = DivergenceGuard("ddp:fp16", fallback="none")
    assert retrying.should_retry(problem) and not retrying.should_retry("the loss is nan")
    assert DivergenceGuard("x", factor=math.inf).loss_problem(1e30) is None
    with pytest.raises(ValueError, match="--fallback"):
        DivergenceGuard("x", fallback="fp32")
    with pytest.raises(ValueError, match="must exceed 1"):
        DivergenceGuard("x", factor=0.5)


class _Corrupting(AllReduceAggregator):
    """All-reduce whose compressed rounds return infinities at the given steps (as a codec whose
    decode overflowed would); lossless rounds stay exact."""

    def __init__(self, bad_steps):
        super().__init__()
        self.bad_steps, self.codecs_seen = set(bad_steps), []

    def connect(self, wire):
        return _CorruptingChannel(self)


class _CorruptingChannel(Channel):
    def __init__(self, aggregator: _Corrupting):
        super().__init__([aggregator])
        self.aggregator = aggregator

    def run(self, round_, flat, *, worker, key, step, shard=None):
        codec = round_.codec
        self.aggregator.codecs_seen.append((step, codec.name))
        average = super().run(round_, flat, worker=worker, key=key, step=step, shard=shard)
        if codec.name != "none" and step in self.aggregator.bad_steps:
            return torch.full_like(average, math.inf)
        return average


def _trainer(net, model, optimizer, sync, guard) -> Trainer:
    """The one training loop around a real worker, to take its steps one by one."""
    return Trainer(Worker(net, model, optimizer, sync), None, Report(), Schedule(), guard=guard)


def _steps(fallback, bad_steps, count=6):
    torch.manual_seed(0)
    model = build_model("digits-mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    aggregator = _Corrupting(bad_steps)
    sync = GradientSync(model, Session(make_codec("thc", workers=1), aggregator))
    guard = DivergenceGuard("allreduce:thc", fallback=fallback)
    trainer = _trainer(model, model, optimizer, sync, guard)
    inputs = torch.rand(16, 64, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(16) % 10
    try:
        losses = [float(trainer.step(inputs, labels)[0]) for _ in range(count)]
    finally:
        sync.close()
    return losses, guard, aggregator, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_finiteness_check_finds_one_bad_entry_anywhere_and_passes_large_finite_ones(dtype):
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 3)).to(dtype)
    for p in model.parameters():
        p.grad = torch.full_like(p, torch.finfo(dtype).max / 4)  # finite; fp16's sum would not be
    assert _gradients_finite(model)
    for bad in (math.nan, math.inf, -math.inf):
        for p, where in ((model[0].weight, (999, 17)), (model[1].bias, (2,))):
            p.grad[where] = bad
            assert not _gradients_finite(model), (bad, where)
            p.grad[where] = 1.0
    assert _gradients_finite(torch.nn.Linear(2, 2))  # no gradients yet


def test_a_non_finite_gradient_stops_training_naming_the_step_and_method(gloo_world_of_one):
    with pytest.raises(DivergenceError, match=r"at step 3 with allreduce:thc: the averaged "
                       r"gradient is not finite; --fallback none retries"):  # fmt: skip
        _steps("stop", bad_steps={2})


def test_fallback_none_retries_the_step_uncompressed_and_counts_it(gloo_world_of_one):
    losses, guard, aggregator, model = _steps("none", bad_steps={1, 4})
    assert guard.fallbacks == 2
    # the two bad compressed rounds were each followed by a lossless one (GradientSync's step
    # advances with every round: compressed 0, 1, lossless 2, compressed 3, 4, lossless 5, ...)
    names = [name for _, name in aggregator.codecs_seen]
    assert names.count("none") == 2 * len(list(model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]  # same batch: it is being fitted


@pytest.mark.slow  # DDP's start-up: 10-26 s on the loaded 2-core machine
def test_a_loss_jump_under_ddp_is_retried_outside_its_hook_and_counted(gloo_world_of_one):
    """DDP's step is taken again under ``no_sync`` (its forward already ran with the hook armed)
    and averaged in fp32 by hand; training goes on through the hook afterwards."""
    from gradsum.train.peers import DDPSync

    torch.manual_seed(0)
    model = build_model("digits-mlp")
    sync = DDPSync(model, TrainConfig(aggregator="ddp", ddp_hook="fp16"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = DivergenceGuard("ddp:fp16", factor=3.0, fallback="none", warmup=3)
    trainer = _trainer(sync.net, model, optimizer, sync, guard)
    inputs = torch.rand(16, 64, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(16) % 10
    for _ in range(4):
        trainer.step(inputs, labels)
    assert guard.fallbacks == 0
    optimizer.param_groups[0]["lr"] = 0.0  # (that step's update would wreck the next ones)
    trainer.step(inputs * 400.0, labels)  # a batch whose loss is far above the running mean
    optimizer.param_groups[0]["lr"] = 0.05
    assert guard.fallbacks == 1
    for _ in range(2):
        trainer.step(inputs, labels)
    assert guard.fallbacks == 1 and trainer.count == 7 and sync.step == 7
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_one_noisy_batch_near_convergence_is_not_divergence_but_a_rise_that_holds_is():
    """The fp32 run that stopped at step 253: a mean of 0.06 and one batch at 0.24."""
    guard = DivergenceGuard("allreduce:none", compressed=False)
    noisy = [0.05, 0.07, 0.04, 0.08, 0.06] * 10
    for loss in noisy:
        assert guard.loss_problem(loss) is None
        guard.accept(loss)
    for spike in (0.24, 0.5, 0.9):  # one at a time, healthy steps between
        assert guard.loss_problem(spike) is None
        guard.accept(spike)
        for loss in noisy[:4]:
            assert guard.loss_problem(loss) is None
            guard.accept(loss)
    assert guard.jumps == 3 and guard.running_mean < 0.07  # the spikes stay out of the mean
    # a rise that holds: the third step past 3x the mean moves the median of five past it too
    problems = []
    for loss in (0.8, 0.9, 1.0):
        problems.append(guard.loss_problem(loss))
        guard.accept(loss)
    assert problems[:2] == [None, None]
    assert problems[2].startswith("the loss rose to 1; the median of the last 5 steps, 0.8")
    error = str(guard.diverged(260, problems[2]))
    assert "--fallback none" not in error and "a lower --lr" in error  # nothing to decompress


def test_a_compressed_run_with_fallback_none_retries_a_single_jump():
    guard = DivergenceGuard("switch:thc", fallback="none", warmup=3)
    for _ in range(3):
        guard.accept(2.0)
    assert guard.loss_problem(6.5).startswith("the loss jumped to 6.5, 3.2x")
    uncompressed = DivergenceGuard("switch:bfp", fallback="none", warmup=3, compressed=False)
    for _ in range(3):
        uncompressed.accept(2.0)
    assert uncompressed.loss_problem(6.5) is None  # a retry through bfp again changes nothing


def test_which_methods_compress():
    from gradsum.train.methods import compresses

    assert not compresses(TrainConfig(aggregator="ddp"))
    assert compresses(TrainConfig(aggregator="ddp", ddp_hook="fp16"))
    assert not compresses(TrainConfig(aggregator="allreduce", codec="none"))
    assert not compresses(TrainConfig(aggregator="switch", codec="bfp"))
    assert compresses(TrainConfig(aggregator="switch", codec="thc"))
