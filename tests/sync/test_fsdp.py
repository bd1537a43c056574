"""FSDP2's reduce-scatter through gradsum's codecs: every rank's shard is the reference round of
that shard of every rank's gradient, bit for bit, step after step with error feedback; ``none``
is torch's reduce-scatter; HSDP's replica all-reduce goes through the same codec."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from gradsum.codecs import make_codec
from gradsum.codecs.round import run_round
from gradsum.sync.fsdp import NotHomomorphic, check_shardable, shard_keys

from .distributed import run_distributed
from .fsdp_workers import (
    PARTITION,
    record_reduce_scatters,
    reference_training,
    train_hsdp,
)

STEPS = 3


def _by_unit(results):
    """{unit: [[rank 0's record, rank 1's, ...] per call]} from every rank's records."""
    calls = defaultdict(lambda: defaultdict(list))
    for rank_result in results:
        counts = defaultdict(int)
        for record in rank_result["records"]:
            calls[record["unit"]][counts[record["unit"]]].append(record)
            counts[record["unit"]] += 1
    return {unit: [per_call[k] for k in sorted(per_call)] for unit, per_call in calls.items()}


CODECS = [("thc", {}), ("thc", {"correlated": True}), ("bfp", {})]
METHODS = [*CODECS, ("none", {}), (None, {})]  # None: torch's own reduce-scatter


@pytest.fixture(scope="module")
def recorded():
    """Every method's records on 2 and on 4 ranks: one spawn per world size."""
    runs = {}
    for world in (2, 4):
        by_rank = run_distributed(record_reduce_scatters, world, METHODS, STEPS, fresh=True)
        for m, method in enumerate(METHODS):
            runs[(world, method[0], tuple(method[1].items()))] = [r[m] for r in by_rank]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(("name", "options"), CODECS, ids=["thc", "thc-correlated", "bfp"])
def test_every_ranks_shard_is_the_reference_round_of_that_shard(recorded, world, name, options):
    results = recorded[(world, name, tuple(options.items()))]
    units = _by_unit(results)
    assert len(units) == 3 and all(len(calls) == STEPS for calls in units.values())
    assert [r["rounds"] for r in results] == [3 * STEPS] * world  # every call went through it
    flat_sizes = {unit: calls[0][0]["input"].numel() for unit, calls in units.items()}
    # FSDP2 pads each parameter's dim 0 to a multiple of the world: 15 coordinates become more
    assert any(sum(p.numel() for p in _unit_params(u)) % world for u in units)
    reference = make_codec(name, workers=world, **options)  # stands for every worker
    for unit, calls in units.items():
        size = flat_sizes[unit] // world
        sizes = calls[0][0]["sizes"]
        assert sum(sizes) == size  # each parameter's padded shard, as FSDP2 lays it out
        for shard_key in shard_keys(("fsdp", unit), world):
            reference.describe(shard_key, [(s,) for s in sizes])
        for step, records in enumerate(calls):
            for shard, shard_key in enumerate(shard_keys(("fsdp", unit), world)):
                inputs = [r["input"][shard * size : (shard + 1) * size] for r in records]
                expected = run_round(reference, inputs, seed=5, step=step, key=shard_key,
                                     partition_elements=PARTITION).average  # fmt: skip
                got = records[shard]["output"]
                assert torch.equal(got, expected), (unit, step, shard)


def _unit_params(unit: str):
    from .fsdp_workers import small_model

    return list(small_model()[int(unit)].parameters())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_none_is_torchs_reduce_scatter(recorded, world):
    ours, torchs = recorded[(world, "none", ())], recorded[(world, None, ())]
    assert [r["rounds"] for r in ours] == [3 * STEPS] * world
    pairs = zip(sorted(_by_unit(ours).items()), sorted(_by_unit(torchs).items()), strict=True)
    for (unit, calls), (_, theirs) in pairs:
        for records, their_records in zip(calls, theirs, strict=True):
            size = records[0]["input"].numel() // world
            for shard, (record, their) in enumerate(zip(records, their_records, strict=True)):
                assert torch.allclose(record["output"], their["output"], rtol=1e-6, atol=1e-7)
                mean = torch.stack([r["input"][shard * size : (shard + 1) * size]
                                    for r in records]).mean(dim=0)  # fmt: skip
                assert torch.allclose(record["output"], mean, rtol=1e-6, atol=1e-7), unit


