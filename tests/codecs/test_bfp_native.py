"""bfp's native CPU kernels against the torch code they replace: bit for bit.

Every test forces the native path on (GRADSUM_NATIVE=1), even when the suite runs with it off,
and switches to torch explicitly where it compares the two.
"""

import math

import pytest
import torch

from gradsum.codecs import bfp_native, buffers, make_codec
from gradsum.codecs.base import CodecContext, NonFiniteGradientError, Payload, combine_summaries
from gradsum.codecs.bfp import INT32_MAX, BlockFloatingPoint, saturation_limit

from .conftest import OneWorker

pytestmark = [
    pytest.mark.skipif(
        not bfp_native.built(),
        reason="the C extension gradsum.codecs._bfp_kernels is not built (no C compiler at "
        "install time); the torch path it replaces is covered by the other codec tests",
    ),
    pytest.mark.pins_native,  # every test sets its own path (below)
]

CTX = CodecContext()


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "1")


@pytest.fixture
def native_only(monkeypatch):
    """Fail loudly if the codec runs its torch code (it pads into blocks; the kernels don't)."""

    def torch_path(*args):
        raise AssertionError("took the torch path")

    monkeypatch.setattr(BlockFloatingPoint, "_blocks", torch_path)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def gaussian(length, seed):
    return torch.randn(length, generator=_generator(seed))


def lognormal(length, seed):
    """Magnitudes over ~60 binades, random signs: blocks with very different exponents."""
    g = _generator(seed)
    signs = torch.randint(0, 2, (length,), generator=g).mul_(2).sub_(1)
    return torch.randn(length, generator=g).mul_(10).exp_().mul_(1e-12).mul_(signs).float()


def edge(length, seed, block=256):
    """Zero blocks, subnormals, values at the float32 limits, signed zeros, exact ties."""
    x = gaussian(length, seed)
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 2**-127, 1.17549435e-38, 3.4028235e38, -3.4028235e38,
         0.5, 1.5, 2.5, -2.5, 2**-24, 1.0, -1.0]
    )  # fmt: skip
    x[: min(length, len(specials))] = specials[: min(length, len(specials))]
    for b in range(0, length, 3 * block):  # every third block all zero, some all subnormal
        x[b + block : b + 2 * block] = 0.0
        x[b + 2 * block : b + 3 * block] = torch.sign(x[b + 2 * block : b + 3 * block]) * 1e-40
    return x


INPUTS = {"gaussian": gaussian, "lognormal": lognormal, "edge": edge}
LENGTHS = [1, 7, 255, 256, 257, 1000, 3 * 256 + 5, 1 << 14, (1 << 16) + 3]


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} differ"


def _round(codec, inputs, shared=None, contributors=None):
    """summaries, shared exponents, payloads, aggregate, decode: everything a round produces."""
    summaries = [codec.summarize(x, CTX) for x in inputs]
    if shared is None:
        shared = combine_summaries(summaries)
    payloads = [codec.encode(x, CTX, shared) for x in inputs]
    total = codec.aggregate(payloads, CTX)
    if contributors is not None:
        total = Payload(total.fields, total.length, contributors)
    return summaries, shared, payloads, total, codec.decode(total, CTX, shared)


def _same_round(fast, slow):
    for a, b in zip(fast[0], slow[0], strict=True):
        _same_bits(a, b)
    _same_bits(fast[1], slow[1])
    for a, b in zip(fast[2], slow[2], strict=True):
        _same_bits(a.fields["values"], b.fields["values"])
    _same_bits(fast[3].fields["values"], slow[3].fields["values"])
    _same_bits(fast[4], slow[4])


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("length", LENGTHS)
def test_round_is_bit_identical_to_torch(both, kind, length):
    inputs = [INPUTS[kind](length, seed=length + w) for w in range(3)]
    codec = BlockFloatingPoint(workers=3)
    _same_round(*both(lambda: _round(codec, inputs)))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 8, 64])
@pytest.mark.parametrize("block", [1, 3, 8, 100, 256, 4096])
def test_workers_and_block_sizes(both, workers, block):
    length = 2 * block + 37
    inputs = [edge(length, seed=w, block=block) * 0.7**w for w in range(min(workers, 4))]
    codec = BlockFloatingPoint(workers=workers, block_size=block)
    _same_round(*both(lambda: _round(codec, inputs)))


