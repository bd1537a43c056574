"""The training loop one worker runs, readable top to bottom.

Workers form a torch.distributed (Gloo) group for control -- identical initial weights, the
replica check, the evaluation result -- while gradients travel through the chosen aggregator.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..codecs import make_codec, parse_options
from ..schedule import AlphaBeta
from ..sync.gradient_sync import GradientSync
from ..sync.scheduling import agree_on_plan
from .aggregators import make_aggregator
from .config import TrainConfig
from .data import augment_images, load_dataset, shard_batches, steps_per_epoch
from .models import build_model, input_shape


@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    samples_per_s: float
    seconds: float


def train_worker(config: TrainConfig, rank: int, world: int) -> dict:
    """Train on this worker's shard; returns rank 0's summary (other ranks: their param digest)."""
    torch.manual_seed(config.seed)  # the same initial weights on every worker
    dataset = load_dataset(config.dataset, config.data_dir, input_shape(config.model), config.seed)
    model = build_model(config.model, dataset.num_classes).to(device_of(config))
    codec = make_codec(config.codec, workers=world, **parse_options(config.codec_options))
    aggregator = make_aggregator(config, rank, world, codec)
    try:
        return _train(config, rank, world, dataset, model, codec, aggregator)
    finally:
        aggregator.close()


def _train(config, rank, world, dataset, model, codec, aggregator) -> dict:
    momentum = 0.0 if config.codec == "dgc" else config.momentum  # DGC carries the momentum
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=momentum, weight_decay=config.weight_decay
    )
    options = {"threshold": config.fusion_elements} if config.scheduler == "fusion" else {}
    batch = dataset.train.inputs[: config.batch_size].to(device_of(config))
    chosen = agree_on_plan(
        config.scheduler,
        model,
        batch,
        aggregator,
        codec,
        options=options,
        model_name=config.model,
        fit=AlphaBeta(*config.fixed_cost) if config.fixed_cost else None,
    )
    sync = GradientSync(
        model,
        codec,
        aggregator,
        plan=chosen.plan,
        order=chosen.order,
        seed=config.seed,
        timeout=config.timeout,
    )
    first_epoch = _resume(config, rank, model, optimizer, codec, sync) if config.resume else 0
    log = _Log(config.log if rank == 0 else None)
    log.write({"event": "config", "world": world, **asdict(config)})
    log.write({"event": "plan", "describe": chosen.describe(), "order": chosen.order})
    if rank == 0 and config.progress:
        print(chosen.describe(), flush=True)
    history: list[EpochMetrics] = []
    augment = torch.Generator().manual_seed(config.seed * 7919 + rank)
    try:
        for epoch in range(first_epoch, config.epochs):
            metrics = _train_epoch(
                config, rank, world, epoch, model, optimizer, sync, dataset, augment
            )
            history.append(metrics)
            log.write({"event": "epoch", **asdict(metrics)})
            if rank == 0 and config.progress:
                print(_epoch_line(metrics, config.epochs), flush=True)
            if config.checkpoint:
                _save(config, rank, epoch, model, optimizer, codec, sync)
        digest = check_replicas(model)
    finally:
        sync.close()
    summary = _summary(config, world, history, digest, chosen.describe())
    log.write({"event": "summary", **summary})
    return summary


def _train_epoch(
    config, rank, world, epoch, model, optimizer, sync, dataset, augment
) -> EpochMetrics:
    model.train()
    steps = steps_per_epoch(dataset.train, world, config.batch_size)
    if steps == 0:
        raise ValueError(
            f"--batch-size {config.batch_size} x {world} workers exceeds the "
            f"{len(dataset.train)} training samples"
        )
    batches = shard_batches(dataset.train, rank, world, config.batch_size, epoch, config.seed)
    progress = _progress_bar(steps, epoch, config) if rank == 0 else None
    device = device_of(config)
    # accumulated on the device (float64: the sum a Python float would make), read once
    total_loss = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    start = time.perf_counter()
    try:
        for step, (inputs, labels) in enumerate(batches):
            if dataset.augment:
                inputs = augment_images(inputs, augment)
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=False)
            outputs = model(inputs)
            loss = torch.nn.functional.cross_entropy(outputs, labels)
            loss.backward()
            sync.wait()
            optimizer.step()
            total_loss += loss.detach().to(torch.float64) * len(labels)
            correct += (outputs.argmax(dim=1) == labels).sum()
            seen += len(labels)
            if progress is not None:
                progress.update(1)
                if device.type == "cpu" or step % 50 == 0:  # on a GPU a read waits for it
                    progress.set_postfix(loss=f"{loss.item():.3f}")
    finally:
        if progress is not None:  # also on an error, whose report then starts a line of its own
            progress.close()
    total_loss, correct = float(total_loss), int(correct)  # the epoch's one read
    seconds = time.perf_counter() - start
    return EpochMetrics(
        epoch=epoch + 1,
        loss=total_loss / max(seen, 1),
        train_accuracy=correct / max(seen, 1),
        test_accuracy=evaluate(model, dataset.test),
        samples_per_s=world * seen / seconds if seconds > 0 else 0.0,
        seconds=seconds,
    )


def device_of(config: TrainConfig) -> torch.device:
    """The worker's device: its local GPU (set by the launcher) or the CPU."""
    if config.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, split, batch_size: int = 512) -> float:
    model.eval()
    device = next(model.parameters()).device
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, len(split), batch_size):
        outputs = model(split.inputs[start : start + batch_size].to(device))
        labels = split.labels[start : start + batch_size].to(device)
        correct += (outputs.argmax(dim=1) == labels).sum()
    return int(correct) / max(len(split), 1)


