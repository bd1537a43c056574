"""What a training job is asked to do: the names `gradsum train` accepts and the job's
configuration, declared once as sections (gradsum/config.py) whose fields carry their flags.
``gradsum train``, ``bench train`` and ``bench tta`` offer the sections they use and build a
``TrainConfig`` from them. Importable without torch (the command line lists the names as choices
and defaults before anything heavy loads; ``models``, ``data`` and ``aggregators`` check these
lists)."""

from __future__ import annotations

from dataclasses import dataclass

from ..codecs.names import CODEC_NAMES
from ..config import (
    Section,
    Sweep,
    address_list,
    argument_type,
    fixed_cost,
    non_negative_float,
    non_negative_int,
    part_of,
    positive_float,
    positive_int,
    sections_of,
    setting,
)
from ..schedule.planners import PLANNER_NAMES
from .guard import FALLBACK_NAMES

AGGREGATOR_NAMES = ("allreduce", "switch", "ps")
# The peer a PyTorch user already has: torch's DistributedDataParallel with one of its own
# communication hooks (train/peers.py), run by the same launcher over the same links.
DDP = "ddp"
DDP_HOOK_NAMES = ("allreduce", "fp16", "bf16", "powersgd")
# Whether the model is replicated on every worker or sharded with FSDP2 (train/sharding.py):
# per transformer block for the gpt, per layer for the others; the gradients then go by
# FSDP2's reduce-scatter, gradsum's codec in it (--aggregator allreduce) or torch's own
# (--aggregator ddp: fp32, or bf16 with --ddp-hook bf16).
FSDP2 = "fsdp2"
SHARD_NAMES = ("none", FSDP2)
OPTIMIZER_NAMES = ("sgd", "adamw")
DATASET_NAMES = ("digits", "cifar10", "synthetic", "stdlib")
# What loading a data set imports beyond torch (the launcher's forkserver imports it once:
# gradsum/processes.py)
DATASET_MODULES = {"digits": ("sklearn.datasets",)}
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

# What a benchmark runs over instead of one value of their fields (gradsum/config.py)
METHODS = Sweep(
    "--methods",
    "comma-separated methods, the first the baseline: AGGREGATOR:CODEC or "
    "AGGREGATOR:CODEC(option=value,...) (gradsum's), ddp, ddp:fp16, ddp:bf16, ddp:powersgdR "
    "(torch DDP and its hooks, R the rank), fsdp2, fsdp2:bf16 (FSDP2 and its reduce-scatter, "
    "fp32 or bf16), fsdp2:CODEC(option=value,...) (FSDP2 with gradsum's codec in it); a gradsum "
    "method with +diloco(h=H,lr=LR,momentum=M,overlap=T) takes local steps (--local-steps)",
)
SCHEDULERS = Sweep(
    "--schedulers",
    "comma-separated communication schedules, each run with every method, options in "
    "parentheses (e.g. default,wfbp,imerge,imerge(interleave=true); docs/scheduling.md)",
)
SEEDS = Sweep(
    "--seeds",
    "comma-separated seeds: each method runs once per seed (weights, batches and the codecs' "
    "randomness), and the table adds each method's median over them",
)


def _on(aggregators: tuple[str, ...], words: str):
    def applies(config) -> str | None:
        return None if config.aggregator in aggregators else f"applies to {words} only"

    return applies


_on_services = _on(("switch", "ps"), "--aggregator switch and ps")


def _gradsum_codec(config) -> str | None:
    if config.aggregator == DDP:
        return "does not apply to --aggregator ddp: torch DDP compresses with --ddp-hook"
    return None


def _gradsum_path(config) -> str | None:
    if config.aggregator == DDP:
        return "does not apply to --aggregator ddp: its messages skip gradsum's senders"
    return None


def _unsharded(config) -> str | None:
    if config.shard == FSDP2:
        return "does not apply to --shard fsdp2: it reduce-scatters each block in backward"
    return None


def _powersgd_hook(config) -> str | None:
    if config.aggregator != DDP or config.ddp_hook != "powersgd":
        return "applies to --aggregator ddp --ddp-hook powersgd only"
    return None


