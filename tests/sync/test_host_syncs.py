"""The all-reduce aggregator's THC round makes no host sync, and its sums take the narrowest
type that holds n*g exactly: uint8, float16 integers (n*g < 2048), int32."""

import os

import pytest
import torch

from gradsum.codecs import WidthOverflowError, make_codec, run_round
from gradsum.codecs.base import DeviceChecks
from gradsum.codecs.integers import check_workers, sum_dtype
from gradsum.codecs.round import PARTITION_ELEMENTS, CodecRound

from ..host_syncs import count_host_syncs
from .distributed import run_distributed

# the workers set their own path (the torch path, which a GPU runs)
pytestmark = pytest.mark.pins_native

LENGTH = PARTITION_ELEMENTS + 12_345
SEED, KEY = 7, ("bucket", 0)


def gradient(rank: int, step: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(100 * step + rank))


def allreduce_syncs_and_sums(rank: int, world: int) -> dict:
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.session import Session

    aggregator = AllReduceAggregator()
    out = {}
    os.environ["GRADSUM_NATIVE"] = "0"  # the torch path, which a GPU runs
    for name in ("thc", "thc-uniform"):
        codec = make_codec(name, workers=world)
        round_ = CodecRound(codec, SEED)
        round_.run(gradient(rank, 0), aggregator, worker=rank, key=KEY, step=0)  # warm-up
        checks = DeviceChecks()
        with count_host_syncs() as syncs:
            round_.run(gradient(rank, 1), aggregator, worker=rank, key=KEY, step=1, checks=checks)
        checks.raise_if_failed()
        out["syncs", name] = syncs.calls
    os.environ["GRADSUM_NATIVE"] = "1"
    for workers in (world, 16, 100):  # uint8, float16 and int32 sums of the same rounds
        session = Session(make_codec("thc", workers=workers), aggregator, seed=SEED)
        out["thc", workers] = [session.synchronize(gradient(rank, step, 50_000), key=KEY, step=step)
                               for step in range(2)]  # fmt: skip
    return out


@pytest.mark.slow
def test_allreduce_thc_rounds_make_no_host_sync_and_sum_in_the_narrowest_exact_type():
    results = run_distributed(allreduce_syncs_and_sums, 2, timeout=300)
    for rank, result in enumerate(results):
        for name in ("thc", "thc-uniform"):
            assert result["syncs", name] == [], f"rank {rank}, {name}"
    for workers in (2, 16, 100):
        codec = make_codec("thc", workers=workers)
        for step in range(2):
            want = run_round(codec, [gradient(r, step, 50_000) for r in range(2)], seed=SEED,
                             step=step, key=KEY).average  # fmt: skip
            for rank, result in enumerate(results):
                got = result["thc", workers][step]
                assert torch.equal(got, want), f"{workers} workers' sums, rank {rank}, step {step}"


def test_sum_types_hold_every_sum_exactly():
    # THC at g = 30: n*g < 256 in uint8 (8 workers), < 2048 in float16 (68), int32 beyond
    assert [sum_dtype(make_codec("thc", workers=n)) for n in (8, 9, 68, 69)] == [
        torch.uint8, torch.float16, torch.float16, torch.int32]  # fmt: skip
    assert sum_dtype(make_codec("bfp", workers=2)) == torch.int32  # signed lanes
    sums = torch.arange(0, 68 * 30 + 1, dtype=torch.float16)  # every sum 68 workers can make
    assert torch.equal(sums.to(torch.int32), torch.arange(0, 68 * 30 + 1, dtype=torch.int32))
    assert float(torch.tensor(2047, dtype=torch.float16) + 1) == 2048  # the last exact step


def test_more_workers_than_configured_are_refused_before_summing():
    with pytest.raises(WidthOverflowError, match="configured for"):
        check_workers(make_codec("thc", workers=4), 5)
