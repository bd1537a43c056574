"""gradsum's PowerSGD trains a model as torch's powerSGD_hook does, from the same first Q.

Four workers (threads) train the digits CNN with SGD: two plain steps, then PowerSGD at rank 4,
once through the hook itself (its all-reduces over the threads, its first Q given by
``train.peers.with_shape_seeded_q``) and once through gradsum's codec (``first_q=shape``), from
the same weights and batches. After a few steps the parameters agree to float rounding; a
broken warm start, error feedback or orthogonalization of P moves them by orders of magnitude
more. (The codes round differently, e.g. the hook orthogonalizes at rank 4 by QR, gradsum by
Gram-Schmidt, and over a hundred steps PowerSGD amplifies such differences to a few percent of
the weights, as it does a change of carrier; hence few steps.)
"""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from gradsum.codecs import make_codec, run_round
from gradsum.codecs.lowrank import PowerSGD, shape_seeded_q
from gradsum.train.models import DigitsCNN
from gradsum.train.peers import with_shape_seeded_q

from .fake_ddp import Bucket, ThreadGroup

WORKERS, PLAIN, STEPS, RANK, SEED = 4, 2, 6, 4, 3
SHAPES = [tuple(p.shape) for p in DigitsCNN().parameters()]
# conv2 (32 x 144) and the classifier (10 x 128) are compressed, the rest all-reduced
TOLERANCE = 1e-5  # |gradsum - hook| / |hook - initial weights|, after STEPS PowerSGD steps


def hook_average():
    """Each PowerSGD step's average gradient through torch's hook (its first Q gradsum's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

    group = ThreadGroup(WORKERS)
    hook = with_shape_seeded_q(torch_hook.powerSGD_hook, SEED)
    states = []
    for _ in range(WORKERS):
        state = torch_hook.PowerSGDState(process_group=group, matrix_approximation_rank=RANK,
                                         start_powerSGD_iter=PLAIN, random_seed=0)  # fmt: skip
        state.iter = PLAIN  # the plain steps are the training loop's
        states.append(state)
    fake = SimpleNamespace(all_reduce=group.all_reduce, group=SimpleNamespace(WORLD=group))

    def average(gradients: list[torch.Tensor], step: int) -> torch.Tensor:
        def worker(w: int) -> torch.Tensor:
            group.local.rank = w
            return hook(states[w], Bucket(gradients[w].clone(), SHAPES)).wait()

        with mock.patch.object(torch_hook, "dist", fake), ThreadPoolExecutor(WORKERS) as pool:
            results = list(pool.map(worker, range(WORKERS)))
        assert all(torch.equal(results[0], r) for r in results)
        return results[0]

    return average


def gradsum_average(codec: PowerSGD):
    codec.describe("bucket", SHAPES)
    return lambda gradients, step: (
        run_round(codec, gradients, seed=SEED, step=step, key="bucket").average
    )


def train(average) -> tuple[torch.Tensor, torch.Tensor]:
    """(initial, final) flat weights of PLAIN plain steps and STEPS steps through ``average``."""
    torch.manual_seed(SEED)
    model = DigitsCNN()
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # noqa: E731
    initial = flat()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(SEED)
    for step in range(PLAIN + STEPS):
        gradients = []
        for _ in range(WORKERS):
            images, labels = (
                torch.rand(8, 64, generator=data),
                torch.randint(10, (8,), generator=data),
            )
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        plain = step < PLAIN
        mean = torch.stack(gradients).mean(0) if plain else average(gradients, step - PLAIN)
        offset = 0
        for p in model.parameters():
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    return initial, flat()


@pytest.fixture(scope="module")
def hooks_run():
    with torch.random.fork_rng():
        return train(hook_average())


def distance(hooks_run, codec: PowerSGD) -> float:
    """How far gradsum's run ends from the hook's, relative to how far the hook's moved."""
    with torch.random.fork_rng():
        _, ours = train(gradsum_average(codec))
    initial, theirs = hooks_run
    return float((ours - theirs).norm() / (theirs - initial).norm())


@pytest.mark.parametrize("floats", [True, False])
def test_gradsum_powersgd_trains_to_the_hooks_weights_from_the_same_first_q(hooks_run, floats):
    codec = make_codec("powersgd", workers=WORKERS, rank=RANK, floats=floats, first_q="shape")
    moved = distance(hooks_run, codec)
    print(f"floats={floats}: {moved:.2e}")
    assert moved < TOLERANCE


def _no_warm_start(self, x, ctx, averages, finish=PowerSGD.finish):
    estimate = finish(self, x, ctx, averages)
    self.q_memory.pop(ctx.state_key, None)  # the first Q again every step
    return estimate


def _no_error_feedback(self, x, ctx, averages, finish=PowerSGD.finish):
    estimate = finish(self, x, ctx, averages)
    self.memory.pop(ctx.state_key, None)
    return estimate


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param({"finish": _no_warm_start}, id="warm-start"),
        pytest.param({"finish": _no_error_feedback}, id="error-feedback"),
        pytest.param({"orthogonalize": lambda matrix: matrix}, id="orthogonalize"),
    ],
)
def test_the_comparison_catches_a_broken_step(hooks_run, broken):
    codec = make_codec("powersgd", workers=WORKERS, rank=RANK, floats=True, first_q="shape")
    ((name, replacement),) = broken.items()
    target = "gradsum.codecs.lowrank." + ("PowerSGD." + name if name == "finish" else name)
    with mock.patch(target, replacement):
        moved = distance(hooks_run, codec)
    print(f"{name}: {moved:.2e}")
    assert moved > 100 * TOLERANCE


def test_the_hooks_first_qs_are_drawn_from_the_seed_and_shape_in_its_order():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_hook

    state = torch_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                     start_powerSGD_iter=PLAIN)  # fmt: skip
    state.iter = PLAIN
    hook = with_shape_seeded_q(lambda state, bucket: None, SEED)
    hook(state, Bucket(torch.zeros(sum(torch.Size(s).numel() for s in SHAPES)), SHAPES))
    # conv2 (32 x 144) and the classifier (10 x 128), in the bucket's order
    want = [shape_seeded_q(SEED, 32, 144, RANK), shape_seeded_q(SEED, 10, 128, RANK)]
    assert torch.equal(state.q_memory_dict[0], torch.cat([q.reshape(-1) for q in want]))
    assert state.p_memory_dict[0].numel() == (32 + 10) * RANK
