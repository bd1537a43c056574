"""Benchmark inputs: one gradient-like vector per simulated worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the functions load it: the command line lists INPUT_KINDS without torch
    import torch

INPUT_KINDS = ("gaussian", "lognormal", "real")


def make_inputs(kind: str, workers: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    import torch

    if kind == "gaussian":
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(size, generator=generator) for _ in range(workers)]
    if kind == "lognormal":
        return _lognormal(workers, size, seed)
    if kind == "real":
        return digits_gradients(workers, size, seed)
    raise ValueError(f"unknown input {kind!r}; choose one of {', '.join(INPUT_KINDS)}")


def input_shapes(kind: str, size: int) -> list[tuple[int, ...]] | None:
    """The tensors an input of ``size`` coordinates holds, for codecs that work per tensor
    (``Codec.describe``): the MLP's parameters for real gradients, cut (or tiled) like the
    gradient itself, a cut matrix kept as its whole rows; None for synthetic inputs."""
    if kind != "real":
        return None
    shapes, left = [], size
    while left > 0:
        for shape in DIGITS_MLP_SHAPES:
            count = shape[0] * (shape[1] if len(shape) > 1 else 1)
            if count <= left:
                shapes.append(shape)
            elif len(shape) > 1 and left >= shape[1]:
                rows = left // shape[1]
                shapes.append((rows, shape[1]))
                if left - rows * shape[1]:
                    shapes.append((left - rows * shape[1],))
            elif left:
                shapes.append((left,))
            left -= min(count, left)
            if not left:
                break
    return shapes


DIGITS_MLP_SHAPES = ((1024, 64), (1024,), (1024, 1024), (1024,), (10, 1024), (10,))


def _lognormal(workers: int, size: int, seed: int) -> list[torch.Tensor]:
    """Heavy-tailed magnitudes exp(N(0, 1)) with random signs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    vectors = []
    for _ in range(workers):
        magnitude = torch.randn(size, generator=generator).exp_()
        sign = torch.randint(0, 2, (size,), generator=generator).mul_(2).sub_(1)
        vectors.append(magnitude.mul_(sign))
    return vectors


def digits_gradients(
    workers: int, size: int, seed: int = 0, batch_size: int = 64
) -> list[torch.Tensor]:
    """Real gradients: an MLP on scikit-learn's digits, one batch per worker.

    The MLP (64-1024-1024-10, 1.13M parameters) is wide enough to fill a 2**20 partition; its
    flattened gradient is cut to ``size`` (or tiled, for larger sizes).
    """
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    torch.manual_seed(seed)  # the model's initial weights; no other global randomness is used
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    vectors = []
    for worker in range(workers):
        batch = order[(worker * batch_size) % len(labels) :][:batch_size]
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(features[batch]), labels[batch])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        repeats = -(-size // flat.numel())
        vectors.append(flat.repeat(repeats)[:size].clone())
    return vectors