def _gpt(config) -> str | None:
    return None if config.model == "gpt" else "applies to --model gpt only"


def stepped(config) -> bool:
    """Whether the run goes by steps (``--max-steps``, ``--eval-every``, ``--eval-seconds``)
    instead of epochs."""
    return any(v is not None for v in (config.max_steps, config.eval_every, config.eval_seconds))


def _by_steps(config) -> str | None:
    if stepped(config):
        return None
    return "applies to step-based runs only (--max-steps, --eval-every or --eval-seconds)"


def _by_epochs(config) -> str | None:
    if stepped(config):
        return "applies to epoch-based runs only, not by steps (--max-steps, --eval-every, ...)"
    return None


def _codec_spec(text: str) -> tuple[str, str]:
    from .methods import codec_spec  # methods imports this module's names

    return codec_spec(text)


def _local_steps_spec(text: str) -> str:
    from ..sync.local_steps import parse_local_steps

    parse_local_steps(text)
    return text.replace(" ", "")


def _scheduler_spec(text: str) -> str:
    from ..schedule import parse_scheduler

    parse_scheduler(text)
    return text.strip()


def _show_spec(value: tuple[str, str]) -> str:
    name, options = value
    return f"{name}({options})" if options else name


@dataclass
class Workload(Section):
    title = "the workload: model, data and batch"
    model: str = setting("digits-mlp", choices=MODEL_NAMES, help="the network trained")
    dataset: str = setting("digits", choices=DATASET_NAMES, help="what it trains on")
    data_dir: str | None = setting(
        None, help="directory holding the dataset's files (cifar10's; stdlib: Python's own)",
        applies=lambda c: None if c.dataset in ("cifar10", "stdlib")
        else "applies to --dataset cifar10 and stdlib only",
    )  # fmt: skip
    workers: int = setting(
        4, parse=positive_int, help="local worker processes (under torchrun: its world size)"
    )
    batch_size: int = setting(16, parse=positive_int, help="samples per worker and step")
    seed: int = setting(0, parse=int, sweep=SEEDS.flag,
                        help="initial weights, batches and the codecs' randomness")  # fmt: skip
    # the gpt model's sizes (the other models have fixed shapes)
    layers: int = setting(4, parse=positive_int, applies=_gpt, help="gpt's transformer blocks")
    width: int = setting(256, parse=positive_int, applies=_gpt, help="gpt's model dimension")
    heads: int = setting(4, parse=positive_int, applies=_gpt, help="gpt's attention heads")
    context: int = setting(128, parse=positive_int, applies=_gpt, help="gpt's, in tokens")
    data_bytes: int | None = setting(
        None, parse=positive_int, shown_default="8 MiB",
        help="bytes of training text (stdlib; validation an eighth of it)",
        applies=lambda c: None if c.dataset == "stdlib" else "applies to --dataset stdlib only",
    )  # fmt: skip


@dataclass
class Optimizer(Section):
    title = "the optimizer"
    optimizer: str = setting("sgd", choices=OPTIMIZER_NAMES, help="every worker's optimizer")
    lr: float = setting(0.1, parse=float, help="the optimizer's learning rate")
    momentum: float = setting(
        0.9, parse=float, help="SGD's momentum",
        applies=lambda c: None if c.optimizer == "sgd" else "applies to --optimizer sgd only",
    )  # fmt: skip
    weight_decay: float = setting(0.0, parse=float, help="the optimizer's weight decay")


