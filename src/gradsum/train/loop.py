"""What one real worker plugs into the one training loop (``trainer.Trainer``): its model and
sync as the step's ``Worker``, its shard of the data, and its report (epoch metrics and
checkpoints, or evaluations on a step schedule); and the run's summary.

Workers form a torch.distributed (Gloo) group for control -- identical initial weights, the
replica check, the evaluation result -- while gradients travel through the chosen aggregator.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..codecs import Codec
from ..schedule import AlphaBeta, parse_scheduler
from ..sync.gradient_sync import GradientSync
from ..sync.local_steps import LocalStepsSync
from ..sync.startup import agree_on_plan
from .aggregators import open_session
from .config import DDP, FSDP2, TrainConfig, stepped
from .data import augment_images, load_dataset, shard_batches, steps_per_epoch
from .guard import DivergenceGuard, all_finite
from .methods import compresses, method_name
from .models import build_model, model_sizes, sample_shape
from .peers import DDPSync
from .sharding import (
    FSDPSync,
    full_parameter,
    full_states,
    gradients_finite,
    is_sharded,
    load_full_states,
    shard_model,
)
from .trainer import Report, Schedule, Trainer


@dataclass
class EpochMetrics:
    epoch: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    samples_per_s: float
    seconds: float
    # the epoch's median step (seconds): samples/s counts every stall of a shared host, which
    # moves runs of one plan by up to 20 %; the median step is what the schedule itself costs
    median_step_s: float = 0.0


def train_worker(config: TrainConfig, rank: int, world: int) -> dict:
    """Train on this worker's shard; returns rank 0's summary (other ranks: their param digest)."""
    torch.manual_seed(config.seed)  # the same initial weights on every worker
    dataset = load_dataset(config.dataset, config.data_dir, sample_shape(config), config.seed,
                           max_bytes=config.data_bytes)  # fmt: skip
    model = build_model(config.model, dataset.num_classes, **model_sizes(config))
    model = model.to(device_of(config))
    if config.shard == FSDP2:  # before the optimizer: it steps the shards
        shard_model(model, config)
    if config.aggregator == DDP:  # torch's DDP and its hooks: the peers (train/peers.py)
        return _train(config, rank, world, dataset, model, None)
    session = open_session(config, rank, world)
    try:
        return _train(config, rank, world, dataset, model, session)
    finally:
        session.aggregator.close()


def _make_optimizer(config: TrainConfig, parameters, codec: Codec | None) -> torch.optim.Optimizer:
    decay = config.weight_decay
    parameters = list(parameters)
    fused = _fusable(parameters)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=decay, fused=fused)
    if config.optimizer != "sgd":
        raise ValueError(f"unknown optimizer {config.optimizer!r}")
    carried = codec is not None and codec.carries_momentum  # then the codec applies it
    momentum = 0.0 if carried else config.momentum
    return torch.optim.SGD(parameters, lr=config.lr, momentum=momentum, weight_decay=decay,
                           fused=fused)  # fmt: skip


def _fusable(parameters: list) -> bool | None:
    """Whether torch's fused kernel steps ``parameters``: one pass over every tensor instead of
    a dozen small ops per tensor (AdamW on the 4×256 GPT, one thread: 5 ms a step against 14,
    a tenth of a local step's CPU). Plain floating tensors on the CPU or a GPU only; sharded
    ones (FSDP2's DTensors) keep torch's default."""
    plain = all(type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point()
                and p.device.type in ("cpu", "cuda") for p in parameters)  # fmt: skip
    return True if plain and parameters else None


def _local_steps(config: TrainConfig, sync) -> LocalStepsSync:
    """Local steps over the sync: the run's optimizer becomes each worker's inner one (its weight
    decay applied to the weights by ``LocalStepsSync``, not to the round's accumulators)."""
    return LocalStepsSync(sync, config.local_steps, lambda acc: _make_optimizer(config, acc, None))


def _train(config, rank, world, dataset, model, session) -> dict:
    codec = session.codec if session is not None else None
    stepwise = stepped(config)
    # the compute of a step, every worker at once (as in training) but exchanging nothing:
    # what the communication-to-compute ratio of bench tta divides by
    compute_s = _compute_seconds(model, dataset, config) if stepwise else None
    sync, net, describe, order, predicted = _sync_for(config, model, dataset, session)
    outer = _local_steps(config, sync) if config.local_steps else None
    local = outer.state if outer else None  # the outer state: checkpoints, evaluations
    optimizer = outer.inner if outer else _make_optimizer(config, model.parameters(), codec)
    # what start-up sent (the plan's calibration), so that the counters after training say what
    # training alone cost in datagrams, retransmissions and timeouts
    start_up = {} if session is None else session.aggregator.transport_stats()
    guard = DivergenceGuard(method_name(config), config.divergence_factor,
                            fallback=config.fallback, compressed=compresses(config))  # fmt: skip
    first_epoch = (_resume(config, rank, model, optimizer, codec, sync, local)
                   if config.resume else 0)  # fmt: skip
    log = _Log(config.log if rank == 0 else None)
    log.write({"event": "config", "world": world, **asdict(config)})
    log.write({"event": "plan", "describe": describe, "order": order})
    if rank == 0 and config.progress:
        print(describe, flush=True)
    save = _saver(config, rank, model, optimizer, codec, sync, local)
    report = (_Evaluations if stepwise else _Epochs)(config, rank, world, model, dataset, log, save)
    batches = _Shards(config, rank, world, dataset, augment=dataset.augment and not stepwise)
    replicas = Worker(net, model, optimizer, sync)
    if outer is not None:
        replicas = LocalWorker(replicas, outer)
        report.evaluated = outer.synced_weights
    schedule = schedule_of(config, first_epoch)
    trainer = Trainer(replicas, batches, report, schedule, guard=guard, decides=rank == 0)
    try:
        trainer.run()
        if outer is not None:  # a round in flight arrives; the model ends at the start weights
            replicas.finish()
        check_replicas(list(model.parameters()))
        digest = parameter_digest(model)
        total = {} if session is None else session.aggregator.transport_stats()
    finally:
        sync.close()
    summary = _summary(config, world, report.history, digest, describe)
    # rank 0's datagrams: what loss recovery cost it in training, and apart, at start-up
    summary["transport"] = {key: n - start_up.get(key, 0) for key, n in total.items()}
    summary["transport_start_up"] = start_up
    summary["predicted_step_s"] = predicted
    summary.update(method=method_name(config), fallbacks=guard.fallbacks, loss_jumps=guard.jumps,
                   steps=trainer.count)  # fmt: skip
    if stepwise:
        samples = config.batch_size * world  # per step
        summary.update(_stepped_summary(report.evals, compute_s, trainer.durations, samples))
    log.write({"event": "summary", **summary})
    return summary


def _sync_for(config, model, dataset, session):
    """(sync, the module a step runs, the plan's description, its order, its predicted step):
    torch's DDP without a Session, else ``GradientSync`` on the plan the workers agree on; a
    sharded model's reduce-scatter, the Session's codec in it or torch's own."""
    if config.shard == FSDP2:
        sync = FSDPSync(model, config, session)
        return sync, model, sync.describe, [], None
    if session is None:
        sync = DDPSync(model, config)
        return sync, sync.net, f"torch DDP, hook {config.ddp_hook}", [], None
    scheduler, options = parse_scheduler(config.scheduler)
    if scheduler == "fusion":
        options = {"threshold": config.fusion_elements, **options}
    batch = dataset.train.inputs[: config.batch_size].to(device_of(config))
    chosen = agree_on_plan(
        scheduler,
        model,
        batch,
        session,
        options=options,
        model_name=config.model,
        fit=AlphaBeta(*config.fixed_cost) if config.fixed_cost else None,
        message_delay=config.message_delay,
    )
    sync = GradientSync(
        model,
        session,
        plan=chosen.plan,
        order=chosen.order,
        timeout=config.timeout,
        message_delay=config.message_delay,
        on_backward=not config.local_steps,  # local steps send only their outer rounds
    )
    return sync, model, chosen.describe(), chosen.order, chosen.predicted_step_s()


def schedule_of(config: TrainConfig, first_epoch: int = 0) -> Schedule:
    """The run's stopping rules and evaluations: by steps, or by ``config.epochs``."""
    return Schedule(
        epochs=None if stepped(config) else config.epochs,
        max_steps=config.max_steps,
        time_budget=config.time_budget,
        target_loss=config.target_loss,
        eval_every=config.eval_every,
        eval_seconds=config.eval_seconds,
        uncompressed_steps=config.uncompressed_steps,
        first_epoch=first_epoch,
    )


def task_loss(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class logits (N, C), or of next-token logits (N, T, V) per token."""
    if outputs.dim() == 3:
        return torch.nn.functional.cross_entropy(outputs.flatten(0, 1), labels.flatten().long())
    return torch.nn.functional.cross_entropy(outputs, labels.long())


class Worker:
    """A real worker's side of the Trainer's step: its model (``net``: the model, or DDP's
    wrapper of it), its optimizer and its sync (``GradientSync`` over the Session, or
    ``DDPSync``). The loss is averaged over workers in one small all-reduce of the control
    group, which also carries a request to stop."""

    agreement_lag = 0

    def __init__(self, net, model, optimizer, sync) -> None:
        self.net, self.model, self.optimizer, self.sync = net, model, optimizer, sync

    @property
    def step(self) -> int:
        return self.sync.step

    def forward(self, inputs, labels):
        outputs = self.net(inputs)
        return task_loss(outputs, labels), outputs

    def agree(self, loss, stop: bool) -> tuple[float, bool]:
        return _agreed(*_launch_agreement(loss.detach(), stop))

    def backward(self, loss) -> None:
        loss.backward()
        self.sync.wait()

    def gradients_finite(self) -> bool:
        return _gradients_finite(self.model)

    def uncompressed(self):
        return self.sync.uncompressed()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def apply(self) -> None:
        self.optimizer.step()


class LocalWorker:
    """The Trainer's ``Replicas`` for local steps (train/trainer.py): ``worker`` computes the
    forward and the loss agreement; backward stays local; ``apply`` is ``LocalStepsSync.step``:
    the inner step, and the outer round when one is due. A step the Trainer runs uncompressed
    (warm-up, or a retry) sends its round, when one is due, uncompressed too, so
    ``--uncompressed-steps N`` sends the first N outer rounds through the lossless codec."""

    # Between rounds nothing else makes a worker wait for the others, so a step does not wait
    # for its loss agreement either: it travels while the next step computes. Waiting for it
    # made every step wait for the slowest worker and for its few bytes, queued behind the
    # rounds' datagrams on the link (the 4x256 GPT at 100 Mbit/s, two fragments: 0.18 s a
    # step, against 0.135 s with the agreement a step late).
    agreement_lag = 1

    def __init__(self, worker: Worker, outer: LocalStepsSync) -> None:
        self.worker, self.outer = worker, outer
        self._agreement: tuple | None = None  # the step before's, travelling

    @property
    def step(self) -> int:
        return self.outer.sync.step  # outer rounds: a fragment's is one

    def forward(self, inputs, labels):
        return self.worker.forward(inputs, labels)

    def agree(self, loss, stop: bool) -> tuple[float | None, bool]:
        """The step before's agreement (None at the first); this step's is launched. A request
        to stop is honoured a step later, by every worker at the same step."""
        last, self._agreement = self._agreement, None
        mean, stopping = (None, False) if last is None else _agreed(*last)
        if not stopping:
            self._agreement = _launch_agreement(loss.detach(), stop)
        return mean, stopping

    def finish(self) -> None:
        """The last agreement arrives, then ``LocalStepsSync.finish``: the model ends at the
        synced weights."""
        last, self._agreement = self._agreement, None
        if last is not None:
            _agreed(*last)
        self.outer.finish()

    def backward(self, loss) -> None:
        loss.backward()  # this worker's own gradient: the inner steps exchange nothing

    def gradients_finite(self) -> bool:
        return self.worker.gradients_finite()

    def uncompressed(self):
        return self.outer.uncompressed()

    def zero_grad(self) -> None:
        # the model's gradients: the worker's optimizer is the inner one, over the accumulators
        self.worker.model.zero_grad(set_to_none=False)

    def apply(self) -> None:
        self.outer.step()


def _launch_agreement(loss: torch.Tensor, stop: bool) -> tuple[torch.Tensor, Any]:
    """The all-reduce of this worker's loss and request to stop, under way: (its values, its
    work, None alone)."""
    values = torch.tensor([float(loss), float(stop)], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        return values, dist.all_reduce(values, async_op=True)
    return values, None


def _agreed(values: torch.Tensor, work) -> tuple[float, bool]:
    """The loss averaged over workers, and whether any worker asked to stop."""
    if work is not None:
        work.wait()
        values[0] /= dist.get_world_size()
    return float(values[0]), bool(values[1] > 0)


def _gradients_finite(model: torch.nn.Module) -> bool:
    """Whether every gradient entry is finite (``guard.all_finite``); a sharded model's on
    every rank."""
    if is_sharded(model):
        return gradients_finite(model)
    return all_finite(p.grad for p in model.parameters() if p.grad is not None)


def _compute_seconds(model, dataset, config, steps: int = 3) -> float:
    """Median seconds of forward and backward on one batch, every worker at once."""
    device = device_of(config)
    inputs = dataset.train.inputs[: config.batch_size].to(device)
    labels = dataset.train.labels[: config.batch_size].to(device)
    times = []
    for _ in range(steps + 1):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        task_loss(model(inputs), labels).backward()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return sorted(times[1:])[steps // 2]  # the first one warms up


class _Shards:
    """This worker's shard of each epoch's batches; images augmented where the dataset asks
    for it (``augment``), from a generator of the worker's own."""

    def __init__(self, config, rank, world, dataset, augment: bool) -> None:
        self.config, self.rank, self.world, self.dataset = config, rank, world, dataset
        self.device = device_of(config)
        self.augment = torch.Generator().manual_seed(config.seed * 7919 + rank) if augment else None

    def epoch(self, epoch: int):
        config, train = self.config, self.dataset.train
        if steps_per_epoch(train, self.world, config.batch_size) == 0:
            raise ValueError(
                f"--batch-size {config.batch_size} x {self.world} workers exceeds "
                f"the {len(train)} training samples"
            )
        return shard_batches(train, self.rank, self.world, config.batch_size, epoch, config.seed)

    def prepare(self, inputs, labels):
        if self.augment is not None:
            inputs = augment_images(inputs, self.augment)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


class _WorkerReport(Report):
    def __init__(self, config, rank, world, model, dataset, log, save) -> None:
        self.config, self.rank, self.world, self.model = config, rank, world, model
        self.dataset, self.log, self.save = dataset, log, save
        self.history: list[EpochMetrics] = []  # by epochs
        self.evals: list[dict] = []  # by steps: worker 0's evaluations
        # the weights evaluated: the model's, or with local steps the synced ones
        # (sync/local_steps.py)
        self.evaluated = contextlib.nullcontext

    def _accuracy(self) -> float:
        with self.evaluated():
            return evaluate(self.model, self.dataset.test)


class _Evaluations(_WorkerReport):
    """Worker 0 evaluates on the schedule's steps and seconds, outside the timed region: the
    step, seconds of training so far, validation loss and accuracy."""

    def evaluate(self, step: int, clock: float) -> float | None:
        if self.rank != 0:
            if is_sharded(self.model):  # a sharded forward is a collective: every rank runs it
                validation(self.model, self.dataset.test, self.config.eval_samples)
                self.model.train()
            return None
        config = self.config
        with self.evaluated():
            loss, accuracy = validation(self.model, self.dataset.test, config.eval_samples)
        record = {"step": step, "seconds": clock, "val_loss": loss, "val_accuracy": accuracy}
        self.evals.append(record)
        self.log.write({"event": "eval", **record})
        if config.progress:
            bits = loss / math.log(2)
            line = f"step {step}  {clock:.1f} s  val loss {loss:.4f}  ({bits:.3f} bits per byte)"
            print(line, flush=True)
        self.model.train()
        return loss


class _Epochs(_WorkerReport):
    """Each epoch's training loss and accuracy (summed on the device, read once at its end),
    test accuracy, throughput and median step; a checkpoint after each, when asked."""

    def begin_epoch(self, epoch: int) -> None:
        self.model.train()
        config = self.config
        steps = steps_per_epoch(self.dataset.train, self.world, config.batch_size)
        self.progress = _progress_bar(steps, epoch, config) if self.rank == 0 else None
        device = device_of(config)
        # float64: the sum a Python float would make
        self.total_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.seen, self.samples = 0, 0
        self.start = time.perf_counter()

    def after_step(self, outcome, labels, index: int) -> None:
        loss, outputs = outcome
        self.total_loss += loss.detach().to(torch.float64) * labels.numel()
        self.correct += (outputs.argmax(dim=-1) == labels).sum()
        self.seen += labels.numel()
        self.samples += len(labels)
        if self.progress is not None:
            self.progress.update(1)
            if labels.device.type == "cpu" or index % 50 == 0:  # on a GPU a read waits for it
                self.progress.set_postfix(loss=f"{loss.item():.3f}")

    def close_epoch(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def end_epoch(self, epoch: int, durations) -> None:
        total_loss, correct = float(self.total_loss), int(self.correct)  # the epoch's one read
        seconds = time.perf_counter() - self.start
        metrics = EpochMetrics(
            epoch=epoch + 1,
            loss=total_loss / max(self.seen, 1),
            train_accuracy=correct / max(self.seen, 1),
            test_accuracy=self._accuracy(),
            samples_per_s=self.world * self.samples / seconds if seconds > 0 else 0.0,
            seconds=seconds,
            median_step_s=statistics.median(durations),
        )
        self.history.append(metrics)
        self.log.write({"event": "epoch", **asdict(metrics)})
        if self.rank == 0 and self.config.progress:
            print(_epoch_line(metrics, self.config.epochs), flush=True)
        self.save(epoch)


def _stepped_summary(
    evals: list[dict], compute_s: float | None, durations: list[float], samples_per_step: int
) -> dict:
    last = evals[-1] if evals else {}
    seconds = last.get("seconds")
    val_loss = last.get("val_loss")
    return {
        "evals": evals,
        "compute_s": compute_s,
        "step_s": seconds / last["step"] if last.get("step") else None,
        "median_step_s": statistics.median(durations) if durations else None,
        "samples_per_s": samples_per_step * len(durations) / sum(durations) if durations else 0.0,
        "val_loss": val_loss,
        "bits_per_byte": val_loss / math.log(2) if val_loss is not None else None,
        "train_seconds": seconds,
    }


def device_of(config: TrainConfig) -> torch.device:
    """The worker's device: its local GPU (set by the launcher) or the CPU."""
    if config.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def evaluate(model: torch.nn.Module, split, batch_size: int = 512) -> float:
    """Accuracy on ``split`` (per token for a language model)."""
    return validation(model, split, batch_size=batch_size)[1]


@torch.no_grad()
def validation(
    model: torch.nn.Module, split, samples: int | None = None, batch_size: int = 512
) -> tuple[float, float]:
    """(mean loss, accuracy) over the first ``samples`` of ``split`` (all when None): the same
    samples at every evaluation of every run."""
    model.eval()
    count = len(split) if samples is None else min(samples, len(split))
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    seen = 0
    for start in range(0, count, batch_size):
        stop = min(start + batch_size, count)
        outputs = model(split.inputs[start:stop].to(device))
        labels = split.labels[start:stop].to(device)
        total += task_loss(outputs, labels).to(torch.float64) * labels.numel()
        correct += (outputs.argmax(dim=-1) == labels).sum()
        seen += labels.numel()
    return float(total) / max(seen, 1), int(correct) / max(seen, 1)


def parameter_digest(model: torch.nn.Module | list[torch.Tensor]) -> str:
    """A hash of every parameter's bytes (copied to the host first: a device tensor has no
    host bytes to hash)."""
    digest = hashlib.blake2b(digest_size=16)
    tensors = model if isinstance(model, list) else model.parameters()
    for parameter in tensors:
        parameter = full_parameter(parameter.detach())  # a shard's whole parameter
        digest.update(parameter.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def check_replicas(model: torch.nn.Module | list[torch.Tensor]) -> str:
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
        # the median over epochs of each epoch's median step (epochs of one run are alike)
        "median_step_s": statistics.median(m.median_step_s for m in history) if history else None,
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


def _saver(config, rank, model, optimizer, codec, sync, local=None):
    """What saves a checkpoint after an epoch: nothing without ``--checkpoint``."""
    if not config.checkpoint:
        return lambda epoch: None
    return lambda epoch: _save(config, rank, epoch, model, optimizer, codec, sync, local)


def _save(config, rank, epoch, model, optimizer, codec, sync, local=None) -> None:
    """Model and optimizer from worker 0, plus every worker's own codec state (error feedback)
    and, with local steps, its own round (start, accumulator, inner and outer optimizers). A
    sharded model's are gathered whole first (every worker takes part).

    With local steps the model saved is the synced one (the start weights every worker holds
    alike, the ones evaluated), not worker 0's own mid-round weights: that is the model a user
    takes from the checkpoint, and each worker's own weights come back from its round on
    resume."""
    if local is not None:  # no outer round running while its codec state is read
        local.settle()
    sharded = is_sharded(model)
    if sharded:
        model_state, optimizer_state = full_states(model, optimizer)
    elif rank == 0:
        model_state, optimizer_state = _synced_state(model, local), optimizer.state_dict()
    if rank == 0:
        state = {"epoch": epoch, "model": model_state, "optimizer": optimizer_state,
                 "method": method_name(config)}  # checked on resume (train/checkpoints.py)
        _save_whole(state, Path(config.checkpoint))
    codec_state = codec.state_dict() if codec is not None else {}  # DDP: torch's hook state
    own = {"codec": codec_state, "step": sync.step, "epoch": epoch,
           "local_steps": local.state_dict() if local is not None else None}  # fmt: skip
    _save_whole(own, _rank_file(config.checkpoint, rank))


def _synced_state(model, local=None) -> dict:
    if local is None:
        return model.state_dict()
    with local.synced_weights():  # a copy: the local weights come back on leaving
        return {name: value.detach().clone() for name, value in model.state_dict().items()}


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


def _resume(config, rank, model, optimizer, codec, sync, local=None) -> int:
    path, rank_path = Path(config.resume), _rank_file(config.resume, rank)
    for needed in (path, rank_path):
        if not needed.is_file():
            raise FileNotFoundError(f"--resume {config.resume}: {needed} does not exist")
    state = torch.load(path, weights_only=False)
    if is_sharded(model):
        load_full_states(model, optimizer, state["model"], state["optimizer"])
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    own = torch.load(rank_path, weights_only=False)
    if codec is not None:
        codec.load_state_dict(own["codec"])
    sync.step = own["step"]
    if local is not None:
        local.load_state_dict(own["local_steps"])  # this worker's weights, inner state and round
    return state["epoch"] + 1