def test_the_native_path_runs(native_only):
    codec = BlockFloatingPoint(workers=2)
    inputs = [gaussian(1000, seed=s) for s in range(2)]
    _, _, _, _, average = _round(codec, inputs)
    assert torch.allclose(average, (inputs[0] + inputs[1]) / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("contributors", [1, 2, 3, 7])
def test_decode_divides_like_torch(both, contributors):
    """Partial aggregation: fewer (or, for the collective's lane-wise decode, 1) contributors;
    2**-shift / 3 is not exact, so the division itself must match."""
    inputs = [lognormal(5000, seed=s) for s in range(2)]
    codec = BlockFloatingPoint(workers=8)
    _same_round(*both(lambda: _round(codec, inputs, contributors=contributors)))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 7])
def test_mismatched_exponents_saturate_at_the_limit(both, workers):
    """Exponents from a smaller gradient: values clamp to +-limit, and a sum of `workers` of them
    still fits int32 (the limit is a float32 at most INT32_MAX // workers)."""
    codec = BlockFloatingPoint(workers=workers)
    x = gaussian(3000, seed=workers) * 1e6
    small = codec.summarize(x * 1e-9, CTX)
    fast, slow = both(lambda: codec.encode(x, CTX, small).fields["values"])
    _same_bits(fast, slow)
    limit = saturation_limit(workers)
    assert int(fast.max()) == limit and int(fast.min()) == -limit
    assert workers * limit <= INT32_MAX
    assert limit == float(torch.tensor(limit, dtype=torch.float32))


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 5, 6, 7, 8, 100, 1000])
def test_saturation_limit(workers):
    limit = saturation_limit(workers)
    quotient = INT32_MAX // workers
    assert limit <= quotient
    assert limit == float(torch.tensor(limit, dtype=torch.float32))
    assert float(torch.tensor(quotient, dtype=torch.float64).float()) >= limit  # largest below
    assert torch.nextafter(torch.tensor(limit), torch.tensor(math.inf)).item() > quotient


@pytest.mark.parametrize(
    "shared",
    [
        torch.full((4,), 1000.0),  # shift far below -126
        torch.full((4,), 0.5),  # not an integer
        torch.tensor([1.0, float("nan"), 2.0, 3.0]),
        torch.tensor([-100.0, -126.0, 128.0, 160.0]),  # 160: shift -132
    ],
)
def test_exponents_the_kernels_refuse_fall_back_to_torch(both, shared):
    codec = BlockFloatingPoint(workers=4)
    x = gaussian(1000, seed=3)

    def run():
        values = codec.encode(x, CTX, shared)
        return values.fields["values"], codec.decode(values, CTX, shared)

    (fast_values, fast_avg), (slow_values, slow_avg) = both(run)
    _same_bits(fast_values, slow_values)
    assert torch.equal(fast_avg.isnan(), slow_avg.isnan())
    _same_bits(fast_avg.nan_to_num(), slow_avg.nan_to_num())


def test_extreme_shared_exponents_are_exact(both):
    """The full range of exponents a float32 block can report, and the 120 shift cap."""
    codec = BlockFloatingPoint(workers=2, block_size=4)
    values = [math.ldexp(0.75, e) for e in range(-148, 129) for _ in range(4)]
    x = torch.tensor(values, dtype=torch.float32)
    x[1::4] *= -0.5
    _same_round(*both(lambda: _round(codec, [x, x.flip(0)])))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 255, 256, 999])
def test_non_finite_input_raises_the_same_error(monkeypatch, bad, where):
    codec = BlockFloatingPoint(workers=2)
    x = gaussian(1000, seed=1)
    good_shared = codec.summarize(x, CTX)
    x[where] = bad
    messages = []
    for native in ("1", "0"):
        monkeypatch.setenv("GRADSUM_NATIVE", native)
        with pytest.raises(NonFiniteGradientError, match="contains NaN or Inf") as summary:
            codec.summarize(x, CTX)
        with pytest.raises(NonFiniteGradientError) as encode:
            codec.encode(x, CTX, good_shared)
        messages.append((str(summary.value), str(encode.value)))
    assert messages[0] == messages[1]
    assert f"[{where}]" in messages[0][0]


def test_native_off_runs_torch(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    assert not bfp_native.available()

    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"called the kernel {name} with GRADSUM_NATIVE=0")

    monkeypatch.setattr(bfp_native, "_bfp_kernels", Refuse())
    inputs = [gaussian(1000, seed=s) for s in range(2)]
    average = _round(BlockFloatingPoint(workers=2), inputs)[4]
    assert torch.allclose(average, (inputs[0] + inputs[1]) / 2, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.double(),  # another dtype
        lambda x: torch.stack([x, x], dim=1)[:, 0],  # not contiguous
        lambda x: x.reshape(10, 100),  # contiguous, not flat: the kernels take it as is
    ],
)
def test_inputs_the_kernels_do_not_take_match_too(both, make):
    codec = BlockFloatingPoint(workers=2)
    inputs = [make(lognormal(1000, seed=s)) for s in range(2)]
    _same_round(*both(lambda: _round(codec, inputs)))


