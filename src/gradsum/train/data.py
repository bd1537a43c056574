"""Data sets for training: scikit-learn's digits (embedded), CIFAR-10 from disk, synthetic, and
the Python standard library's own sources as byte-level text (every machine with Python has it).

Every data set is a pair of in-memory tensors (train, test); each worker reads its own shard of a
permutation that all workers draw from the same seed, so the shards never overlap.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import pickle
import sysconfig
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
    name: str,
    data_dir: str | Path | None = None,
    input_shape=None,
    seed: int = 0,
    max_bytes: int | None = None,
) -> Dataset:
    """``max_bytes`` caps the text of ``stdlib`` (its training split; validation gets an eighth
    of it); the other data sets ignore it."""
    if name == "stdlib":
        context = input_shape[0] if input_shape else 128
        return _stdlib(data_dir, context, max_bytes or STDLIB_BYTES)
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


STDLIB_BYTES = 8 << 20  # of training text by default: ~65,000 windows of 129 bytes
VALIDATION_EVERY = 10  # one source file in ten is validation (by its path's hash)


def _stdlib(data_dir: str | Path | None, context: int, max_bytes: int) -> Dataset:
    """Byte-level next-token windows over the standard library's ``.py`` sources.

    The sources come from ``sysconfig.get_paths()["stdlib"]`` (or ``--data-dir``), without
    site-packages. A file is validation when the BLAKE2b hash of its relative path falls in one
    bucket of ``VALIDATION_EVERY``: the split is by file (no window of a validation file is
    trained on) and the same on every machine and run, whatever order the files are listed in.
    Files are read in path order and joined by a NUL byte until ``max_bytes`` of training text
    (an eighth of that of validation); each split is cut into windows of ``context + 1`` bytes
    that overlap by one, the input a window's first ``context`` bytes and the labels its last.
    """
    root = Path(data_dir) if data_dir is not None else Path(sysconfig.get_paths()["stdlib"])
    budgets = {"train": max_bytes, "test": max(max_bytes // 8, context + 1)}
    texts: dict[str, list[bytes]] = {"train": [], "test": []}
    filled = {"train": 0, "test": 0}
    found = False
    for relative, path in _sources_in_path_order(root):
        found = True
        digest = hashlib.blake2b(relative.encode(), digest_size=8).digest()
        split = "test" if int.from_bytes(digest, "little") % VALIDATION_EVERY == 0 else "train"
        if filled[split] >= budgets[split]:
            if all(filled[s] >= budgets[s] for s in budgets):
                break
            continue
        text = path.read_bytes() + b"\0"
        texts[split].append(text)
        filled[split] += len(text)
    if not found:
        raise DataError(f"--dataset stdlib: no .py files under {root}")
    splits = {}
    for split, parts in texts.items():
        data = torch.frombuffer(bytearray(b"".join(parts)[: budgets[split]]), dtype=torch.uint8)
        if len(data) < context + 1:
            raise DataError(
                f"--dataset stdlib: {len(data)} bytes of {split} text under {root}, fewer than "
                f"one window of --context {context} + 1"
            )
        windows = data.unfold(0, context + 1, context)
        splits[split] = Split(windows[:, :-1], windows[:, 1:])
    return Dataset("stdlib", splits["train"], splits["test"], 256)


def _sources_in_path_order(root: Path):
    """``(relative posix path, path)`` of every ``.py`` file under ``root`` outside
    site-packages, in the order of the relative paths as strings, walking only as far as the
    caller reads: a folder's entries all sort between ``folder/`` and the next string that does
    not start with it, so a heap keyed by ``folder/`` expands each folder when its turn comes."""
    heap: list[tuple[str, bool, Path]] = [("", True, root)]
    while heap:
        key, folder, path = heapq.heappop(heap)
        if not folder:
            yield key, path
            continue
        try:
            entries = list(os.scandir(path))
        except OSError:  # unreadable folder: rglob skips it too
            continue
        for entry in entries:
            name = key + entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name != "site-packages":
                    heapq.heappush(heap, (name + "/", True, Path(entry.path)))
            elif entry.name.endswith(".py") and entry.is_file():
                heapq.heappush(heap, (name, False, Path(entry.path)))


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
