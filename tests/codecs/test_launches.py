"""How many kernels a THC round launches on a GPU, counted on the CPU.

On an H200 a round of one 2**20 partition is bound by its launches, not its kernels: 105
launches at ~20 µs of host time each against 0.21 ms of kernels (docs/benchmarks.md, "The GPU
path"). So the launch count is the GPU path's cost, and it can be counted without a GPU: the
round runs the GPU's control flow on the CPU (GRADSUM_NATIVE=0 keeps scalars as 0-d tensors and
checks deferred, as on a device; the fused Triton kernels are replaced by counters), and a
dispatch mode counts every aten op that would launch a kernel (views launch none). A change that
adds launches to the hot path fails here before it reaches a GPU.
"""

import collections
import contextlib
import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsum.codecs import make_codec
from gradsum.codecs.round import PARTITION_ELEMENTS, PhaseClock, run_round, run_step_round
from gradsum.codecs.thc import triton_kernels

from ..host_syncs import count_host_syncs
from .conftest import OneWorker

# ops that only make metadata or allocate: no kernel on a GPU
NO_KERNEL = {
    "view", "reshape", "_reshape_alias", "_unsafe_view", "slice", "select", "as_strided",
    "expand", "t", "transpose", "permute", "unsqueeze", "squeeze", "alias", "detach", "split",
    "unbind", "narrow", "view_as", "lift_fresh", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "resize_", "set_",
    "_local_scalar_dense",  # a read to the host (a copy): the round's one, its checks' flag
}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts kernel-launching aten ops and fused-kernel launches by the round's phase."""

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.phase = "outside"
        self.active = False  # the fused kernels count only inside ``with counter:``
        self.muted = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.muted and func.overloadpacket.__name__ not in NO_KERNEL:
            self.launches[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def kernel(self, outputs: int | dict[int, float]):
        """A fused kernel that counts its launches and zeroes its output (positional argument
        ``outputs``; or fills each of several with its value), so the values a round carries
        on, its error feedback's, stay finite and its checks pass."""
        counter = self
        if isinstance(outputs, int):
            outputs = {outputs: 0}

        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter.muted = True  # the filling stands in for the kernel: not counted
                    for index, value in outputs.items():
                        args[index].fill_(value)
                    counter.muted = False
                    if counter.active:
                        counter.launches[counter.phase] += 1

                return launch

        return Launch()

    def clock(self) -> PhaseClock:
        counter = self

        class Phases(PhaseClock):
            @contextlib.contextmanager
            def phase(self, name):
                outer, counter.phase = counter.phase, name
                try:
                    yield
                finally:
                    counter.phase = outer

        return Phases()


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's control flow on the CPU, with counted (not run) fused kernels."""
    counter = LaunchCounter()
    kernels = type("Kernels", (), {})()
    outputs = {
        "_tile_kernel": 1, "_cross_kernel": 0, "_quantize_kernel": 5,  # dst, buf, packed
        # a step's rows (thc.step): dst and xp; dst and out; buf and out; packed and error;
        # the scalars and their rows' flag of valid norms (true)
        "_rows_rotate_kernel": {3: 0, 4: 0}, "_rows_dequantize_kernel": {1: 0, 9: 0},
        "_rows_cross_kernel": {0: 0, 7: 0}, "_rows_quantize_kernel": {5: 0, 12: 0},
        "_rows_scalars_kernel": {3: 0, 4: 0, 5: 0, 6: 0, 7: 0, 8: 1},
        "_rows_tensor_scales_kernel": {3: 0, 4: 1, 5: 1, 6: 1},  # largest, factors, divisors, ok
    }  # fmt: skip
    for name, output in outputs.items():
        setattr(kernels, name, counter.kernel(output))
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(triton_kernels, "_kernels", lambda: kernels)
    monkeypatch.setattr(triton_kernels, "use_for", lambda device: True)
    return counter


def aggregated_natively(codec) -> None:
    """The codec's sums computed as a server computes them, by its C kernels where built
    (``thc.native.lookup_sum``; the same packed sums as the torch path's): the aggregate phase
    is no launch of a worker's and is not counted, and the torch path's packing of 2**20
    lanes, op by op through the dispatch mode, took most of a 64-partition step's time."""
    aggregate = codec.aggregate

    def native(payloads, ctx):
        pinned = os.environ.get("GRADSUM_NATIVE")
        os.environ["GRADSUM_NATIVE"] = "1"
        try:
            return aggregate(payloads, ctx)
        finally:
            if pinned is None:
                del os.environ["GRADSUM_NATIVE"]
            else:
                os.environ["GRADSUM_NATIVE"] = pinned

    codec.aggregate = native


def count_round(counter: LaunchCounter, codec, length: int) -> dict[str, int]:
    x = torch.randn(length, generator=torch.Generator().manual_seed(0))
    aggregated_natively(codec)
    run_round(codec, [x], step=0)  # tables, rotations
    with counter:
        run_round(codec, [x], step=1, clock=counter.clock())
    return dict(counter.launches)


# The counts per 2**20 partition. Without error feedback: encode 27 (the norm and its checks, the
# grid's scalars, 3 fused kernels drawing their thresholds themselves: 31 with a launch for the
# draws and a float32 norm retaken in float64 where it overflowed), decode 13 (the step, 2 fused
# kernels: the sums are unpacked as the first one loads them; the round's scalars are computed
# once, where first used, and not again in the decode: 19 when it recomputed them). Error
# feedback, as training runs THC, adds the memory's bound and its update: encode 53 (with the
# fused rotation of x + e and the worker's own values looked up, not summed, packed and
# unpacked; 153, then 58 before), decode 10 (its step computed in the encode). Per round, 2 (the
# partitions' checks combined). A bound met with room would hide a regression, so these are the
# counts themselves.
PER_PARTITION = {False: {"encode": 27, "decode": 13}, True: {"encode": 53, "decode": 10}}
PER_ROUND = {"encode": 2, "decode": 0}


@pytest.mark.parametrize("feedback", [False, True], ids=["no-feedback", "feedback"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_a_thc_round_launches_a_fixed_number_of_kernels_per_partition(
    gpu_path, partitions, feedback
):
    codec = make_codec("thc", workers=4, error_feedback=feedback)
    launches = count_round(gpu_path, codec, partitions * PARTITION_ELEMENTS)
    for phase, count in PER_PARTITION[feedback].items():
        assert launches[phase] <= count * partitions + PER_ROUND[phase], (phase, launches)
    assert "outside" not in launches, launches  # every launch of a round is in a phase


def test_the_decode_reads_packed_sums_without_unpacking_them(gpu_path, monkeypatch):
    from gradsum.codecs.thc import codec as thc_codec

    def refuse(*args, **kwargs):
        raise AssertionError("the fused decode unpacked the sums on the torch path")

    monkeypatch.setattr(thc_codec, "unpack_bits", refuse)
    codec = make_codec("thc", workers=4, error_feedback=False)
    assert codec.sum_bits == 7  # packed: 8 lanes in 7 bytes
    count_round(gpu_path, codec, PARTITION_ELEMENTS)


# THC's default, tensor scales, on a buffer of several tensors (two in every partition here):
# the pieces' norms and scales add to the encode; the scales are computed once per partition and
# round, from the MAX round's result, for the encode, error feedback's reconstruction and the
# decode alike (40 decode launches when each recomputed them), and error feedback decodes its
# own table values as an unpacked sum (128 encode launches when it packed and unpacked them and
# recomputed the scales).
PER_PARTITION_TENSOR_SCALES = {False: {"encode": 55, "decode": 16},
                               True: {"encode": 82, "decode": 10}}  # fmt: skip


@pytest.mark.parametrize("feedback", [False, True], ids=["no-feedback", "feedback"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_a_thc_round_of_tensor_scales_launches_a_fixed_number_per_partition(
    gpu_path, partitions, feedback
):
    codec = make_codec("thc", workers=4, error_feedback=feedback)
    codec.describe(None, [(PARTITION_ELEMENTS - 1000,), (1000,)] * partitions)
    launches = count_round(gpu_path, codec, partitions * PARTITION_ELEMENTS)
    for phase, count in PER_PARTITION_TENSOR_SCALES[feedback].items():
        assert launches[phase] <= count * partitions + PER_ROUND[phase], (phase, launches)


# A step's rounds as one batch (thc.step): every partition of every gradient of the step is a row
# of one launch per operation, so the count is the step's, whatever its partitions. With error
# feedback, one scale per partition: encode 10 (the inputs' and memories' norms for the bound, 2;
# the rotation with the memory added, 2; the summaries' norms, 3; the grid scalars, 1, and their
# check, 1; the quantization with the new rotated memory, 1), decode 3 (the sums in one buffer,
# 2 kernels); without, the bound's 2 fewer. With tensor scales (two tensors in a partition) the
# pieces' norms (3) and the summary's placement (1) replace the norms, the scales take a kernel
# (1), the rows are rotated after the MAX round divided by them (2; before it, with feedback, 1
# kernel stores x + e) and their memory stays in the gradient's domain: its residual's decode
# (2). One partition saves the sums' concatenation. Before this, every partition cost its own
# round, 68 launches each with feedback (58 + 10; 93 with tensor scales): 4,415 for 64 (6,015).
STEP_LAUNCHES = {
    ("partition", False): {"encode": 8, "decode": 3},
    ("partition", True): {"encode": 10, "decode": 3},
    ("tensor", False): {"encode": 10, "decode": 3},
    ("tensor", True): {"encode": 15, "decode": 3},
}
STEP_BOUND = 24  # issue 37: a step's THC encode + decode with error feedback


def count_step(counter: LaunchCounter, codec, sizes: list[int]) -> dict[str, int]:
    generator = torch.Generator().manual_seed(0)
    flats = [torch.randn(n, generator=generator) for n in sizes]
    aggregated_natively(codec)
    run_step_round(codec, [flats], step=0)  # tables, rotations, the layout, the memory
    with counter:
        run_step_round(codec, [flats], step=1, clock=counter.clock())
    return dict(counter.launches)


@pytest.mark.parametrize("feedback", [False, True], ids=["no-feedback", "feedback"])
@pytest.mark.parametrize("scales", ["partition", "tensor"])
@pytest.mark.parametrize("partitions", [1, 4, 16, 64])
def test_a_steps_thc_rounds_launch_a_fixed_number_whatever_their_partitions(
    gpu_path, partitions, scales, feedback
):
    """The bug it fears: a batched step that still launches per partition somewhere (a loop
    over rows of small ops, a draw per row), which 64 partitions show as 64x."""
    codec = make_codec("thc", workers=4, error_feedback=feedback)
    if scales == "tensor":  # two tensors in every partition
        codec.describe(0, [(PARTITION_ELEMENTS - 1000,), (1000,)] * partitions)
    launches = count_step(gpu_path, codec, [partitions * PARTITION_ELEMENTS])
    want = dict(STEP_LAUNCHES[(scales, feedback)])
    if partitions == 1:
        want["decode"] -= 1  # one row's sums: nothing to concatenate
    assert {phase: launches[phase] for phase in want} == want, launches
    assert launches["encode"] + launches["decode"] <= STEP_BOUND
    assert "outside" not in launches, launches


def gpt_groups(layers: int = 6, width: int = 192, vocab: int = 50257,
               context: int = 1024) -> list[list[tuple[int, ...]]]:  # fmt: skip
    """The tensors of a small GPT's 27 WFBP groups (6 layers of width 192, as the docs' runs
    train): the token embedding (9.6M coordinates, 10 partitions), the positions, 4 groups per
    layer, the final LayerNorm; all but the first under one partition, none a power of two."""
    groups = [[(vocab, width)], [(context, width)]]
    for _ in range(layers):
        groups += [
            [(width, 3 * width), (3 * width,)],  # attention's qkv
            [(width, width), (width,), (width,), (width,)],  # its projection, LayerNorm
            [(width, 4 * width), (4 * width,)],  # the MLP's first layer
            [(4 * width, width), (width,), (width,), (width,)],  # its second, LayerNorm
        ]
    return [*groups, [(width,), (width,)]]


# The GPT's step: its 27 gradients are concatenated (1) and its padded rows keep their memory in
# the gradient's domain (the residual's decode, 2). Tensor scales add the pieces' norms (3), their
# placement (1) and the scales' kernel (1); with feedback the rotation is split in two (2): the
# embedding's rows of one tensor keep rotated memory and are rotated before the MAX round, the
# others after it, divided by their tensors' scales. Before, its 36 partitions took a round each:
# 2,319 launches with feedback (3,069 with tensor scales).
GPT_STEP_LAUNCHES = {
    ("partition", False): {"encode": 9, "decode": 3},
    ("partition", True): {"encode": 13, "decode": 3},
    ("tensor", False): {"encode": 14, "decode": 3},
    ("tensor", True): {"encode": 20, "decode": 3},
}


@pytest.mark.parametrize("feedback", [False, True], ids=["no-feedback", "feedback"])
@pytest.mark.parametrize("scales", ["partition", "tensor"])
def test_a_gpt_steps_27_groups_launch_as_one_round(gpu_path, scales, feedback):
    """The bug it fears: gradients of different sizes (padded rows of their own blocks, rows
    of one scale beside rows of several) split into launches of their own."""
    groups = gpt_groups()
    assert len(groups) == 27
    codec = make_codec("thc", workers=4, error_feedback=feedback)
    if scales == "tensor":
        for key, shapes in enumerate(groups):
            codec.describe(key, shapes)
    sizes = [sum(math.prod(shape) for shape in shapes) for shapes in groups]
    assert min(sizes) < PARTITION_ELEMENTS < max(sizes)
    launches = count_step(gpu_path, codec, sizes)
    want = GPT_STEP_LAUNCHES[(scales, feedback)]
    assert {phase: launches[phase] for phase in want} == want, launches
    assert launches["encode"] + launches["decode"] <= STEP_BOUND


@pytest.mark.parametrize("scales", ["partition", "tensor"])
def test_a_batched_step_makes_no_host_sync_but_its_checks_one(gpu_path, scales):
    """The bug it fears: the batch reading a device value on the host (a row's seed copied from
    pageable memory, a segment reduction checking its lengths, a row's scalar), which on a GPU
    waits for every launch before it and undoes what their fewness buys."""
    codec = make_codec("thc", workers=4, error_feedback=True)
    if scales == "tensor":
        codec.describe(0, [(PARTITION_ELEMENTS - 1000,), (1000,)] * 3)
    flats = [torch.randn(3 * PARTITION_ELEMENTS, generator=torch.Generator().manual_seed(1))]
    run_step_round(codec, [flats], step=0)
    with count_host_syncs() as syncs:
        run_step_round(codec, [flats], step=1)
    assert len(syncs.calls) == 1 and "raise_if_failed" in syncs.calls[0], syncs.calls


def test_a_bfp_rounds_launches_do_not_grow_with_its_partitions(gpu_path):
    """bfp merges the round's partitions (``BlockFloatingPoint.partitions``): a round of 16
    partitions launches what a round of one does (each took ~24 launches a worker before)."""
    counts = []
    for partitions in (1, 16):
        codec = make_codec("bfp", workers=4)
        x = torch.randn(partitions * PARTITION_ELEMENTS, generator=torch.Generator().manual_seed(0))
        counter = LaunchCounter()
        with counter:
            run_round(codec, [x], step=0, clock=counter.clock())
        counts.append(dict(counter.launches))
    assert counts[0] == counts[1] and sum(counts[0].values()) > 0


def test_a_bfp_steps_groups_launch_as_one_round(gpu_path):
    """On a device bfp joins a step's gradients into one round (``Codec.joins``): 27 groups
    launch what one does, plus the two that join them."""
    from gradsum.codecs.round import CodecRound

    counts = []
    for groups in (1, 27):
        codec = make_codec("bfp", workers=4)
        flats = [torch.randn(1000 + 37 * g) for g in range(groups)]
        counter = LaunchCounter()
        with counter:
            CodecRound(codec).run_many(flats, OneWorker(), worker=0, keys=range(groups), step=0)
        counts.append(sum(counter.launches.values()))
    assert counts[1] <= counts[0] + 2, counts
