"""A worker's batched step (``thc.step``) recorded once and replayed every step.

Batched, a step of THC is ~16 launches, whatever its partitions; a CUDA graph replays them in
one. A step has three halves between which the network runs (the MAX round's and the SUM's
transfers), so it is three recordings: ``prepare`` (the summaries), ``encode`` (the payloads,
from the MAX round's result) and ``decode`` (the averages, from the sums). A recording reads
its inputs from fixed addresses, so ``StepGraph`` keeps them there (``step.StaticBuffers``):
the gradients are copied into one flat input, the MAX round's result and the sums into their
buffers, the seeds written on the host into pinned memory that the recorded encode copies, and
error feedback's memory is updated in place. The values are the eager step's, bit for bit.

``record`` captures a half as a ``torch.cuda.CUDAGraph`` on a GPU; where capture is refused
(another stream's work, an allocator that cannot, no CUDA) the half runs eagerly every step, on
the same buffers: the same control flow, which is also what the CPU's tests run, a recording
being then its callable run again.

A step's first call runs eagerly (it builds the tables, the layout and the memory); the
recordings are made at the second, after one eager run of each half (the kernels compiled
before capture, which must not compile), and replayed at once for that step's values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from ..base import DeviceChecks, Payload
from ..round import PARTITION_ELEMENTS
from .codec import DOWNSTREAM
from .step import StaticBuffers, StepRound


class Recorded:
    """``fn`` recorded as a CUDA graph where the device allows (``graph`` then set), else run
    again at every call. Its checks (``DeviceChecks``) are recorded with it and added, with
    their flag as the last replay left it, to the caller's at every call."""

    def __init__(self, fn: Callable[[], object], device: torch.device, capture: bool = True):
        self.fn, self.graph = fn, None
        self._checks: DeviceChecks | None = None
        self.result = None
        if capture and device.type == "cuda":
            self._capture(device)

    def _capture(self, device: torch.device) -> None:
        checks = DeviceChecks()
        graph = torch.cuda.CUDAGraph()
        try:
            with checks.deferring(), torch.cuda.graph(graph):
                result = self.fn()
        except RuntimeError:  # capture refused: eager on every call
            return
        self.graph, self.result, self._checks = graph, result, checks

    def __call__(self):
        if self.graph is None:
            self.result = self.fn()
            return self.result
        self.graph.replay()
        checks, recorded = DeviceChecks.current(), self._checks
        if recorded._flag is not None:
            fails = [fail for _, fail in recorded._checks]

            def fail() -> None:
                for each in fails:
                    each()

            if checks is None:
                if not bool(recorded._flag):
                    fail()
            else:
                checks.add(recorded._flag, fail)
        return self.result


