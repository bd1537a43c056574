"""PowerSGD: gradsum's two-stage codec against PyTorch's powerSGD_hook on the same inputs, and
the round's stages (splitting a bucket, warm start, error feedback) on their own."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from gradsum.codecs import make_codec, nmse, run_round
from gradsum.codecs.lowrank import orthogonalize

from .fake_ddp import Bucket, ThreadGroup

WORKERS, STEPS = 4, 10
# a conv weight (viewed 32 x 27), a bias, a linear weight and a norm's weight: what a bucket holds
SHAPES = [(32, 3, 3, 3), (32,), (96, 200), (96,)]
MATRICES = [(32, 27), (96, 200)]


def bucket_gradient(worker: int, step: int) -> torch.Tensor:
    """Gradients with the structure PowerSGD lives on: a slowly turning low-rank common part
    (decaying spectrum), per-worker noise; 1-D tensors are noise around a common mean."""
    common = torch.Generator().manual_seed(7)
    noise = torch.Generator().manual_seed(1000 * step + worker)
    pieces = []
    for shape in SHAPES:
        n = shape[0]
        m = int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
        left = torch.randn(n, 6, generator=common) * torch.logspace(0, -1.5, 6)
        turn = 0.1 * step * torch.randn(6, m, generator=common)
        right = torch.randn(6, m, generator=common) + turn
        signal = left @ right / 3
        pieces.append((signal + 0.4 * torch.randn(n, m, generator=noise)).reshape(-1))
    return torch.cat(pieces)


def torch_hook_averages(rank: int) -> list[list[torch.Tensor]]:
    """PyTorch's powerSGD_hook itself, its all-reduces over WORKERS threads: each step's
    average, after the warm start's first draw."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

    group = ThreadGroup(WORKERS)
    first_q = torch.cat([q.reshape(-1) for q in torch_first_qs(rank)])
    p_size = sum(n * min(n, m, rank) for n, m in MATRICES)

    def worker(w: int) -> list[torch.Tensor]:
        group.local.rank = w
        state = hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=2, random_seed=0)  # fmt: skip
        state.iter = state.start_powerSGD_iter  # no uncompressed warm-up steps
        # its own first draw, made here: the hook draws under fork_rng, which threads would race
        state.q_memory_dict[0], state.p_memory_dict[0] = first_q.clone(), torch.empty(p_size)
        return [hook.powerSGD_hook(state, Bucket(bucket_gradient(w, step).clone(), SHAPES)).wait()
                for step in range(STEPS)]  # fmt: skip

    fake = SimpleNamespace(all_reduce=group.all_reduce, group=SimpleNamespace(WORLD=group))
    with mock.patch.object(hook, "dist", fake), ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(worker, range(WORKERS)))


def torch_first_qs(rank: int) -> list[torch.Tensor]:
    """The Qs the hook draws on its first step (its seed, its order: one per matrix); with
    them in its memory it orthogonalizes them as it does its own draw."""
    generator = np.random.RandomState(0)
    torch.manual_seed(generator.randint(1_000_000_000))
    return [torch.randn(m, min(n, m, rank)) for n, m in MATRICES]


def gradsum_averages(rank: int, **options) -> list[torch.Tensor]:
    codec = make_codec("powersgd", workers=WORKERS, rank=rank, **options)
    codec.describe("bucket", SHAPES)
    bounds = codec.partitions("bucket", sum(int(torch.tensor(s).prod()) for s in SHAPES), 1 << 20)
    assert [b - a for a, b in bounds] == [864, 32, 19200, 96]  # matrices 0 and 2, rest alone
    for w in range(WORKERS):  # the same first Q as PyTorch's
        for partition, q in zip((0, 2), torch_first_qs(rank), strict=True):
            codec.q_memory[(w, ("bucket", partition))] = q
    with torch.random.fork_rng():
        return [run_round(codec, [bucket_gradient(w, step) for w in range(WORKERS)],
                          key="bucket", step=step).average for step in range(STEPS)]  # fmt: skip