def test_aggregate_wraps_like_torch(both):
    """The int32 sum wraps where torch's does (only a broken codec would get there)."""
    g = _generator(0)
    values = [
        torch.randint(-(2**31), 2**31 - 1, (3001,), generator=g, dtype=torch.int32)
        for _ in range(5)
    ]
    codec = BlockFloatingPoint(workers=5)
    payloads = [Payload({"values": v}, 3001) for v in values]
    fast, slow = both(lambda: codec.aggregate(payloads, CTX))
    _same_bits(fast.fields["values"], slow.fields["values"])
    assert fast.contributors == 5
    single = codec.aggregate(payloads[:1], CTX).fields["values"]
    assert torch.equal(single, values[0]) and single.data_ptr() != values[0].data_ptr()


def test_empty_input(both):
    codec = BlockFloatingPoint(workers=2)
    fast, slow = both(lambda: codec.summarize(torch.empty(0), CTX))
    _same_bits(fast, slow)


def test_registry_codec_uses_the_kernels(native_only):
    codec = make_codec("bfp", workers=4)
    inputs = [gaussian(4096, seed=s) for s in range(4)]
    average = _round(codec, inputs)[4]
    assert torch.allclose(average, torch.stack(inputs).mean(0), rtol=1e-5, atol=1e-7)


# -- output recycling ---------------------------------------------------------------------------
HOLDERS = {
    "variable": lambda t: t,
    "list": lambda t: [t],
    "payload": lambda t: Payload({"values": t}, t.numel()),
    "view": lambda t: t[10:20],
    "reshape": lambda t: t.reshape(2, -1),
    "numpy": lambda t: t.numpy(),
    "memoryview": lambda t: memoryview(t.numpy()).cast("B")[4:],
    "storage": lambda t: t.untyped_storage(),
    "grad": lambda t: _as_grad(t),
}


def _as_grad(t):
    parameter = torch.zeros(t.shape, dtype=t.dtype, requires_grad=True)
    parameter.grad = t
    return parameter


@pytest.fixture
def recycler():
    if buffers._BASELINE is None:
        pytest.skip("this torch/Python does not expose the reference counts; nothing recycles")
    return buffers.Recycler(budget=1 << 20, min_bytes=1024, per_request=2)


def test_a_dropped_buffer_is_handed_out_again(recycler):
    first = recycler.empty(4096, torch.int32)
    address = first.data_ptr()
    del first
    again = recycler.empty(4096, torch.int32)
    assert again.data_ptr() == address
    assert recycler.empty(4096, torch.int32).data_ptr() != address  # `again` is held
    assert recycler.empty(4096, torch.float32).data_ptr() != address  # another dtype


def test_empty_on_recycles_on_the_cpu_only(recycler):
    """Another device's tensor is made there (the bug feared: a CPU buffer handed to a device
    round, or a device tensor kept in the CPU's list)."""
    first = recycler.empty_on(torch.device("cpu"), 4096, torch.float32)
    address = first.data_ptr()
    del first
    assert recycler.empty_on(torch.device("cpu"), 4096, torch.float32).data_ptr() == address
    elsewhere = recycler.empty_on(torch.device("meta"), 4096, torch.float32)
    assert elsewhere.device.type == "meta" and elsewhere.numel() == 4096
    assert all(t.device.type == "cpu" for t in recycler._kept)


@pytest.mark.parametrize("holder", sorted(HOLDERS))
def test_a_buffer_something_refers_to_is_not_handed_out(recycler, holder):
    first = recycler.empty(4096, torch.float32)
    address = first.data_ptr()
    held = HOLDERS[holder](first)
    del first
    other = recycler.empty(4096, torch.float32)
    assert other.data_ptr() != address
    del held
    assert recycler.empty(4096, torch.float32).data_ptr() == address