def parameter_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes (copied to the host first: a device tensor has no
    host bytes to hash)."""
    digest = hashlib.blake2b(digest_size=16)
    for parameter in model.parameters():
        digest.update(parameter.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def check_replicas(model: torch.nn.Module) -> str:
    """Every worker must hold bitwise the same parameters; raise naming the ones that differ."""
    digest = parameter_digest(model)
    if dist.is_initialized() and dist.get_world_size() > 1:
        digests: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if differing:
            raise RuntimeError(f"replicas diverged: workers {differing} differ from worker 0")
    return digest


def _summary(
    config: TrainConfig, world: int, history: list[EpochMetrics], digest: str, plan: str
) -> dict:
    last = history[-1] if history else None
    seconds = sum(m.seconds for m in history)
    samples = sum(m.samples_per_s * m.seconds for m in history)
    return {
        "model": config.model,
        "dataset": config.dataset,
        "aggregator": config.aggregator,
        "codec": config.codec,
        "scheduler": config.scheduler,
        "workers": world,
        "epochs": len(history),
        "test_accuracy": last.test_accuracy if last else None,
        "final_loss": last.loss if last else None,
        "samples_per_s": samples / seconds if seconds > 0 else 0.0,
        "train_seconds": seconds,
        "parameter_digest": digest,
        "plan": plan,
    }


def _epoch_line(m: EpochMetrics, epochs: int) -> str:
    return (
        f"epoch {m.epoch}/{epochs}  loss {m.loss:.4f}  train acc {m.train_accuracy:.3f}  "
        f"test acc {m.test_accuracy:.3f}  {m.samples_per_s:,.0f} samples/s  ({m.seconds:.1f} s)"
    )


def _progress_bar(steps: int, epoch: int, config: TrainConfig):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=steps, desc=f"epoch {epoch + 1}/{config.epochs}", leave=False, unit="step")


class _Log:
    """JSON lines, one object per event, flushed as written."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.path:
            with self.path.open("a") as handle:
                handle.write(json.dumps(record, default=str) + "\n")


def _rank_file(path: str, rank: int) -> Path:
    return Path(f"{path}.rank{rank}")


def _save(config, rank, epoch, model, optimizer, codec, sync) -> None:
    """Model and optimizer from worker 0, plus every worker's own codec state (error feedback)."""
    if rank == 0:
        state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        _save_whole(state, Path(config.checkpoint))
    own = {"codec": codec.state_dict(), "step": sync.step, "epoch": epoch}
    _save_whole(own, _rank_file(config.checkpoint, rank))


def _save_whole(state: dict, path: Path) -> None:
    """Written beside and renamed into place: a worker killed while saving leaves the last
    whole checkpoint, never a torn one."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    partial.replace(path)


def checkpoint_epoch(path: str, rank: int) -> int | None:
    """The epoch worker ``rank`` would resume after from checkpoint ``path``: None when its
    files are missing or from different epochs (a worker killed between the two saves)."""
    shared, own = Path(path), _rank_file(path, rank)
    if not (shared.is_file() and own.is_file()):
        return None
    epochs = {torch.load(f, weights_only=False).get("epoch") for f in (shared, own)}
    return epochs.pop() if len(epochs) == 1 and None not in epochs else None


def _resume(config, rank, model, optimizer, codec, sync) -> int:
    path, rank_path = Path(config.resume), _rank_file(config.resume, rank)
    for needed in (path, rank_path):
        if not needed.is_file():
            raise FileNotFoundError(f"--resume {config.resume}: {needed} does not exist")
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    own = torch.load(rank_path, weights_only=False)
    codec.load_state_dict(own["codec"])
    sync.step = own["step"]
    return state["epoch"] + 1
