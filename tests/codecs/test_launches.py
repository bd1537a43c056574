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

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsum.codecs import make_codec
from gradsum.codecs.round import PARTITION_ELEMENTS, PhaseClock, run_round
from gradsum.codecs.thc import triton_kernels

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

    def kernel(self, output: int):
        """A fused kernel that counts its launches and zeroes its output (positional argument
        ``output``), so the values a round carries on, its error feedback's, stay finite."""
        counter = self

        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    counter.muted = True  # the zeroing stands in for the kernel: not counted
                    args[output].zero_()
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
    outputs = {"_tile_kernel": 1, "_cross_kernel": 0, "_quantize_kernel": 5}  # dst, buf, packed
    for name, output in outputs.items():
        setattr(kernels, name, counter.kernel(output))
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(triton_kernels, "_kernels", lambda: kernels)
    monkeypatch.setattr(triton_kernels, "use_for", lambda device: True)
    return counter


def count_round(counter: LaunchCounter, codec, length: int) -> dict[str, int]:
    x = torch.randn(length, generator=torch.Generator().manual_seed(0))
    run_round(codec, [x], step=0)  # tables, rotations
    with counter:
        run_round(codec, [x], step=1, clock=counter.clock())
    return dict(counter.launches)


# The counts per 2**20 partition. Without error feedback: encode 31 (the norm and its checks, the
# grid's scalars, the draws, 3 fused kernels), decode 13 (the step, 2 fused kernels: the sums are
# unpacked as the first one loads them; the round's scalars are computed once, where first used,
# and not again in the decode: 19 when it recomputed them). Error feedback, as training runs THC,
# adds the memory's bound and its update: encode 58 (with the fused rotation of x + e and the
# worker's own values looked up, not summed, packed and unpacked; 153 before), decode 10 (its
# step computed in the encode). Per round, 2 (the partitions' checks combined). A bound met with
# room would hide a regression, so these are the counts themselves.
PER_PARTITION = {False: {"encode": 31, "decode": 13}, True: {"encode": 58, "decode": 10}}
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
                               True: {"encode": 83, "decode": 10}}  # fmt: skip


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