def test_small_buffers_and_the_budget(recycler):
    small = recycler.empty(16, torch.int32)
    address = small.data_ptr()
    del small
    assert not any(t.data_ptr() == address for t in recycler._kept)
    # the budget bounds the idle buffers: held ones cost the recycler nothing and all stay
    # listed (2 MiB, over the 1 MiB budget), to be handed out again once let go (the bug
    # feared: error feedback's memory, held from round to round, counted against the budget,
    # so that every round's other buffers were dropped and made afresh)
    held = [recycler.empty(65536, torch.int32) for _ in range(8)]
    addresses = [t.data_ptr() for t in held]
    assert [t.data_ptr() for t in recycler._kept] == addresses
    del held  # idle now: the next fresh buffer drops the oldest beyond the budget
    other = recycler.empty(4096, torch.int32)
    assert [t.data_ptr() for t in recycler._kept] == [*addresses[4:], other.data_ptr()]
    big = [recycler.empty(1 << 20, torch.int32) for _ in range(3)]  # 4 MiB each
    big_addresses = [t.data_ptr() for t in big]
    del big  # idle: a fresh 4 MiB buffer keeps 8 MiB of them (per_request 2), newest first
    last = recycler.empty((1 << 20) + 16, torch.int32)
    assert [t.data_ptr() for t in recycler._kept] == [other.data_ptr(), *big_addresses[1:],
                                                       last.data_ptr()]  # fmt: skip


def test_the_recycler_lists_a_bounded_number_of_buffers(recycler):
    held = [recycler.empty(1024, torch.int32) for _ in range(buffers.MAX_LISTED + 5)]
    assert len(recycler._kept) == buffers.MAX_LISTED
    assert [t.data_ptr() for t in recycler._kept] == [t.data_ptr() for t in held[5:]]


def test_held_payloads_and_averages_keep_their_values():
    """The property that matters: what a caller still holds is never overwritten."""
    codec = BlockFloatingPoint(workers=2)
    inputs = [gaussian(1 << 18, seed=s) for s in range(4)]
    rounds = [_round(codec, inputs[i : i + 2]) for i in range(0, 4, 2)]
    again = [_round(BlockFloatingPoint(workers=2), inputs[i : i + 2]) for i in range(0, 4, 2)]
    for kept, fresh in zip(rounds, again, strict=True):
        _same_round(kept, fresh)
    ours = {t.data_ptr() for r in rounds for t in (*[p.fields["values"] for p in r[2]], r[4])}
    assert len(ours) == 2 * 3  # two rounds of two payloads and an average, all distinct


def test_a_steady_loop_reuses_its_buffers():
    codec = BlockFloatingPoint(workers=1)
    x = gaussian(1 << 18, seed=0)
    addresses = set()
    for _ in range(5):
        shared = codec.summarize(x, CTX)
        payload = codec.encode(x, CTX, shared)
        average = codec.decode(payload, CTX, shared)
        addresses |= {payload.fields["values"].data_ptr(), average.data_ptr()}
        del payload, average
    if buffers._BASELINE is not None:
        assert len(addresses) == 2


def test_without_the_extension_torch_runs(monkeypatch):
    """What a machine without a C compiler gets."""
    monkeypatch.setattr(bfp_native, "_bfp_kernels", None)
    assert not bfp_native.built() and not bfp_native.available()
    codec = BlockFloatingPoint(workers=2)
    inputs = [lognormal(3000, seed=s) for s in range(2)]
    slow = _round(codec, inputs)
    monkeypatch.undo()
    monkeypatch.setenv("GRADSUM_NATIVE", "1")
    _same_round(_round(codec, inputs), slow)


def test_codecs_still_copy_and_pickle():
    import copy
    import pickle

    codec = BlockFloatingPoint(workers=2)
    inputs = [gaussian(1 << 17, seed=s) for s in range(2)]
    first = _round(codec, inputs)
    for clone in (copy.deepcopy(codec), pickle.loads(pickle.dumps(codec))):
        assert clone._recycler._kept == []
        _same_round(_round(clone, inputs), first)


def test_a_lane_coder_codes_any_run_of_coordinates_with_the_whole_vectors_bits():
    """Packets start and end anywhere, mid-block included, and the last runs past the
    coordinates (padding lanes: zeros up, nothing decoded): each run's lanes and decoded values
    are the whole vector's encode and decode of those coordinates, bit for bit."""
    block, length = 100, 1037
    codec = BlockFloatingPoint(workers=3, block_size=block)
    x = lognormal(length, seed=3)
    shared = codec.summarize(x, CTX)
    whole = codec.encode(x, CTX, shared).fields["values"]
    sums = whole * 3 - 7
    want = codec.decode(Payload({"values": sums}, length, 3), CTX, shared)
    out = torch.full((length,), float("nan"))
    coder = codec.lane_coder(x, shared, out)
    runs = [(0, 64), (64, 37), (101, 250), (351, 1), (352, 688)]  # 1040 lanes: 3 padding
    for first, count in runs:
        lanes = bytearray(b"\xff" * 4 * count)  # the last send's bytes
        coder.encode(first, count, memoryview(lanes))
        got = torch.frombuffer(lanes, dtype=torch.int32)
        real = max(0, min(count, length - first))
        _same_bits(got[:real], whole[first : first + real])
        assert not got[real:].any()
        wire = torch.zeros(count, dtype=torch.int32)
        wire[:real] = sums[first : first + real]
        coder.decode(first, count, memoryview(wire.numpy()).cast("B"), 3)
    _same_bits(out, want)


