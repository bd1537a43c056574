"""What a training job is asked to do: the names `gradsum train` accepts and the job's
configuration, importable without torch (the command line lists them as choices and defaults
before anything heavy loads; ``models``, ``data`` and ``aggregators`` check these lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

AGGREGATOR_NAMES = ("allreduce", "switch", "ps")
DATASET_NAMES = ("digits", "cifar10", "synthetic")
MODEL_NAMES = (
    "resnet18",
    "resnet50",
    "vgg16",
    "alexnet",
    "digits-mlp",
    "digits-cnn",
    "digits-wide",
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
    progress: bool = True
    device: str = "cpu"  # "cuda": one GPU per local rank, NCCL for gradients (train/launch.py)