class StepGraph:
    """One worker's batched step, recorded (see the module docstring): ``prepare(flats,
    step)``, ``encode(shared)``, ``decode(sums)`` as ``StepRound``'s, for a step of the same
    gradients every time. ``capture``: False runs the recordings' control flow eagerly (the
    CPU's tests)."""

    def __init__(self, codec, flats: Sequence[torch.Tensor], *, worker: int,
                 keys: Sequence[Hashable], seed: int = 0,
                 partition_elements: int = PARTITION_ELEMENTS, capture: bool = True):  # fmt: skip
        self.codec, self.worker, self.keys, self.seed = codec, worker, list(keys), seed
        self.partition_elements, self.capture = partition_elements, capture
        self.device = flats[0].device
        self.round: StepRound | None = None  # the recorded one, from the second step on
        self.eager: StepRound | None = None
        self._recorded: dict[str, Recorded] = {}
        self._shared: torch.Tensor | None = None
        self._sums: torch.Tensor | None = None
        self._contributors: int | None = None
        # the recorded encode's copy of the seeds from pinned memory, which the host may not
        # overwrite before the device has read them (the device runs behind)
        self._seeds_read: torch.cuda.Event | None = None

    def batches(self, flats: Sequence[torch.Tensor], step: int) -> bool:
        return StepRound.build(self.codec, flats, worker=self.worker, keys=self.keys, step=step,
                               seed=self.seed,
                               partition_elements=self.partition_elements) is not None  # fmt: skip

    def prepare(self, flats: Sequence[torch.Tensor], step: int) -> torch.Tensor:
        flats = [f.reshape(-1) for f in flats]
        if self.round is None and self.eager is None:  # the first step: eager
            self.eager = StepRound.build(self.codec, flats, worker=self.worker, keys=self.keys,
                                         step=step, seed=self.seed,
                                         partition_elements=self.partition_elements)  # fmt: skip
            if self.eager is None:
                raise ValueError("this codec's step does not batch (thc.step.StepRound.build)")
            return self.eager.prepare()
        if self.round is None:
            self.round = self._static_round(flats, step)
        static = self.round.static
        torch.cat([f.to(torch.float32) for f in flats], out=static.src)
        seeds = [ctx.worker_seed() for ctx in self.round.contexts_of(step)]
        if self._seeds_read is not None:  # long done: the last step's payloads were sent
            self._seeds_read.synchronize()
        static.host_seeds.copy_(torch.tensor(seeds, dtype=torch.int64))
        return self._run("prepare", self.round.prepare)

    def _static_round(self, flats: Sequence[torch.Tensor], step: int) -> StepRound:
        """The recorded step's round: the eager one's layout, its memory as the static one."""
        eager, self.eager = self.eager, None
        layout, device = eager.layout, self.device
        memory = None
        if eager.feedback:
            memory, _ = eager._memory()  # the last step's [P, N] buffer, every row's view
            if memory is None:
                raise RuntimeError("the eager step left no error-feedback memory")
        host = torch.empty(layout.rows, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        static = StaticBuffers(
            src=torch.empty(layout.total, dtype=torch.float32, device=device),
            host_seeds=host,
            seeds=torch.empty(layout.rows, dtype=torch.int64, device=device),
            memory=memory,
        )
        return StepRound(self.codec, eager.inner, layout, flats, self.worker, self.seed, step,
                         static)  # fmt: skip

    def encode(self, shared: torch.Tensor) -> list[Payload]:
        if self.round is None:
            return self.eager.encode(shared)
        shared = shared.reshape(-1)
        if self._shared is None:
            self._shared = torch.empty_like(shared)
        self._shared.copy_(shared)
        payloads = self._run("encode", lambda: self.round.encode(self._shared))
        if self.device.type == "cuda":
            self._seeds_read = torch.cuda.Event()
            self._seeds_read.record()
        return payloads

    def decode(self, sums: Sequence[Payload]) -> list[torch.Tensor]:
        batched = self.eager if self.round is None else self.round
        if not batched.decodes(sums):
            raise ValueError("these sums do not decode together (StepRound.decodes)")
        if self.round is None:
            return self.eager.decode(sums)
        fields = [s.fields[DOWNSTREAM].reshape(-1) for s in sums]
        if self._sums is None:
            self._sums = torch.empty(sum(f.numel() for f in fields), dtype=torch.uint8,
                                     device=self.device)  # fmt: skip
        torch.cat(fields, out=self._sums)
        contributors = sums[0].contributors
        if self._contributors not in (None, contributors):
            self._recorded.pop("decode", None)  # recorded for another count: record again
        self._contributors = contributors
        return self._run("decode", lambda: self.round.decode_packed(self._sums, contributors))

    def _run(self, name: str, fn: Callable[[], object]):
        recorded = self._recorded.get(name)
        if recorded is None:
            fn()  # eager once: every kernel compiled before the capture, which must not compile
            recorded = self._recorded[name] = Recorded(fn, self.device, self.capture)
        # a capture runs nothing and rebinds the round's buffers (``StepRound.w``...) to the
        # recording's: its first replay computes them. Every half may run twice on one step:
        # none reads what it writes (the encode writes the memory that only the prepare reads)
        return recorded()


def run_recorded_step(graphs: Sequence[StepGraph], inputs: Sequence[Sequence[torch.Tensor]],
                      step: int) -> list[torch.Tensor]:  # fmt: skip
    """Every worker's recorded step in one process, the MAX round's and the SUM's values
    computed between its halves as ``round.run_step_round`` computes them (``inputs``: one
    list of gradients per worker, ``graphs`` one per worker): worker 0's averages, views of its
    static buffers (the next step overwrites them)."""
    from ..base import aggregator_context

    summaries = [graph.prepare(inputs[w], step) for w, graph in enumerate(graphs)]
    shared = torch.stack(summaries).amax(dim=0)
    payloads = [graph.encode(shared) for graph in graphs]
    first = graphs[0]
    contexts = (first.round or first.eager).contexts_of(step)
    sums = [first.codec.aggregate([p[i] for p in payloads], aggregator_context(ctx))
            for i, ctx in enumerate(contexts)]  # fmt: skip
    return first.decode(sums)
