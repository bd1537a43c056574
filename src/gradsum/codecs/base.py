"""The codec interface: the three places a codec runs, and what crosses the wire between them.

A round of aggregation for one partition of a gradient, with n workers::

    worker i:    x_i' = codec.precondition(x_i, ctx_i)       # error feedback, momentum (stateful)
                 s_i  = codec.summarize(x_i')                # preliminary round, if any
    aggregator:  s    = elementwise max over s_i             # integer MAX on the switch
    worker i:    p_i  = codec.encode(x_i', ctx_i, s)         # wire payload (packed)
    aggregator:  P    = codec.aggregate([p_1 .. p_m], ctx)   # m <= n contributors
    worker i:    avg  = codec.decode(P, s)                   # divides by P.contributors

Every preliminary round is an elementwise MAX (a minimum is sent negated), so a switch that can
only add and compare integers serves all of them (see ``float_to_ordered_int``).

How the aggregator may combine payloads is declared by ``Codec.aggregation``:

* ``INTEGER_SUM`` and ``LOOKUP_SUM``: homomorphic and integer-only; a switch can run them.
  ``integer_op(workers)`` describes the operation exactly (table, wire widths).
* ``FLOAT_SUM``: homomorphic over floats; a parameter server sums without decoding.
* ``DECODE_SUM_ENCODE``: not homomorphic; a parameter server decodes every payload, sums and
  re-encodes the sum for the downstream, which costs time and adds a second compression error.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from .lanes import IntegerOp


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf; compressing it would produce a garbage aggregate."""


class WidthOverflowError(ValueError):
    """An integer does not fit the wire width it must be sent in."""


class Aggregation(enum.Enum):
    INTEGER_SUM = "integer-sum"
    LOOKUP_SUM = "lookup-sum"
    FLOAT_SUM = "float-sum"
    DECODE_SUM_ENCODE = "decode-sum-encode"

    @property
    def homomorphic(self) -> bool:
        return self is not Aggregation.DECODE_SUM_ENCODE

    @property
    def integer_only(self) -> bool:
        return self in (Aggregation.INTEGER_SUM, Aggregation.LOOKUP_SUM)


# Worker id used for the aggregator's own randomness (re-encoding at a parameter server).
AGGREGATOR = -1