def test_a_lane_coder_is_offered_only_where_the_kernels_take_the_round():
    codec = BlockFloatingPoint(workers=2, block_size=256)
    x = gaussian(1000, seed=0)
    shared = codec.summarize(x, CTX)
    assert codec.lane_coder(x, shared, torch.empty(1000)) is not None
    assert codec.lane_coder(x.double(), shared, torch.empty(1000)) is None
    assert codec.lane_coder(x, shared, torch.empty(2000)[::2]) is None  # not contiguous
    refused = shared.clone()
    refused[1] = 0.5  # a shift the kernels do not take (torch's path would)
    assert codec.lane_coder(x, refused, torch.empty(1000)) is None
    with pytest.raises(ValueError, match="exponents"):
        codec.lane_coder(x, shared[:2], torch.empty(1000))


@pytest.mark.parametrize(
    ("codec", "partition", "offered"),
    [
        ("bfp", 4096, True),
        ("bfp", 1001, False),  # pieces of 1001 lanes: padding between them
        ("bfp+ef", 4096, False),  # error feedback needs each piece's own encode
        ("thc", 4096, False),  # lanes are rotated coordinates
    ],
)
def test_a_rounds_sum_phase_offers_one_coder_where_lanes_are_its_coordinates(
    codec, partition, offered
):
    from gradsum.codecs.feedback import ErrorFeedback
    from gradsum.codecs.round import CodecRound

    inner = make_codec(codec.removesuffix("+ef"), workers=2)
    chosen = ErrorFeedback(inner) if codec.endswith("+ef") else inner
    flat = gaussian(3 * 4096 + 777, seed=1)
    prepared = CodecRound(chosen, 0, partition).prepare(flat, worker=0, key=None, step=0)
    prepared.share(prepared.summaries)
    coder = prepared.sum_phase(streamed=True).lane_coder()
    assert (coder is not None) == offered
    if offered:
        assert coder.length == flat.numel() and coder.x.data_ptr() == flat.data_ptr()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("partition", [4096, 1000])
def test_merged_partitions_average_as_the_rounds_partitions_one_by_one(
    monkeypatch, native, partition
):
    """bfp merges a round's partitions where they are whole blocks (and keeps them where not):
    either way each partition averages as a round of that partition alone would."""
    from gradsum.codecs.round import run_round

    monkeypatch.setenv("GRADSUM_NATIVE", "1" if native else "0")
    codec = BlockFloatingPoint(workers=3, block_size=256)
    inputs = [lognormal(5 * partition + 333, seed=w) for w in range(3)]
    merged = codec.partitions(None, inputs[0].numel(), partition)
    assert (merged == [(0, inputs[0].numel())]) == (partition % 256 == 0)
    average = run_round(codec, inputs, partition_elements=partition).average
    for start in range(0, inputs[0].numel(), partition):
        alone = [x[start : start + partition] for x in inputs]
        want = run_round(codec, alone, partition_elements=partition).average
        _same_bits(average[start : start + partition], want)


@pytest.mark.parametrize("native", [True, False])
def test_a_steps_gradients_joined_average_as_each_alone(monkeypatch, native):
    """bfp joins a step's gradients into one round where it runs torch's code (a device):
    each gradient from a whole block on, so its blocks, exponents and averages are its own
    round's, bit for bit (gradients of odd sizes and scales a million apart)."""
    from gradsum.codecs.round import CodecRound

    monkeypatch.setenv("GRADSUM_NATIVE", "1" if native else "0")
    codec = BlockFloatingPoint(workers=3, block_size=256)
    flats = [lognormal(n, seed=n) * scale for n, scale in ((1000, 1e6), (257, 1e-6), (4096, 1))]
    assert codec.joins(flats, 4096) == (not native)
    assert not codec.joins(flats, 1000)  # partitions not of whole blocks: kept apart
    rounds = CodecRound(codec, partition_elements=4096)
    got = rounds.run_many(flats, OneWorker(), worker=0, keys=[0, 1, 2], step=0)
    for key, flat in enumerate(flats):
        _same_bits(got[key], rounds.run(flat, OneWorker(), worker=0, key=key, step=0))