@dataclass
class Method(Section):
    title = "the method: gradsum's aggregator and codec, or torch DDP and its hook"
    aggregator: str = setting(
        "switch", choices=(*AGGREGATOR_NAMES, DDP), sweep=METHODS.flag,
        help="gradsum's aggregators, or ddp: torch's DistributedDataParallel with --ddp-hook",
    )  # fmt: skip
    codec: str = setting(
        "thc", parse=argument_type(_codec_spec), sets=("codec", "codec_options"), show=_show_spec,
        metavar="CODEC[(OPTION=VALUE,...)]", sweep=METHODS.flag, applies=_gradsum_codec,
        help=f"the codec, one of {', '.join(CODEC_NAMES)}, with its options in parentheses, "
        "e.g. 'thc(correlated=true,bits=4)' (unnamed options keep the codec's defaults)",
    )  # fmt: skip
    codec_options: str = part_of("codec", "")
    ddp_hook: str = setting("allreduce", choices=DDP_HOOK_NAMES, sweep=METHODS.flag,
                            applies=_on((DDP,), "--aggregator ddp"),
                            help="torch's DDP hook (allreduce: plain fp32)")  # fmt: skip
    powersgd_rank: int = setting(2, parse=positive_int, sweep=METHODS.flag,
                                 applies=_powersgd_hook,
                                 help="torch's PowerSGD hook's rank")  # fmt: skip
    powersgd_start: int = setting(
        2,
        parse=positive_int,
        applies=_powersgd_hook,
        help="uncompressed steps before torch's PowerSGD (at least 2)",
    )
    powersgd_first_q: str = setting(
        "own", choices=("own", "shape"), applies=_powersgd_hook,
        help="torch's PowerSGD hook's first Q per matrix: its own draw, or drawn from the seed "
        "and the matrix's shape as gradsum's powersgd(first_q=shape) draws it",
    )  # fmt: skip
    # DiLoCo: the optimizer above becomes the inner one, each worker's own (sync/local_steps.py)
    local_steps: str | None = setting(
        None, parse=argument_type(_local_steps_spec), sweep=METHODS.flag, applies=_gradsum_codec,
        metavar="diloco(h=H,lr=LR,momentum=M,overlap=T,fragments=F)",
        shown_default="none: every step syncs",
        help="take H local steps of the optimizer on each worker, then average the "
        "pseudo-gradient (start - local weights) through the aggregator and codec and apply it "
        "with an outer Nesterov SGD (DiLoCo; defaults h=32, lr=0.7, momentum=0.9); overlap=T: "
        "the next T inner steps run while the round travels (default 0: wait for it); "
        "fragments=F: the model in F fragments that sync in turn, one every H/F steps "
        "(Streaming DiLoCo; T at most H/F)",
    )  # fmt: skip
    # With AdamW the first gradients set the optimizer's moments; PowerSGD's first rank-r
    # guesses from a random Q set them badly, and a run does not win back the loss it loses there
    shard: str = setting(
        "none", choices=SHARD_NAMES, sweep=METHODS.flag,
        help="fsdp2: shard the model with FSDP2 (per transformer block, per layer for the "
        "other models), gradients by its reduce-scatter: the codec's with --aggregator "
        "allreduce, torch's own with --aggregator ddp (--ddp-hook allreduce: fp32, bf16)",
    )  # fmt: skip
    uncompressed_steps: int = setting(
        0, parse=non_negative_int, metavar="N",
        help="the first N steps go uncompressed (fp32; bfp on a switch), whatever the codec or "
        "hook: what torch's PowerSGD hook does with its own --powersgd-start",
    )  # fmt: skip

    def check(self) -> None:
        if self.shard == FSDP2 and self.local_steps is not None:
            raise ValueError(
                f"--local-steps {self.local_steps} --shard fsdp2: local steps keep each "
                "worker's whole model and average it every H steps; FSDP2 shards the model and "
                "reduce-scatters every step. Use one: drop --shard, or --local-steps"
            )
        if self.shard == FSDP2:
            from .sharding import check_sharding

            check_sharding(self)
        if self.aggregator == DDP:
            return
        from ..spec import parse_options
        from .aggregators import check_compatible

        try:
            check_compatible(self.aggregator, self.codec, parse_options(self.codec_options))
        except ValueError as error:
            spec = _show_spec((self.codec, self.codec_options))
            raise ValueError(f"--aggregator {self.aggregator} --codec {spec}: {error}") from None


