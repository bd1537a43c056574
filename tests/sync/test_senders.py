"""ShardSender against in-process fake shards: which parts of a group are in flight together."""

import threading
import time

import pytest
import torch

from gradsum.schedule.plan import Group, Part, Plan
from gradsum.sync.senders import ShardSender

from .fakes import answering_session

PART_SECONDS = 0.05


class RecordingShards:
    """Echoes each part back after a pause and records how many parts were in flight at once."""

    def __init__(self, num_shards: int):
        self.num_shards = num_shards
        self.calls: list[tuple[int, tuple]] = []
        self.steps: list[int] = []
        self._lock = threading.Lock()
        self._active = 0
        self.most_active = 0

    def session(self, worker: int = 0):
        """A Session whose parts go to these shards."""
        return answering_session(self, shards=self.num_shards, rank=worker)

    def __call__(self, flat: torch.Tensor, *, key, step, shard) -> torch.Tensor:
        with self._lock:
            self._active += 1
            self.most_active = max(self.most_active, self._active)
            self.calls.append((shard, key))
            self.steps.append(step)
        time.sleep(PART_SECONDS)
        with self._lock:
            self._active -= 1
        return flat * 2


def three_part_plan(*, interleave: bool, credit_bytes: int | None) -> Plan:
    parts = (Part(0, 0, 4), Part(1, 4, 8), Part(2, 8, 12))
    return Plan(
        "test",
        (Group(0, 12, parts),),
        layer_offsets=(0, 12),
        interleave=interleave,
        credit_bytes=credit_bytes,
    )


def send_one_group(plan: Plan, worker: int = 0) -> tuple[RecordingShards, torch.Tensor]:
    shards = RecordingShards(3)
    sender = ShardSender(shards.session(worker), plan, timeout=10)
    try:
        flat = torch.arange(12, dtype=torch.float32)
        result = sender.submit(0, flat, step=7).wait()
    finally:
        sender.close()
    assert shards.steps == [7] * len(plan.groups[0].parts)  # the caller's step, on every part
    return shards, result


@pytest.mark.parametrize(
    ("interleave", "credit_bytes", "together"),
    [
        # An admitted group puts every part in flight, each on its shard's stream (SendWindow,
        # as in the simulator), with or without a window, interleaved or not.
        (False, None, 3),
        (False, 48, 3),
        (True, None, 3),
    ],
)
def test_parts_in_flight_follow_the_plan(interleave, credit_bytes, together):
    shards, result = send_one_group(
        three_part_plan(interleave=interleave, credit_bytes=credit_bytes)
    )
    assert shards.most_active == together
    assert torch.equal(result, 2 * torch.arange(12, dtype=torch.float32))


def test_a_window_of_one_group_keeps_the_next_group_waiting():
    parts = (Part(0, 0, 4), Part(1, 4, 8))
    plan = Plan(
        "test",
        (Group(0, 8, parts), Group(8, 12, (Part(2, 8, 12),))),
        layer_offsets=(0, 8, 12),
        credit_bytes=None,
    )
    shards = RecordingShards(3)
    sender = ShardSender(shards.session(), plan, timeout=10)
    try:
        first = sender.submit(0, torch.arange(8, dtype=torch.float32), step=1)
        second = sender.submit(1, torch.arange(4, dtype=torch.float32), step=1)
        second.wait(), first.wait()
    finally:
        sender.close()
    assert shards.most_active == 2  # group 1 (shard 2) waited for both parts of group 0
    assert [shard for shard, _ in shards.calls][-1] == 2


def test_an_injected_message_delay_is_paid_on_one_thread_for_every_send_and_answer():
    # Three parts on three shard streams run their transfers together (0.05 s), but the
    # delay is one communication thread's: 3 sends + 3 answers of 0.04 s queue behind each
    # other (0.24 s), as alpha_worker does in the simulator.
    plan = three_part_plan(interleave=False, credit_bytes=None)
    shards = RecordingShards(3)
    sender = ShardSender(shards.session(), plan, timeout=10, message_delay=0.04)
    try:
        started = time.perf_counter()
        result = sender.submit(0, torch.arange(12, dtype=torch.float32), step=0).wait()
        elapsed = time.perf_counter() - started
    finally:
        sender.close()
    assert torch.equal(result, torch.arange(12, dtype=torch.float32) * 2)
    assert elapsed >= 6 * 0.04
    with pytest.raises(ValueError, match="per-message delay must be >= 0"):
        ShardSender(shards.session(), plan, timeout=10, message_delay=-1)


