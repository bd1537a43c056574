"""Start-up's shell (``sync/startup.py``): timed transfers through a Session, the step's load,
host probes, and every worker following worker 0 to one plan."""

import os
import threading
import time
from typing import ClassVar

import pytest
import torch

from gradsum.schedule import AlphaBeta
from gradsum.schedule.calibration import (
    CALIBRATION_ATTEMPTS,
    COST_FREE,
    DEFAULT_COST,
    CostModel,
    calibration_sizes,
    cluster_from_fit,
    judge_calibration,
)
from gradsum.sync import startup
from gradsum.sync.startup import agree_on_plan, calibrate

from ..schedule.test_calibration import BROKEN, STALLED, TRUTH, _round
from .distributed import run_distributed
from .fakes import answering_session
from .plan_workers import calibrate_over_allreduce
from .workers import tiny_model


def test_transfers_take_turns_so_drifting_load_does_not_tilt_the_slope():
    """Each transfer takes 1 ms longer than the last, whatever its size: a slope timing each
    size in a block would read as 5 ms per 20 KB."""
    sent = []

    def send(tensor):
        sent.append(tensor.numel())
        time.sleep(1e-3 * len(sent))

    sizes = calibration_sizes(6_090)
    samples = startup.time_transfers(send, sizes)
    assert sent[:2] == [1_024, 6_090]  # the warm-up, untimed
    assert sent[2:] == [1_024, 6_090, 6_090, 1_024] * 2 + [1_024, 6_090]
    assert [b for b, _ in samples] == [4.0 * n for n in sent[2:]]
    cost = judge_calibration([samples])
    assert "per-message cost dominates" in cost.reason


def _untouched(*_, **__):
    raise AssertionError("calibration sent a transfer for a policy that needs no cost model")


def _untouchable():
    """A Session no transfer may reach."""
    return answering_session(_untouched)


@pytest.mark.parametrize("scheduler", sorted(COST_FREE))
def test_policies_that_need_no_cost_model_do_not_calibrate(scheduler):
    chosen = agree_on_plan(scheduler, tiny_model(), torch.randn(8, 20), _untouchable())
    assert chosen.cost == CostModel(None, "not needed", chosen.cost.reason)
    assert chosen.plan.policy == scheduler
    assert f"no α–β calibration ({scheduler} plans from element counts alone)" in chosen.describe()


class _Canned:
    """Stands in for ``time_transfers``: each call sends once per size and returns the next
    prepared round of timings."""

    def __init__(self, rounds):
        self.rounds = list(rounds)

    def __call__(self, send, sizes):
        for size in sizes:
            send(torch.zeros(size))
        return self.rounds.pop(0)


class _Recorder:
    """The keys and steps of a Session's rounds (``session``), each answered with its input."""

    def __init__(self):
        self.keys = []
        self.session = answering_session(self)

    def __call__(self, tensor, *, key, step, shard):
        self.keys.append((key, step))
        return tensor


def test_calibrate_measures_again_through_the_aggregator_until_a_fit_is_usable(monkeypatch):
    canned = _Canned([STALLED, _round(), _round()])
    monkeypatch.setattr(startup, "time_transfers", canned)
    recorder = _Recorder()
    cost = calibrate(recorder.session)
    assert cost.source == "refitted"
    assert len(canned.rounds) == 1  # two rounds measured, the third not needed
    steps = [step for _, step in recorder.keys]
    assert steps == list(range(len(steps))) and len(steps) == 6  # one new step per transfer


class _CountedForward(torch.nn.Module):
    """A model whose forward passes, by any copy of it, are counted with their thread (the
    list is the class's: a deep copy shares it)."""

    passes: ClassVar[list[tuple[int, str]]] = []

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(20, 4)

    def forward(self, x):
        _CountedForward.passes.append((id(self), threading.current_thread().name))
        return self.layer(x)


def test_the_step_load_runs_a_copy_beside_the_block_and_stops_after_it():
    model = _CountedForward()
    _CountedForward.passes.clear()
    with startup.step_load(model, torch.randn(8, 20)):
        deadline = time.monotonic() + 10.0
        while len(_CountedForward.passes) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    ran = list(_CountedForward.passes)
    assert len(ran) >= 3  # forward and backward, again and again, while the block ran
    assert all(who != id(model) and thread == "gradsum-calibration-load" for who, thread in ran)
    time.sleep(0.05)
    assert len(_CountedForward.passes) == len(ran)  # stopped with the block
    assert model.layer.weight.grad is None  # the user's model is left alone


def test_the_step_load_runs_the_4m_parameter_model_and_leaves_it_untouched():
    from gradsum.train.models import build_model

    model = build_model("digits-wide")  # 4,349,962 parameters, as the testbed map trains
    before = [p.detach().clone() for p in model.parameters()]
    passes = []  # the copy keeps the hook (a deep copy shares the list): its passes land here
    model.register_forward_hook(lambda module, *_: passes.append(id(module)))
    with startup.step_load(model, torch.randn(16, 64)):
        deadline = time.monotonic() + 60.0
        while len(passes) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(passes) >= 2, "the step load ran no two passes of the model in 60 s"
    assert id(model) not in passes  # a copy ran them
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_the_step_load_ran_while_calibration_measured(monkeypatch):
    seen = []

    def timed(send, sizes):
        seen.append(any(t.name == "gradsum-calibration-load" for t in threading.enumerate()))
        return _round()

    monkeypatch.setattr(startup, "time_transfers", timed)
    model = tiny_model()
    cost = calibrate(_Recorder().session,
                     load=lambda: startup.step_load(model, torch.randn(8, 20)))  # fmt: skip
    assert cost.source == "fitted" and seen == [True]
    assert "(fitted under the step's load)" in cost.describe()
    assert not any(t.name == "gradsum-calibration-load" for t in threading.enumerate())


