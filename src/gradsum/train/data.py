"""Data sets for training: scikit-learn's digits (embedded), CIFAR-10 from disk, synthetic.

Every data set is a pair of in-memory tensors (train, test); each worker reads its own shard of a
permutation that all workers draw from the same seed, so the shards never overlap.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import DATASET_NAMES

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class DataError(ValueError):
    """The data set cannot be loaded; the message says which flag or file to fix."""


@dataclass
class Split:
    inputs: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class Dataset:
    name: str
    train: Split
    test: Split
    num_classes: int
    augment: bool = False  # random crop + flip (images only)


def load_dataset(
    name: str, data_dir: str | Path | None = None, input_shape=None, seed: int = 0
) -> Dataset:
    if name == "digits":
        return _digits()
    if name == "cifar10":
        return _cifar10(data_dir)
    if name == "synthetic":
        return _synthetic(input_shape or (3, 32, 32), seed)
    raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")


def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    inputs = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return Dataset(
        "digits", Split(inputs[train], labels[train]), Split(inputs[test], labels[test]), 10
    )


def _cifar10(data_dir: str | Path | None) -> Dataset:
    """CIFAR-10 in its standard python format: cifar-10-batches-py/{data_batch_1..5,test_batch}."""
    if data_dir is None:
        raise DataError(
            "--dataset cifar10 needs --data-dir pointing at the extracted CIFAR-10 files"
        )
    root = Path(data_dir)
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    train_files = [root / f"data_batch_{i}" for i in range(1, 6)]
    test_files = [root / "test_batch"]
    missing = [str(f) for f in train_files + test_files if not f.is_file()]
    if missing:
        raise DataError(
            f"--data-dir {data_dir}: CIFAR-10 files missing: {', '.join(missing)} "
            "(expected the python version, cifar-10-batches-py)"
        )
    return Dataset("cifar10", _cifar_split(train_files), _cifar_split(test_files), 10, augment=True)


def _cifar_split(files: list[Path]) -> Split:
    images, labels = [], []
    for path in files:
        with path.open("rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        try:
            images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch[b"labels"])
        except (KeyError, ValueError) as error:
            raise DataError(f"{path} is not a CIFAR-10 python batch: {error}") from None
    pixels = torch.from_numpy(np.concatenate(images)).to(torch.float32).div_(255.0)
    mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return Split(pixels.sub_(mean).div_(std), torch.tensor(labels, dtype=torch.int64))


def _synthetic(
    input_shape: tuple[int, ...], seed: int, train: int = 2048, test: int = 512
) -> Dataset:
    """Random inputs labelled by a fixed random linear teacher: learnable, for throughput runs."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(train + test, *input_shape, generator=generator)
    teacher = torch.randn(int(np.prod(input_shape)), 10, generator=generator)
    labels = (inputs.reshape(len(inputs), -1) @ teacher).argmax(dim=1)
    return Dataset(
        "synthetic",
        Split(inputs[:train], labels[:train]),
        Split(inputs[train:], labels[train:]),
        10,
    )


def shard_batches(split: Split, rank: int, world: int, batch_size: int, epoch: int, seed: int):
    """This worker's batches for one epoch: a seeded permutation, dealt round-robin.

    Every worker gets the same number of full batches (the remainder is dropped), so all workers
    take the same number of steps.
    """
    order = torch.randperm(
        len(split), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)
    )
    per_worker = len(order) // world
    mine = order[rank::world][:per_worker]
    for start in range(0, per_worker - batch_size + 1, batch_size):
        index = mine[start : start + batch_size]
        yield split.inputs[index], split.labels[index]


def steps_per_epoch(split: Split, world: int, batch_size: int) -> int:
    return (len(split) // world) // batch_size


def augment_images(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random 32x32 crop of a 4-pixel zero-padded image and random horizontal flip, per batch."""
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    dx, dy = (int(v) for v in torch.randint(0, 9, (2,), generator=generator))
    cropped = padded[:, :, dy : dy + 32, dx : dx + 32]
    if bool(torch.randint(0, 2, (1,), generator=generator)):
        cropped = cropped.flip(3)
    return cropped