@pytest.mark.parametrize(("sizes", "fusion"), [((6, 5, 3), 20), ((1201, 1000, 7), 1 << 20)],
                         ids=["small", "past-2^20"])  # fmt: skip
def test_a_release_of_other_tensors_sends_those_and_leaves_param_grad_alone(sizes, fusion):
    """Local steps' overlapped round sends its own buffers while the next inner steps write
    ``param.grad``: what is sent, and where the average lands, must be those buffers (also at a
    user's size: a weight of 1,201,000 elements, past one 2^20 partition, fused with three
    other tensors into one group)."""
    from gradsum.sync.gradient_sync import GradientSync

    a, b, c = sizes
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Linear(b, c))
    sync = GradientSync(model, answering_session(lambda flat, **_: flat * 2),
                        fusion_elements=fusion, on_backward=False, broadcast_from=None)  # fmt: skip
    try:
        params = sync.parameters
        for p in params:
            p.grad = torch.full_like(p, 7.0)
        buffers = [torch.randn(p.shape) for p in params]
        sent = [b.clone() for b in buffers]
        with pytest.raises(ValueError, match="one tensor per parameter"):
            sync.release(buffers[:-1])
        sync.release(buffers)
        sync.wait()
        for b, s, p in zip(buffers, sent, params, strict=True):
            assert torch.equal(b, s * 2)
            assert torch.equal(p.grad, torch.full_like(p, 7.0))
        sync.release()  # the next round: param.grad again
        sync.wait()
        assert all(torch.equal(p.grad, torch.full_like(p, 14.0)) for p in params)
    finally:
        sync.close()


def test_a_failed_batch_of_released_groups_fails_the_step_with_its_error():
    """The bug it fears: a batch of groups (``release`` without backward's hooks) whose round
    fails leaving the other groups' futures unset, so ``wait`` hangs to its timeout instead of
    raising the round's own error."""
    from gradsum.sync.gradient_sync import GradientSync

    def answer(flat, *, key, **_):
        if key[1] == 1:
            raise ValueError("the second group's round failed")
        return flat

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    sync = GradientSync(model, answering_session(answer), fusion_elements=20, timeout=60,
                        on_backward=False, broadcast_from=None)  # fmt: skip
    try:
        assert len(sync.groups) >= 2
        for p in sync.parameters:
            p.grad = torch.ones_like(p)
        sync.release()
        # as a group sent alone fails (its write-back's future names the round's error)
        with pytest.raises((ValueError, RuntimeError), match="the second group's round failed"):
            sync.wait()
    finally:
        sync.close()


@pytest.mark.parametrize("sizes", [(6, 5, 3), (1201, 1000, 7)], ids=["small", "past-2^20"])
def test_a_release_of_some_groups_sends_only_those_and_counts_a_step(sizes):
    """Local steps' fragments: a round of some groups only (also a weight of 1,201,000
    elements, past one 2^20 partition). The bugs it fears: the other groups sent too (their
    gradients overwritten), ``wait`` refusing a step with groups left unsent, or the step not
    counted (the next fragment's round would reuse its keys)."""
    from gradsum.sync.gradient_sync import GradientSync

    sent = []

    def answer(flat, *, key, step, **_):
        sent.append((key[1], step))
        return flat * 2

    a, b, c = sizes
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Linear(b, c))
    sync = GradientSync(model, answering_session(answer), groups=[[0, 1], [2], [3]],
                        on_backward=False, broadcast_from=None)  # fmt: skip
    try:
        for p in sync.parameters:
            p.grad = torch.full_like(p, 3.0)
        sync.release(groups=[2, 1])
        sync.wait()
        assert sorted(sent) == [(1, 0), (2, 0)]
        doubled = [torch.equal(p.grad, torch.full_like(p, 6.0)) for p in sync.parameters]
        assert doubled == [False, False, True, True]
        sync.release(groups=[0])
        sync.wait()
        assert sorted(sent)[:1] == [(0, 1)] and sync.step == 2
        with pytest.raises(ValueError, match=r"groups \[7\] are not among this sync's 3"):
            sync.release(groups=[7])
    finally:
        sync.close()
    hooked = GradientSync(model, answering_session(answer), groups=[[0, 1], [2], [3]],
                          broadcast_from=None)  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="without backward hooks"):
            hooked.release(groups=[0])
    finally:
        hooked.close()