@dataclass
class Schedule(Section):
    title = "the communication schedule"
    scheduler: str = setting(
        "wfbp", parse=argument_type(_scheduler_spec), sweep=SCHEDULERS.flag,
        metavar="POLICY[(OPTION=VALUE,...)]", applies=_unsharded,
        help="communication plan, made at start-up from a measured profile and α-β "
        f"(docs/scheduling.md): {', '.join(PLANNER_NAMES)}, with the planner's options in "
        "parentheses, e.g. 'imerge(interleave=true,window=group)'",
    )  # fmt: skip
    fusion_elements: int = setting(
        500_000, parse=positive_int, applies=_unsharded,
        help="static fusion's threshold where --scheduler fusion "
        "names none",
    )  # fmt: skip
    # (α s per message, β s per byte) to plan with instead of the start-up calibration, for
    # plans that must not depend on how loaded the machine is (tests, reproduced runs).
    fixed_cost: tuple[float, float] | None = setting(
        None, parse=fixed_cost, metavar="ALPHA,BETA", show=lambda v: ",".join(map(repr, v)),
        help="plan with this per-message cost instead of measuring it at start-up: α seconds "
        "per message and β seconds per byte (1e-3,3.3e-8 is 1 ms and 30 MB/s)",
    )  # fmt: skip
    # Seconds injected per message on the worker's one communication thread, before each send
    # and after each answer (PS parts, or whole groups): a per-message cost made real on the
    # path, for measuring schedules where start-ups dominate (docs/scheduling.md).
    message_delay: float = setting(
        0.0, parse=non_negative_float, metavar="SECONDS", applies=_gradsum_path,
        help="inject this many seconds per message on each worker's one communication thread "
        "(before a send, after its answer; serial across shards); the planners are told",
    )  # fmt: skip

    def check(self) -> None:
        if not self.message_delay < 1:
            raise ValueError(f"--message-delay {self.message_delay}: seconds in [0, 1)")


@dataclass
class Transport(Section):
    title = "the transport to the switch or the PS"
    timeout: float = setting(120.0, parse=positive_float, help="seconds any wait may take")
    liveness: float = setting(
        3.0, parse=non_negative_float, metavar="SECONDS", applies=_on_services,
        help="seconds without a result before a round checks that its aggregators and the "
        "other workers are alive (0: never)",
    )  # fmt: skip
    mtu: int | None = setting(
        None, parse=int, applies=_on_services, shown_default="datagrams of up to 64 KiB",
        help="path MTU to the switch/servers, e.g. 9000 with jumbo frames: packets that fit one "
        "frame, a chunk of them per UDP GSO send",
    )  # fmt: skip
    window_bytes: int | None = setting(
        None, parse=positive_int, metavar="BYTES", applies=_on_services, shown_default="32 chunks",
        help="bytes each worker keeps in flight to each switch/server stream. Size it to the "
        "path's buffer: a window larger than a slow link's queue loses packets every round",
    )  # fmt: skip

    def check(self) -> None:
        from ..dataplane.geometry import MAX_MTU, MIN_MTU

        if self.mtu is not None and not MIN_MTU <= self.mtu <= MAX_MTU:
            raise ValueError(f"--mtu {self.mtu}: must be between {MIN_MTU} and {MAX_MTU}")


@dataclass
class Aggregators(Section):
    title = "running aggregators (default: started here)"
    switch: str | None = setting(
        None, metavar="HOST:PORT", applies=_on(("switch",), "--aggregator switch"),
        help="a running `gradsum switch` (a comma list, one per pipeline, for `gradsum switch "
        "--pipelines N`)",
    )  # fmt: skip
    servers: list[str] = setting(
        default_factory=list, parse=address_list, show=",".join, metavar="HOST:PORT,...",
        applies=_on(("ps",), "--aggregator ps"), shown_default="none",
        help="running `gradsum server`s",
    )  # fmt: skip
    standby: list[str] = setting(
        default_factory=list, parse=address_list, show=",".join, metavar="HOST:PORT,...",
        applies=_on_services, shown_default="none: wait for a lost one to come back",
        help="standby aggregators, one per --switch/--servers address: a lost aggregator's jobs "
        "move to its standby",
    )  # fmt: skip


