"""DDP's peers: torch's PowerSGD hook is run one bucket after another (train/peers.py)."""

import pytest
import torch

from gradsum.train.peers import in_order


class _Recorder:
    """A hook whose futures the test completes by hand, recording which buckets it started."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.futures: list[torch.futures.Future] = []

    __name__ = "recorder"

    def __call__(self, state, bucket):
        self.started.append(bucket)
        self.futures.append(torch.futures.Future())
        return self.futures[-1]


def test_a_bucket_starts_only_once_the_previous_buckets_future_completed():
    inner = _Recorder()
    hook = in_order(inner)
    results = [hook(None, bucket) for bucket in range(3)]
    assert inner.started == [0]  # buckets 1 and 2 wait: their collectives must not interleave
    inner.futures[0].set_result(torch.full((4,), 0.0))
    assert inner.started == [0, 1] and results[0].value().eq(0.0).all()
    assert not results[1].done()
    inner.futures[1].set_result(torch.full((4,), 1.0))
    inner.futures[2].set_result(torch.full((4,), 2.0))
    assert inner.started == [0, 1, 2]
    assert [float(r.value()[0]) for r in results] == [0.0, 1.0, 2.0]
    # the next step's first bucket follows at once: the last one has completed
    hook(None, 3)
    assert inner.started == [0, 1, 2, 3]


def test_a_failed_bucket_fails_the_buckets_after_it_without_starting_them():
    inner = _Recorder()
    hook = in_order(inner)
    first, second = hook(None, 0), hook(None, 1)
    inner.futures[0].set_exception(RuntimeError("Gloo: connection reset"))
    for result in (first, second):
        with pytest.raises(RuntimeError, match="connection reset"):
            result.wait()
    assert inner.started == [0]