@pytest.mark.parametrize("name", ["powersgd", "topk", "qsgd"])
def test_a_codec_that_is_not_homomorphic_is_refused(name):
    with pytest.raises(NotHomomorphic, match="cannot compress FSDP2's reduce-scatter"):
        check_shardable(make_codec(name, workers=2))


@pytest.mark.slow
def test_hsdp_on_a_2x2_mesh_trains_through_the_codec_on_both_collectives(tmp_path):
    steps = 4
    by_rank = run_distributed(train_hsdp, 4, ["none", "thc"], steps, fresh=True)
    exact, compressed = [r[0] for r in by_rank], [r[1] for r in by_rank]
    expected = reference_training(4, steps)
    for rank in exact:
        assert rank["rounds"] == rank["replica_rounds"] == 3 * steps
        for got, want in zip(rank["params"], expected, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    for rank in compressed[1:]:  # the replica all-reduce leaves every replica alike
        for got, want in zip(rank["params"], compressed[0]["params"], strict=True):
            assert torch.equal(got, want)
    drift = max(float((got - want).abs().max())
                for got, want in zip(compressed[0]["params"], expected, strict=True))  # fmt: skip
    assert 0 < drift < 0.05  # compressed, and still the same training


def _in_process_reduce_scatter(codec, flats, step, partition):
    """Every rank's ``ShardedRound`` with the collectives done by hand: the MAX of the
    summaries, the SUM of every rank's lanes, each rank's chunk of it."""
    from gradsum.codecs.round import CodecRound
    from gradsum.sync.fsdp import ShardedRound

    world = len(flats)
    rounds = [ShardedRound(CodecRound(codec, 5, partition), flat, world, shard=rank,
                           worker=rank, key="unit", step=step)
              for rank, flat in enumerate(flats)]  # fmt: skip
    if codec.needs_summary:
        summaries = [r.summaries() for r in rounds]
        shared = [torch.stack(column).amax(dim=0) for column in zip(*summaries, strict=True)]
        for r in rounds:
            r.share(shared)
    lanes = [r.lanes() for r in rounds]
    count = lanes[0][1]
    total = torch.stack([flat.to(torch.int64) if not flat.is_floating_point() else flat
                         for flat, _ in lanes]).sum(dim=0)  # fmt: skip
    return [r.decode(total[rank * count : (rank + 1) * count].to(lanes[0][0].dtype))
            for rank, r in enumerate(rounds)]  # fmt: skip


@pytest.mark.parametrize(("name", "options"), [*CODECS, ("none", {})],
                         ids=["thc", "thc-correlated", "bfp", "none"])  # fmt: skip
def test_the_sharded_round_is_the_reference_round_of_each_shard_in_process(name, options):
    world, size = 3, 37  # three ranks, shards of 37: partitions of 16 end short in each
    ours = make_codec(name, workers=world, **options)
    reference = make_codec(name, workers=world, **options)
    generator = torch.Generator().manual_seed(0)
    for step in range(STEPS):  # error feedback carries from step to step
        flats = [torch.randn(world * size, generator=generator) for _ in range(world)]
        outputs = _in_process_reduce_scatter(ours, flats, step, 16)
        for shard, key in enumerate(shard_keys("unit", world)):
            inputs = [f[shard * size : (shard + 1) * size] for f in flats]
            expected = run_round(reference, inputs, seed=5, step=step, key=key,
                                 partition_elements=16).average  # fmt: skip
            assert torch.equal(outputs[shard], expected), (step, shard)