@dataclass
class Steps(Section):
    title = "how long it trains and when it evaluates"
    epochs: int = setting(5, parse=positive_int, applies=_by_epochs,
                          help="epochs in all (a resumed run trains up to this many)")  # fmt: skip
    # With max_steps or eval_every or eval_seconds set, training runs by steps instead of
    # epochs, evaluates every eval_every steps and every eval_seconds seconds of training
    # (worker 0's clock) outside its timed region, and stops at max_steps, after time_budget
    # seconds of training, or once the validation loss reaches target_loss.
    max_steps: int | None = setting(None, parse=positive_int, help="train by steps, this many")
    eval_every: int | None = setting(
        None, parse=positive_int, help="evaluate every N steps, outside the timed region"
    )
    eval_seconds: float | None = setting(
        None, parse=positive_float,
        help="also evaluate every S seconds of training, so methods of different step times "
        "are seen at the same wall-clock times",
    )  # fmt: skip
    # Worker 0 evaluates while the others wait for it in the next step's agreement, within
    # --timeout: 1,024 of stdlib's validation sequences take the GPT 18 s on one core, all
    # 8,191 of them eight times that, past the default --timeout
    eval_samples: int | None = setting(1024, parse=positive_int, applies=_by_steps,
                                       help="validation samples per evaluation")  # fmt: skip
    time_budget: float | None = setting(
        None, parse=positive_float, applies=_by_steps,
        help="stop after this many seconds of training (evaluations not counted)",
    )  # fmt: skip
    target_loss: float | None = setting(
        None, parse=float, applies=_by_steps, help="stop once the validation loss is at most this"
    )


@dataclass
class Guard(Section):
    title = "the divergence guard"
    divergence_factor: float = setting(
        3.0, parse=positive_float,
        help="a loss held above this times its running mean (the median of 5 steps) stops "
        "training; one step above it is retried uncompressed with --fallback none",
    )  # fmt: skip
    fallback: str = setting(
        "stop", choices=FALLBACK_NAMES,
        help="on divergence: stop, or retry the step uncompressed (none) and count it",
    )  # fmt: skip


@dataclass
class Checkpoint(Section):
    title = "checkpoints"
    checkpoint: str | None = setting(
        None, applies=_by_epochs, help="save model, optimizer and codec state here each epoch"
    )
    resume: str | None = setting(
        None, applies=_by_epochs,
        help="resume from a --checkpoint path made with the same aggregator and codec",
    )  # fmt: skip

    def check(self) -> None:
        if self.resume is not None:
            from .checkpoints import check_resume

            check_resume(self)


@dataclass
class Device(Section):
    title = "the device"
    device: str = setting(
        "cpu", choices=("cuda", "cpu"), shown_default="cuda when present, else cpu",
        help="where the model trains: one GPU per local rank, gradients over NCCL where the "
        "aggregator is all-reduce (Gloo where workers share a GPU)",
    )  # fmt: skip


@dataclass
class Run(Section):
    title = "this run"
    # torchrun reads a script's `--log` as an ambiguous abbreviation of its own --log-dir and
    # --logs-specs and refuses to start; `--log-file` is no prefix of any flag of torchrun's
    log: str | None = setting(
        None, aliases=("--log-file",),
        help="write JSON lines here (last line: the summary); under torchrun spell it --log-file",
    )  # fmt: skip
    progress: bool = setting(True, help="print each epoch or evaluation as it ends")


@dataclass
class TrainConfig(Workload, Optimizer, Method, Schedule, Transport, Aggregators, Steps, Guard,
                  Checkpoint, Device, Run):  # fmt: skip
    """A training job. The codec may be given as its spec, ``TrainConfig(codec="thc(bits=2)")``,
    as the command line writes it; it is kept as the codec's name and its options' text."""

    def __post_init__(self) -> None:
        if "(" in self.codec:
            from ..spec import split_spec

            if self.codec_options:
                raise ValueError(
                    f"codec {self.codec!r} and codec_options {self.codec_options!r}: give the "
                    "options in one of them"
                )
            self.codec, self.codec_options = split_spec(self.codec)


SECTIONS = tuple(sections_of(TrainConfig))
# what a benchmark's runs take: each starts its own aggregators, keeps no checkpoint and prints
# its own row
BENCH_SECTIONS = (Workload, Optimizer, Method, Schedule, Transport, Steps, Guard, Device)