def step_nmse(averages: list[torch.Tensor]) -> list[float]:
    return [nmse(a, [bucket_gradient(w, step) for w in range(WORKERS)])
            for step, a in enumerate(averages)]  # fmt: skip


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_nmse_within_5_percent_of_pytorchs_powersgd_hook(rank):
    with torch.random.fork_rng():
        theirs = torch_hook_averages(rank)
    assert all(torch.equal(theirs[0][s], theirs[w][s]) for w in range(WORKERS)
               for s in range(STEPS))  # fmt: skip
    want = step_nmse(theirs[0])
    for floats in (False, True):
        got = step_nmse(gradsum_averages(rank, floats=floats))
        mean_got, mean_want = sum(got) / STEPS, sum(want) / STEPS
        assert abs(mean_got / mean_want - 1) <= 0.05, (rank, floats, got, want)


def test_a_bucket_is_split_into_its_matrices_and_runs_of_the_rest():
    codec = make_codec("powersgd", workers=2, rank=2)
    shapes = [(4,), (64, 3, 3), (8, 4), (5,), (3,), (128, 256), (7,)]
    codec.describe("k", shapes)
    # (8, 4) at rank 2 is not worth compressing (24 * 2 >= 32); the rest runs are cut at 10
    assert codec.partitions("k", 4 + 576 + 32 + 5 + 3 + 32768 + 7, 10) == [
        (0, 4), (4, 580), (580, 590), (590, 600), (600, 610), (610, 620), (620, 33388),
        (33388, 33395)]  # fmt: skip
    with pytest.raises(ValueError, match="hold 33,395 coordinates, its flat gradient 33,396"):
        codec.partitions("k", 33396, 10)


def test_uncompressed_tensors_are_exact_and_matrices_low_rank():
    generator = torch.Generator().manual_seed(3)
    shapes = [(16,), (48, 64), (9,)]
    shared = torch.randn(48, 2, generator=generator) @ torch.randn(2, 64, generator=generator)
    inputs = [torch.cat([torch.randn(16, generator=generator), (shared + 0.01 * torch.randn(
        48, 64, generator=generator)).reshape(-1), torch.randn(9, generator=generator)])
        for _ in range(3)]  # fmt: skip
    codec = make_codec("powersgd", workers=3, rank=2, floats=True)
    codec.describe("k", shapes)
    result = run_round(codec, inputs, key="k")
    mean = torch.stack(inputs).mean(0)
    assert torch.allclose(result.average[:16], mean[:16], atol=1e-6)
    assert torch.allclose(result.average[-9:], mean[-9:], atol=1e-6)
    assert nmse(result.average, inputs) < 1e-3  # a rank-2 signal at rank 2
    # P (48 x 2) and Q (64 x 2) instead of 48 * 64 values, the 25 others as they are
    up, _ = result.bits_per_coordinate()
    assert up == pytest.approx(32 * (16 + 9 + 48 * 2 + 64 * 2) / (16 + 48 * 64 + 9))


def test_warm_start_and_error_feedback_state_is_kept_per_worker_and_matrix():
    codec = make_codec("powersgd", workers=2, rank=1)
    codec.describe("k", [(32, 32)])
    inputs = [torch.randn(1024) for _ in range(2)]
    run_round(codec, inputs, key="k")
    assert sorted(codec.q_memory) == sorted(codec.memory) == [(0, ("k", 0)), (1, ("k", 0))]
    assert torch.equal(codec.q_memory[(0, ("k", 0))], codec.q_memory[(1, ("k", 0))])
    assert codec.state_nbytes() == 2 * 4 * (32 + 1024)
    off = make_codec("powersgd", workers=2, error_feedback=False, warm_start=False)
    run_round(off, inputs, key="k")
    assert off.state_nbytes() == 0


def test_orthogonalize_keeps_zero_columns_zero():
    matrix = torch.zeros(5, 2)
    matrix[:, 1] = torch.arange(5.0)
    out = orthogonalize(matrix.clone())
    assert torch.equal(out[:, 0], torch.zeros(5))
    assert float(out[:, 1].norm()) == pytest.approx(1.0)


def test_the_generic_error_feedback_wrapper_is_refused():
    from gradsum.codecs.feedback import FeedbackRefused, feedback_for

    with pytest.raises(FeedbackRefused, match="its own error feedback"):
        feedback_for(make_codec("powersgd", workers=2))
    assert make_codec("powersgd", workers=2, error_feedback=False).error_feedback is False
