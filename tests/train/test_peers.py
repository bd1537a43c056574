"""DDP's peers: torch's PowerSGD hook is run one bucket after another (train/peers.py)."""

import contextlib
import os
import sys

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


def _report_environment(queue) -> None:
    import os
    import threading

    import torch

    # a thread the worker starts itself, as Gloo's callbacks are: its intra-op pool is OpenMP's
    # default, fixed when the process that imported torch read OMP_NUM_THREADS
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    mark = os.environ.get("GRADSUM_TEST_MARK")
    if mark == "second":  # the first writes where pytest's own output goes
        print(f"worker output {mark}", file=sys.stderr, flush=True)
    queue.put((os.environ.get("OMP_NUM_THREADS"), mark, seen[0]))


def test_local_workers_start_with_one_openmp_thread_and_the_launchers_environment(
    monkeypatch, capfd
):
    """Workers come from ``gradsum.processes`` (forked from a server that imported torch under
    WORKER_ENVIRONMENT): each has one OpenMP thread in every thread, the launcher's environment
    of the moment it started (not the server's) and its standard error of that moment (the
    first worker's is not captured), and the launcher keeps its own environment."""
    from gradsum import processes

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with capfd.disabled():  # a server this starts holds the uncaptured stderr
        context = processes.context()
    queue = context.Queue()
    for mark in ("first", "second"):  # the second worker: from the same server, if forked
        monkeypatch.setenv("GRADSUM_TEST_MARK", mark)
        process = processes.process(context, _report_environment, (queue,))
        with capfd.disabled() if mark == "first" else contextlib.nullcontext():
            processes.start(process)
            assert queue.get(timeout=60) == ("1", mark, 1)
            process.join(60)
    assert os.environ["OMP_NUM_THREADS"] == "7"
    assert "worker output second" in capfd.readouterr().err


@pytest.mark.slow
def test_ddp_powersgd_keeps_the_replicas_identical_on_the_digits_mlp():
    """Before every worker's threads ran BLAS on one thread, this ended "replicas diverged"
    after 4 to 12 of its 44 steps (Gloo's callback threads decompressed P Q^T with MKL on two)."""
    from gradsum.train.launch import run_local
    from gradsum.train.loop import TrainConfig

    config = TrainConfig(aggregator="ddp", ddp_hook="powersgd", model="digits-mlp",
                         dataset="digits", workers=2, epochs=1, progress=False)  # fmt: skip
    summary = run_local(config)  # raises if the replicas' parameters differ
    assert summary["test_accuracy"] > 0.8  # 0.88 in the runs seen


def test_the_powersgd_hooks_uncompressed_start_is_the_runs_uncompressed_steps(gloo_world_of_one):
    """``--uncompressed-steps 3`` with torch's PowerSGD hook: the hook runs from the first step
    and averages steps 0-2 in fp32 itself (its start_powerSGD_iter), so the hook compresses
    from step 3 as gradsum's codecs do, instead of skipping the hook for 3 steps and then
    warming up for its own 2 more (5 fp32 steps: an unequal comparison)."""

    from gradsum.train.config import TrainConfig
    from gradsum.train.peers import DDPSync

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    config = TrainConfig(aggregator="ddp", ddp_hook="powersgd", powersgd_rank=1,
                         powersgd_start=2, uncompressed_steps=3)  # fmt: skip
    sync = DDPSync(model, config)
    for step in range(5):
        with sync.uncompressed() if step < 3 else contextlib.nullcontext():
            sync.net(torch.randn(8, 32)).square().mean().backward()
        sync.wait()
    assert sync.hook_state.start_powerSGD_iter == 3
    assert sync.hook_state.iter == 5  # every step went through the hook