@dataclass(frozen=True)
class CodecContext:
    """Identifies one encode: which randomness streams it draws from and which state it uses.

    Randomness that must differ between workers (stochastic rounding) is seeded from
    (seed, worker, step, partition); randomness all workers must share (THC's rotation signs)
    from the seed only. ``key`` names the tensor/partition for stateful codecs.
    """

    seed: int = 0
    worker: int = 0
    step: int = 0
    partition: int = 0
    key: Hashable = None

    @property
    def state_key(self) -> Hashable:
        """Per-worker state key, so one codec object can also stand for many workers."""
        return (self.worker, self.partition if self.key is None else self.key)

    def worker_seed(self) -> int:
        return _derive_seed("worker", self.seed, self.worker, self.step, self.partition)

    def uniform(
        self, count: int, device: torch.device | str = "cpu", out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``count`` float32 draws from U[0, 1) from this worker's own stream."""
        return draw_uniform(self.worker_seed(), count, device, out)

    def stratified_uniform(
        self, count: int, workers: int, device: torch.device | str = "cpu",
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``count`` U[0, 1) draws of this worker, stratified across ``workers`` coordinate by
        coordinate (correlated rounding, Suresh et al. 2022): a random stratum shared by every
        worker of the round, shifted by the worker's rank mod ``workers``, so the workers take
        distinct strata, plus this worker's private jitter within its stratum. Each worker's
        draws are U[0, 1) (rounding stays unbiased); together they cover [0, 1) evenly."""
        out = self.uniform(count, device, out)  # the private jitter
        shared = draw_uniform(self.stratum_seed(), count, device)
        strata = shared.mul_(workers).floor_().add_(self.worker % workers).remainder_(workers)
        # (n - 1 + jitter) / n rounds to 1.0 in float32 for jitter within 2**-24 of 1; a
        # threshold of 1.0 would never round a coordinate up from probability 1
        return out.add_(strata).div_(workers).clamp_(max=1.0 - 2.0**-24)

    def stratum_seed(self) -> int:
        """The seed of the strata every worker of this round shares (correlated rounding)."""
        return _derive_seed("stratum", self.seed, self.step, self.partition)

    def shared_seed(self) -> int:
        """Fixed for the run (as in THC's reference code): a partition's rotation depends only
        on its length, so workers and steps agree and sign vectors are cached, not redrawn."""
        return _derive_seed("shared", self.seed)


def aggregator_context(ctx: CodecContext) -> CodecContext:
    """The context of the aggregator's side of the same round."""
    return CodecContext(ctx.seed, AGGREGATOR, ctx.step, ctx.partition, ctx.key)


def _derive_seed(*parts: object) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_uniform(
    seed: int, count: int, device: torch.device | str = "cpu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """Seeded U[0, 1) float32 draws. On the CPU numpy's PCG64 fills the buffer in place (about
    twice as fast as torch's generator); elsewhere torch's device generator is used."""
    device = torch.device(device)
    if out is None:
        out = torch.empty(count, dtype=torch.float32, device=device)
    if device.type == "meta":  # shapes without values (tests trace device paths on it)
        return out
    if device.type == "cpu":
        np.random.Generator(np.random.PCG64(seed)).random(out=out.numpy(), dtype=np.float32)
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        torch.rand(count, generator=generator, device=device, out=out)
    return out


_HASH_MASK = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
"""lowbias32's multipliers (Chris Wellons' integer hash), the rounds of ``hashed_uniform``."""


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """One round of the 32-bit hash, on int64 tensors holding uint32 values (a product wraps
    past 2**63, and its low 32 bits are the uint32 product's)."""
    x = x ^ (x >> 16)
    x = (x * HASH_MULTIPLIERS[0]) & _HASH_MASK
    x = x ^ (x >> 15)
    x = (x * HASH_MULTIPLIERS[1]) & _HASH_MASK
    return x ^ (x >> 16)


def hashed_uniform(
    seed: int, count: int, device: torch.device | str = "cpu", out: torch.Tensor | None = None
) -> torch.Tensor:
    """U[0, 1) float32 draws that are a function of (seed, coordinate) alone: draw i is
    lowbias32(lowbias32(i ^ lo) ^ hi) >> 8, times 2**-24 (exact; never 1.0), with lo and hi the
    seed's 32-bit halves. A kernel computes draw i where it needs it, with no stream to launch
    or store and no order to follow, so a launch over many partitions (rows) draws each row's
    own values (``thc.triton_kernels``, ``_triton._hashed_uniform``, bit for bit)."""
    device = torch.device(device)
    if out is None:
        out = torch.empty(count, dtype=torch.float32, device=device)
    if device.type == "meta":
        return out
    i = torch.arange(count, dtype=torch.int64, device=device)
    x = _lowbias32(i ^ (seed & _HASH_MASK))
    x = _lowbias32(x ^ (seed >> 32))
    return torch.mul((x >> 8).to(torch.float32), 2.0**-24, out=out)


@dataclass(frozen=True)
class Payload:
    """What crosses the wire for one partition: named, packed tensors.

    ``length`` is the number of gradient coordinates represented, ``contributors`` how many
    workers' payloads were summed into it (1 upstream; up to n downstream). ``counts``, only
    downstream after partial aggregation, holds the contributors of every lane
    (``Codec.lanes(length)`` of them) when they differ (chunks completed by different quorums);
    ``contributors`` is then 1.
    """

    fields: dict[str, torch.Tensor]
    length: int
    contributors: int = 1
    meta: dict[str, float] = field(default_factory=dict)
    counts: torch.Tensor | None = None
    unpacked: bool = False
    """The downstream lane field holds one integer per lane (uint8, float16 or int32, as a
    summing transport added them) instead of lanes packed in the codec's declared width: the
    decode reads them as they are, nothing is repacked."""

    @property
    def nbytes(self) -> int:
        tensors = sum(t.numel() * t.element_size() for t in self.fields.values())
        return tensors + 4 * len(self.meta)  # scalars travel as 4-byte values

    def bits_per_coordinate(self) -> float:
        return 8.0 * self.nbytes / max(self.length, 1)


class LaneCoder(Protocol):
    """A round's lanes coded packet by packet (``Codec.lane_coder``): lane i is the round's
    coordinate i. A transport encodes a packet's lanes just before it sends them (again for a
    resend: the same bits) and decodes a result right where it landed, so neither the packed
    upstream nor the summed downstream of the whole round is written and read back.

    ``native``: the fields the worker's pump (net/_pump.c) codes with in C, the same bits, or
    None where only these methods can."""

    length: int  # the round's coordinates; lanes past them are padding, sent as zeros
    native: dict | None

    def encode(self, first: int, count: int, into: memoryview) -> None:
        """Lanes [first, first + count) into ``into`` (their wire bytes)."""

    def decode(self, first: int, count: int, data: memoryview, contributors: int) -> None:
        """The sums of lanes [first, first + count) (``data``, their wire bytes), over
        ``contributors`` workers, decoded into the round's output."""


class Codec(ABC):
    """Base class of all codecs; see the module docstring for the round structure.

    Besides ``aggregation``, a codec declares the facts a transport needs to carry it, so no
    transport keeps tables of codec names:

    * ``lane_fields``: for homomorphic codecs, the payload field sent upstream as lanes (one
      per coordinate of ``lanes(length)``, ``lane_widths()[0]`` bits each) and the field the
      downstream sum fills (``lane_widths()[1]`` bits each). ``None``: whole payloads, which an
      aggregator decodes, sums and re-encodes.
    * ``linear_decode``: the decode is linear in every lane's average (its sum divided by its
      contributors) before anything mixes lanes, so chunks summed by different quorums decode
      with each lane's own count (``Payload.counts``, ``decode_counted``): bfp and fp32, whose
      lanes are the coordinates, and THC, whose lanes are rotated coordinates that the decode
      divides one by one before the inverse rotation.
    * ``blockwise``: coordinates per block that summarizes, encodes and decodes independently
      of every other block (one summary entry per block); a round may then cut a partition into
      pieces of whole blocks and stream them, with the whole partition's values bit for bit.
    * ``costly_preparation``: ``precondition`` and ``summarize`` cost about what the encode
      does (THC under error feedback: its rotation), so a streaming round prepares partitions
      in waves behind the SUM of earlier ones (``codecs.round``); a cheap one (bfp) is better
      served by one MAX for all.
    * ``stages``: how many MAX and SUM rounds one round takes (1; PowerSGD: 2). A codec of
      several stages derives each stage's inputs with ``stage_input`` and the partition's
      average with ``finish``; its wire facts hold for every stage.

    Thread safety, a property every codec keeps: one codec object may run rounds from several
    threads at once (a plan's shard streams share the worker's codec), as long as each thread's
    rounds use their own keys. Work buffers are per call or per thread, caches are locked, and
    state (error feedback, momentum) is keyed by the context's ``state_key``; concurrent rounds
    give the payloads of sequential ones (``tests/codecs/test_threads.py``).
    """

    name: str = ""
    aggregation: Aggregation = Aggregation.DECODE_SUM_ENCODE
    lane_fields: tuple[str, str] | None = None
    linear_decode: bool = False
    blockwise: int | None = None
    costly_preparation: bool = False
    stages: int = 1
    # Whether the codec carries its own error feedback (an option of its constructor) instead
    # of the generic wrapper's, which assumes one encode per round.
    keeps_own_feedback: bool = False
    # Why error feedback must not wrap this codec (None: it may).
    feedback_refusal: str | None = None
    # Error feedback's bound on the memory added, as a factor of the gradient's norm
    # (``feedback.ErrorFeedback``); None: unbounded.
    feedback_bound: float | None = None
    # Whether ``precondition`` applies the optimizer's momentum itself (DGC's momentum
    # correction): the optimizer must then apply none, or the momentum would count twice.
    carries_momentum: bool = False

    def __init__(self, workers: int = 1):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers

    @property
    def homomorphic(self) -> bool:
        return self.aggregation.homomorphic

    @property
    def needs_summary(self) -> bool:
        return type(self).summarize is not Codec.summarize

    def precondition(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor:
        """Stateful pre-processing before the preliminary round (error feedback, momentum)."""
        return x

    def summarize(self, x: torch.Tensor, ctx: CodecContext) -> torch.Tensor | None:
        """This worker's input to the preliminary round (combined by elementwise max)."""
        return None

    def summary_bits(self) -> int:
        """Wire bits of one summary entry (float32 unless a codec sends less)."""
        return 32

    # -- layouts and stages (codecs that work per tensor, in several sums) ---------------------
    def describe(self, key: Hashable, shapes: Sequence[tuple[int, ...]]) -> None:
        """The shapes of the tensors whose flattened gradients, end to end, make up the flat
        buffers of ``key``. Codecs that work per tensor (PowerSGD's matrices) use them; the
        others see coordinates only and ignore them."""
        return None

    def partitions(self, key: Hashable, total: int, size: int) -> list[tuple[int, int]] | None:
        """[start, end) partitions of a flat buffer of ``key`` (``total`` coordinates), where a
        codec cuts them itself; None: the round's partitions of ``size`` coordinates."""
        return None

    def stage_input(self, x: torch.Tensor, ctx: CodecContext, stage: int,
                    previous: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """What a codec of several stages sums at ``stage`` for the prepared partition ``x``:
        stage 0's from x alone (``previous`` None; never None itself), a later stage's from
        ``previous``, the average of the one before; None: the partition is done."""
        raise NotImplementedError(f"codec {self.name!r} runs in one stage")

    def finish(self, x: torch.Tensor, ctx: CodecContext,
               averages: Sequence[torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The average of prepared partition ``x`` from the averages of the stages it took
        part in (a codec of several stages; its error feedback is kept here)."""
        raise NotImplementedError(f"codec {self.name!r} runs in one stage")

    @abstractmethod
    def encode(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> Payload:
        """Compress a 1-D float tensor into a wire payload."""

    def encode_into(self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> Payload:  # fmt: skip
        """``encode`` of a homomorphic codec, its lane field's bytes written into ``out``
        (uint8, exactly their size): a transport's send buffer. Codecs that can write there in
        one pass override it; the lane field of the payload returned may then be a view of
        ``out``, valid until the caller reuses it."""
        payload = self.encode(x, ctx, shared)
        self.copy_lanes(payload, out)
        return payload

    def copy_lanes(self, payload: Payload, out: torch.Tensor) -> None:
        """``payload``'s lane field's bytes into ``out`` (uint8, exactly their size)."""
        field = payload.fields[self.lane_fields[0]].contiguous().reshape(-1).view(torch.uint8)
        if field.numel() != out.numel():
            raise ValueError(f"{self.name}: {field.numel()} payload bytes for {out.numel()}")
        out.copy_(field)

    def joins(self, flats: Sequence[torch.Tensor], partition_elements: int) -> bool:
        """Whether a step's gradients ``flats`` go as one round of their concatenation, each
        padded to a whole number of blocks, with each gradient's own round's bits
        (``CodecRound.run_many``): a stateless blockwise codec where that saves more than the
        concatenation's copy costs (a device's launches). The same answer on every worker."""
        return False

    def lane_coder(self, x: torch.Tensor, shared: torch.Tensor | None,
                   out: torch.Tensor) -> LaneCoder | None:  # fmt: skip
        """A coder of any run of a round's lanes, for a transport that encodes each packet as
        it sends it and decodes each result where it lands (``LaneCoder``), or None. Offered
        only where lanes are coordinates: ``x`` is the round's input and ``out`` its output,
        both flat and contiguous, ``shared`` the preliminary round's result for all of ``x``
        (blocks from its coordinate 0). The packets' bits must be those of ``encode`` and
        ``decode`` of any whole piece; a codec that cannot promise that returns None."""
        return None

    @abstractmethod
    def aggregate(self, payloads: Sequence[Payload], ctx: CodecContext) -> Payload:
        """What the aggregator does with the payloads of the contributing workers."""

    @abstractmethod
    def decode(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The average over the payload's contributors, as a float32 tensor."""

    def decode_into(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                    out: torch.Tensor) -> None:  # fmt: skip
        """``decode`` written into ``out`` (float32, the payload's length), which codecs that
        can do it in one pass override: a round decodes every piece into its place."""
        out.copy_(self.decode(payload, ctx, shared))

    def decode_counted(self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None,
                       out: torch.Tensor) -> None:  # fmt: skip
        """``decode_into`` of a sum whose lanes have contributor counts of their own
        (``payload.counts``; a ``linear_decode`` codec only). This default holds where lanes are
        the coordinates and the decode is the sum times a factor: it decodes the sums as one
        contributor's and divides coordinate by coordinate. A codec whose lanes are not its
        coordinates (THC's rotation) divides them itself before they mix."""
        sums = self.decode(replace(payload, contributors=1, counts=None), ctx, shared)
        counts = payload.counts.reshape(-1)[: payload.length]
        torch.div(sums, counts.to(sums.device, torch.float32), out=out)

    def reconstruct(
        self, payload: Payload, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> torch.Tensor:
        """What this worker's own payload decodes to (error feedback's reference)."""
        return self.decode(self.aggregate([payload], aggregator_context(ctx)), ctx, shared)

    def encode_and_reconstruct(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> tuple[Payload, torch.Tensor]:
        """``encode`` and ``reconstruct`` of its payload, the same values; a codec may compute
        the reconstruction from what its encode already holds. The reconstruction may live in
        the codec's scratch: it is read before this thread's next encode."""
        payload = self.encode(x, ctx, shared)
        return payload, self.reconstruct(payload, ctx, shared)

    def encode_and_residual(
        self, x: torch.Tensor, ctx: CodecContext, shared: torch.Tensor | None = None
    ) -> tuple[Payload, torch.Tensor]:
        """``encode`` and x minus what its payload alone reconstructs to (float32, flat): error
        feedback's memory; a codec may compute it where its reconstruction is made."""
        payload, own = self.encode_and_reconstruct(x, ctx, shared)
        return payload, x.reshape(-1).to(torch.float32) - own

    def integer_op(self) -> IntegerOp:
        raise TypeError(f"codec {self.name!r} is not integer-homomorphic; a switch cannot sum it")

    def lanes(self, length: int) -> int:
        """How many lanes carry ``length`` coordinates (THC sends its padded rotation)."""
        return length

    def lane_widths(self) -> tuple[int, int]:
        """Bits of one lane upstream and of one summed lane downstream."""
        op = self.integer_op()
        return op.in_bits, op.out_bits

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"codec {self.name!r} keeps no state, got keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(workers={self.workers})"


def check_finite(x: torch.Tensor, what: str = "gradient") -> None:
    """Raise a clear error for NaN/Inf (one reduction; cheap next to any encode)."""
    if not bool(torch.isfinite(x.sum())) and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[:3].flatten().tolist()
        raise NonFiniteGradientError(
            f"{what} of {x.numel()} coordinates contains NaN or Inf (first at indices {bad}); "
            "refusing to compress it"
        )


class DeviceChecks:
    """Checks whose outcome stays on the tensors' device until someone reads it once.

    Reading a device value on the host waits for the device (a host sync), so a round that
    checks its inputs as it goes cannot run ahead of the GPU. Inside ``deferring()``, the
    ``require`` checks of the code a round runs AND their conditions into one 0-d flag instead;
    ``raise_if_failed`` reads it once and, only when it is false, finds the check that failed
    (each check's ``fail`` raises its own clear error, or returns when the flag was a false
    alarm, such as a finite sum that overflowed) and raises that error.
    """

    _active: contextvars.ContextVar[DeviceChecks | None] = contextvars.ContextVar(
        "gradsum_device_checks", default=None
    )

    def __init__(self) -> None:
        self._flag: torch.Tensor | None = None
        self._checks: list[tuple[torch.Tensor, Callable[[], None]]] = []
        self._lock = threading.Lock()  # a step's rounds may run on several shard threads

    @classmethod
    def current(cls) -> DeviceChecks | None:
        """The checks of the innermost ``deferring()`` of this thread, if any."""
        return cls._active.get()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[DeviceChecks]:
        token = self._active.set(self)
        try:
            yield self
        finally:
            self._active.reset(token)

    def add(self, ok: torch.Tensor, fail: Callable[[], None]) -> None:
        ok = ok.reshape(())
        with self._lock:
            self._flag = ok if self._flag is None else torch.logical_and(self._flag, ok)
            self._checks.append((ok, fail))

    def raise_if_failed(self) -> None:
        """One read of the flag (the only host sync); the failed check's error if it is false."""
        with self._lock:
            flag, checks = self._flag, self._checks
            self._flag, self._checks = None, []
        if flag is None or bool(flag):
            return
        for ok, fail in checks:  # the error path: reading each condition costs nothing here
            if not bool(ok):
                fail()


def require(ok: torch.Tensor, fail: Callable[[], None]) -> None:
    """``fail()`` (which raises) unless the 0-d bool ``ok`` holds: now, or deferred into the
    current ``DeviceChecks`` (no host sync) when a round defers its checks."""
    checks = DeviceChecks.current()
    if checks is None:
        if not bool(ok):
            fail()
    else:
        checks.add(ok, fail)


def finite(x: torch.Tensor) -> torch.Tensor:
    """``torch.isfinite`` of a floating tensor in 2 kernels instead of its 4 (abs, ne, eq, mul):
    x - x is exactly 0 for every finite x and NaN for NaN and ±inf. On a GPU a round's scalar
    checks are bound by their launches, not their arithmetic (tests/codecs/test_launches.py)."""
    return (x - x).eq(0)


def norms_of(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Every tensor's L2 norm (0-d; accumulated in ``dtype``) from one multi-tensor reduction:
    one launch or two for all on a GPU, where a step's rounds take their partitions' norms
    together (``thc.step``). A tensor's norm does not depend on the others in the list, so a
    round of one partition takes its norm here too and gets the same value; on the CPU it is
    ``torch.linalg.vector_norm``'s."""
    return list(torch._foreach_norm(list(tensors), 2, dtype=dtype))


def require_finite(x: torch.Tensor, what: str = "gradient") -> None:
    """``check_finite`` that a deferring round keeps on the device (see ``DeviceChecks``)."""
    if DeviceChecks.current() is None:
        check_finite(x, what)
    else:
        require(finite(x.sum()), lambda: check_finite(x, what))


def check_same_length(payloads: Sequence[Payload]) -> int:
    if not payloads:
        raise ValueError("aggregate needs at least one payload")
    lengths = {p.length for p in payloads}
    if len(lengths) != 1:
        raise ValueError(f"payloads cover different lengths {sorted(lengths)}")
    return lengths.pop()


def float_to_ordered_int(values: torch.Tensor) -> torch.Tensor:
    """Map float32 to int32 so that integer order equals float order (for a switch's MAX)."""
    bits = values.to(torch.float32).contiguous().view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def ordered_int_to_float(ordered: torch.Tensor) -> torch.Tensor:
    bits = ordered.to(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).view(torch.float32)


def combine_summaries(summaries: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The aggregator's side of the preliminary round: an elementwise max."""
    present = [s for s in summaries if s is not None]
    if not present:
        return None
    return torch.stack(present).amax(dim=0)
