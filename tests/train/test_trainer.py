"""The one training loop (train/trainer.py): its stopping rules and evaluations, and that a
real worker's run (`gradsum train`, `bench train`, `bench tta`) and `bench scale`'s simulated
workers both take their steps through it."""

import pytest
import torch

from gradsum.train.trainer import EvaluationTimeout, Report, Schedule, Trainer


class _Replicas:
    """Steps whose loss is whatever ``losses`` says next."""

    agreement_lag = 0

    def __init__(self, losses=None):
        self.step, self.losses = 0, iter(losses or [])

    def forward(self, inputs, labels):
        return torch.tensor(next(self.losses, 1.0)), None

    def agree(self, loss, stop):
        return float(loss), stop

    def backward(self, loss):
        self.step += 1

    def gradients_finite(self):
        return True

    zero_grad = apply = lambda self: None


class _Batches:
    def __init__(self, per_epoch):
        self.per_epoch = per_epoch

    def epoch(self, epoch):
        return [(torch.zeros(1), torch.zeros(1))] * self.per_epoch

    def prepare(self, inputs, labels):
        return inputs, labels


class _Recorded(Report):
    def __init__(self, losses=()):
        self.events, self.losses = [], iter(losses)

    def begin_epoch(self, epoch):
        self.events.append(("begin", epoch))

    def end_epoch(self, epoch, durations):
        self.events.append(("end", epoch, len(durations)))

    def evaluate(self, step, clock):
        self.events.append(("eval", step))
        return next(self.losses, 9.0)


def test_by_epochs_the_report_sums_up_each_epoch_from_the_first_one_not_yet_trained():
    report = _Recorded()
    schedule = Schedule(epochs=3, first_epoch=1)
    trainer = Trainer(_Replicas(), _Batches(4), report, schedule).run()
    assert trainer.count == 8
    assert report.events == [("begin", 1), ("end", 1, 4), ("begin", 2), ("end", 2, 4)]


def test_by_steps_it_evaluates_at_the_start_every_k_steps_and_at_max_steps_across_epochs():
    report = _Recorded()
    schedule = Schedule(max_steps=7, eval_every=3)
    trainer = Trainer(_Replicas(), _Batches(4), report, schedule).run()
    assert trainer.count == 7
    evals = [event[1] for event in report.events if event[0] == "eval"]
    assert evals == [0, 3, 6, 7]


def test_reaching_the_target_loss_stops_at_the_next_step_without_taking_it():
    report = _Recorded(losses=[5.0, 3.0, 1.0])  # at steps 0, 2, 4
    schedule = Schedule(max_steps=100, eval_every=2, target_loss=2.0)
    trainer = Trainer(_Replicas(), _Batches(50), report, schedule).run()
    assert trainer.count == 4
    assert [event[1] for event in report.events if event[0] == "eval"] == [0, 2, 4]


class _Lagging(_Replicas):
    """Replicas whose agreement arrives a step late (local steps')."""

    agreement_lag = 1

    def __init__(self, losses=None):
        super().__init__(losses)
        self.last = None
        self.asked = []  # each step's request to stop, as launched

    def agree(self, loss, stop):
        last, self.last = self.last, (float(loss), stop)
        self.asked.append(stop)
        return (None, False) if last is None else last


def test_an_agreement_a_step_late_stops_a_step_later_and_the_guard_names_the_losss_step():
    report = _Recorded(losses=[5.0, 3.0, 1.0])  # at steps 0, 2, 4
    schedule = Schedule(max_steps=100, eval_every=2, target_loss=2.0)
    replicas = _Lagging()
    trainer = Trainer(replicas, _Batches(50), report, schedule).run()
    assert trainer.count == 5  # asked after step 4, agreed with step 5's loss, stopped at 6
    assert replicas.asked == [False] * 4 + [True, True]

    from gradsum.train.guard import DivergenceError, DivergenceGuard

    guard = DivergenceGuard("local", factor=3.0, warmup=5, patience=1)
    losses = [2.0] * 6 + [100.0] + [2.0] * 10  # step 7's loss jumps
    trainer = Trainer(_Lagging(losses), _Batches(50), Report(), Schedule(max_steps=20),
                      guard=guard)  # fmt: skip
    with pytest.raises(DivergenceError, match=r"at step 8 .*\(the loss of step 7\)"):
        trainer.run()
    assert trainer.count == 7