def test_a_step_load_that_fails_names_its_error():
    broken = torch.nn.Linear(3, 3)  # the batch below has 20 features: the forward raises
    failed = pytest.raises(RuntimeError, match="the calibration's step load failed: RuntimeError")
    with failed, startup.step_load(broken, torch.randn(8, 20)):
        pass  # the load's one pass at least runs, and fails


def test_calibrate_warns_when_it_falls_back(monkeypatch):
    monkeypatch.setattr(startup, "time_transfers", _Canned([BROKEN] * CALIBRATION_ATTEMPTS))
    with pytest.warns(RuntimeWarning, match="planning with the default .*no usable fit"):
        cost = calibrate(_Recorder().session)
    assert cost.fit == DEFAULT_COST and cost.source == "default"


def test_a_failed_calibration_still_gives_the_asked_policy_on_the_default_cost(monkeypatch):
    monkeypatch.setattr(startup, "time_transfers", _Canned([BROKEN] * CALIBRATION_ATTEMPTS))
    with pytest.warns(RuntimeWarning):
        chosen = agree_on_plan("imerge", tiny_model(), torch.randn(8, 20), _Recorder().session)
    assert chosen.plan.policy == "imerge"
    cores = startup.shared_host_cores()  # this process shares its host with itself
    assert chosen.cluster == cluster_from_fit(DEFAULT_COST, 1, 1, shared_cores=cores)
    assert "β 30 MB/s per message (default: 3 rounds of transfers gave no usable fit" in (
        chosen.describe()
    )


def test_a_given_cost_replaces_the_calibration_and_must_be_a_cost():
    args = (tiny_model(), torch.randn(8, 20), _untouchable())
    chosen = agree_on_plan("imerge", *args, fit=TRUTH)
    assert chosen.cost == CostModel(TRUTH, "given") and "(given)" in chosen.describe()
    with pytest.raises(ValueError, match="a given cost needs α >= 0 s and β > 0 s/byte"):
        agree_on_plan("imerge", *args, fit=AlphaBeta(1e-3, 0.0))


def test_an_injected_message_delay_is_planned_with():
    # calibration measures through the aggregator, not the senders that inject the delay
    args = (tiny_model(), torch.randn(8, 20), _untouchable())
    plain = agree_on_plan("imerge", *args, fit=TRUTH)
    delayed = agree_on_plan("imerge", *args, fit=TRUTH, message_delay=0.002)
    assert delayed.cluster.alpha_worker == pytest.approx(plain.cluster.alpha_worker + 0.002)
    # the delay holds the sender's thread, not a core
    assert delayed.cluster.worker_wait == pytest.approx(0.002)
    assert delayed.cluster.worker_cpu == pytest.approx(plain.cluster.worker_cpu)


def test_one_process_shares_its_hosts_cores_with_itself():
    assert startup.shared_host_cores() == len(os.sched_getaffinity(0))


def test_a_plan_made_on_shared_cores_says_so_and_scales_the_measured_compute(monkeypatch):
    args = (tiny_model(), torch.randn(8, 20), _untouchable())
    monkeypatch.setattr(startup, "shared_host_cores", lambda: None)  # a core per node
    own = agree_on_plan("imerge", *args, fit=TRUTH)
    monkeypatch.setattr(startup, "shared_host_cores", lambda: 1)
    shared = agree_on_plan("imerge", *args, fit=TRUTH)
    assert own.cluster.shared_cores is None and shared.cluster.shared_cores == 1
    assert "1 workers and 1 shards on 1 shared cores" in shared.describe()
    assert "shared cores" not in own.describe()


@pytest.mark.slow
def test_every_worker_follows_worker_0_through_repeated_rounds():
    # One size only: no round can separate α from β, so every round is repeated until the
    # default stands; a worker that stopped measuring early would leave the other one hanging.
    first, second = run_distributed(calibrate_over_allreduce, 2, (1 << 10,), timeout=120)
    assert first["cost"] == second["cost"]
    assert first["cost"].fit == DEFAULT_COST and "need at least two" in first["cost"].reason
    assert len(first["warnings"]) == 1 and second["warnings"] == []  # worker 0 speaks for all
    first, second = run_distributed(calibrate_over_allreduce, 2, timeout=120)
    assert first["cost"] == second["cost"] and first["cost"].fit.beta > 0


def test_remote_workers_are_those_that_cannot_bind_the_shards_address():
    class Shards:
        def __init__(self, host):
            self.shard_addresses = [(host, 7000), ("127.0.0.1", 7001)]

    assert startup.remote_workers(Shards("127.0.0.1")) == 0
    assert startup.remote_workers(Shards("192.0.2.1")) == 1  # TEST-NET-1: no host's own
    assert startup.remote_workers(_Recorder().session.aggregator) == 0  # one machine
