"""What a training job is asked to do: the names `gradsum train` accepts and the job's
configuration, importable without torch (the command line lists them as choices and defaults
before anything heavy loads; ``models``, ``data`` and ``aggregators`` check these lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

AGGREGATOR_NAMES = ("allreduce", "switch", "ps")
# The peer a PyTorch user already has: torch's DistributedDataParallel with one of its own
# communication hooks (train/peers.py), run by the same launcher over the same links.
DDP = "ddp"
DDP_HOOK_NAMES = ("allreduce", "fp16", "bf16", "powersgd")
OPTIMIZER_NAMES = ("sgd", "adamw")
DATASET_NAMES = ("digits", "cifar10", "synthetic", "stdlib")
MODEL_NAMES = (
    "resnet18",
    "resnet50",
    "vgg16",
    "alexnet",
    "digits-mlp",
    "digits-cnn",
    "digits-wide",
    "gpt",
)


@dataclass
class TrainConfig:
    aggregator: str = "switch"
    codec: str = "thc"
    codec_options: str = ""
    scheduler: str = "wfbp"
    fusion_elements: int = 500_000
    # (α s per message, β s per byte) to plan with instead of the start-up calibration, for
    # plans that must not depend on how loaded the machine is (tests, reproduced runs).
    fixed_cost: tuple[float, float] | None = None
    # Seconds injected per message on the worker's one communication thread, before each send
    # and after each answer (PS parts, or whole groups): a per-message cost made real on the
    # path, for measuring schedules where start-ups dominate (docs/scheduling.md).
    message_delay: float = 0.0
    model: str = "digits-mlp"
    dataset: str = "digits"
    data_dir: str | None = None
    workers: int = 4
    epochs: int = 5
    batch_size: int = 16  # per worker
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    log: str | None = None
    checkpoint: str | None = None
    resume: str | None = None
    switch: str | None = None  # HOST:PORT of a running switch (else one is started locally)
    servers: list[str] = field(default_factory=list)  # HOST:PORT of running PS shards
    timeout: float = 120.0  # seconds any single wait may take
    # aggregators that take over a lost one's jobs, one per --switch/--servers address
    standby: list[str] = field(default_factory=list)
    liveness: float = 3.0  # seconds without a result before a round checks its aggregators
    mtu: int | None = None  # path MTU to the aggregators: packets of one frame (net/client.py)
    # bytes a worker keeps in flight to the switch/servers (net/client.py; None: 32 chunks)
    window_bytes: int | None = None
    progress: bool = True
    device: str = "cpu"  # "cuda": one GPU per local rank, NCCL for gradients (train/launch.py)
    optimizer: str = "sgd"
    # torch DDP's hook when aggregator == "ddp" (codec is then unused)
    ddp_hook: str = "allreduce"
    powersgd_rank: int = 2
    powersgd_start: int = 2  # uncompressed steps before PowerSGD (torch's minimum)
    # the first steps go uncompressed: through the aggregator's lossless codec (fp32, bfp on a
    # switch), or DDP's fp32 average (torch's PowerSGD hook has its own powersgd_start). With
    # AdamW the first gradients set the optimizer's moments; PowerSGD's first rank-r guesses from
    # a random Q set them badly, and a run does not win back the loss it loses there
    # (docs/benchmarks.md)
    uncompressed_steps: int = 0
    # the gpt model's sizes (the other models have fixed shapes)
    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128
    data_bytes: int | None = None  # stdlib: bytes of training text (data.STDLIB_BYTES)
    # Step-based runs with a fixed evaluation schedule (bench tta): with max_steps or
    # eval_every or eval_seconds set, training runs by steps instead of epochs, evaluates every
    # eval_every steps and every eval_seconds seconds of training (worker 0's clock) outside
    # its timed region, and stops at max_steps, after time_budget seconds of training, or once
    # the validation loss reaches target_loss.
    max_steps: int | None = None
    eval_every: int | None = None
    eval_seconds: float | None = None
    eval_samples: int | None = None  # validation samples per evaluation (None: all)
    time_budget: float | None = None
    target_loss: float | None = None
    # the divergence guard (train/guard.py)
    divergence_factor: float = 3.0
    fallback: str = "stop"


# What every worker's environment sets before its OpenMP runtime starts (the local launcher's and
# the testbed's; torchrun sets the same). torch.set_num_threads sizes the intra-op pool of the
# thread that calls it; every other thread of a worker (Gloo's callbacks, which run torch's
# PowerSGD hook, and gradsum's communication thread) takes OpenMP's default, one thread per
# core. With several, MKL's matrix products there are not bitwise reproducible, so two workers
# could decompress the same all-reduced P and Q into different gradients: the digits MLP with
# ddp:powersgd2 ended with "replicas diverged" after 4 to 12 steps in every run on 2 workers,
# and in none with this set.
WORKER_ENVIRONMENT = {"OMP_NUM_THREADS": "1"}