class _TimingOut(_Replicas):
    """Replicas whose agreement number ``at`` fails as a collective that timed out does."""

    def __init__(self, at, lag=0):
        super().__init__()
        self.at, self.agreements, self.agreement_lag = at, 0, lag

    def agree(self, loss, stop):
        self.agreements += 1
        if self.agreements - 1 == self.at:
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                               "120000ms for recv operation to complete")  # fmt: skip
        return float(loss), stop


@pytest.mark.parametrize("at, lag, explained", [(3, 0, True), (2, 0, False), (4, 0, False),
                                                (4, 1, True), (5, 1, False)],
                         ids=["after-an-evaluation", "before", "a-step-later",
                              "lagging-a-step-later", "lagging-two-steps-later"])  # fmt: skip
def test_a_timeout_in_the_step_after_an_evaluation_says_worker_0_was_evaluating(at, lag,
                                                                                explained):
    """The other workers wait for worker 0's evaluation in the next step's agreement (under
    local steps, whose agreements lag a step, the one after): a timeout there names the
    evaluation and the flags that bound it, not only Gloo's words; a timeout anywhere else is
    left as it was."""
    schedule = Schedule(max_steps=7, eval_every=3)  # evaluates at steps 0, 3 and 6
    trainer = Trainer(_TimingOut(at, lag), _Batches(10), _Recorded(), schedule)
    with pytest.raises(RuntimeError) as raised:
        trainer.run()
    if explained:
        assert isinstance(raised.value, EvaluationTimeout)
        assert "after the evaluation at step 3" in str(raised.value)
        assert "--eval-samples" in str(raised.value) and "--timeout" in str(raised.value)
        assert "Timed out waiting" in str(raised.value.__cause__)
    else:
        assert not isinstance(raised.value, EvaluationTimeout)
        assert "Timed out waiting" in str(raised.value)


def test_a_step_based_run_evaluates_a_bounded_number_of_samples_by_default():
    """All of stdlib's validation took a GPT longer than the collectives' timeout on one core
    (the README's GPT command failed at its first evaluation on a 2-core machine)."""
    from gradsum.train.config import TrainConfig

    config = TrainConfig(model="gpt", dataset="stdlib", max_steps=10)
    assert config.eval_samples is not None and config.eval_samples <= 1024


def test_an_epoch_without_a_batch_is_an_error():
    with pytest.raises(ValueError, match="without a batch"):
        Trainer(_Replicas(), _Batches(0), Report(), Schedule(epochs=1)).run()


@pytest.fixture
def counted_steps(monkeypatch):
    """Every step any entry point takes, counted at the Trainer."""
    counted = []
    step = Trainer.step

    def counting(self, *args, **kwargs):
        counted.append(type(self.replicas).__name__)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "step", counting)
    return counted


@pytest.mark.parametrize(
    "fields", [{"epochs": 1}, {"max_steps": 3, "eval_every": 3}], ids=["epochs", "steps"]
)
def test_a_real_worker_steps_through_the_trainer(counted_steps, gloo_world_of_one, fields):
    """What `gradsum train`, `bench train` and `bench tta` run in each worker."""
    from gradsum.train import loop
    from gradsum.train.config import TrainConfig

    config = TrainConfig(
        model="digits-mlp",
        aggregator="allreduce",
        codec="thc",
        workers=1,
        batch_size=256,
        progress=False,
        **fields,
    )
    summary = loop.train_worker(config, 0, 1)
    assert counted_steps and set(counted_steps) == {"Worker"}
    assert summary["steps"] == len(counted_steps)


def test_bench_scale_steps_its_simulated_workers_through_the_trainer(counted_steps):
    from gradsum.bench.scale import ScaleSetup, train_simulated

    setup = ScaleSetup(
        steps=2,
        global_batch=4,
        layers=1,
        width=16,
        heads=2,
        context=8,
        eval_every=2,
        eval_samples=8,
        data_bytes=1 << 14,
    )
    row = train_simulated("thc", 2, setup)
    assert counted_steps == ["SimulatedWorkers"] * 2
    assert [e["step"] for e in row.evals] == [0, 2]
