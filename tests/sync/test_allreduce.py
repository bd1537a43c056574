"""The all-reduce aggregator, the DDP hook and gradient sync with real Gloo process groups."""

import pytest
import torch

from gradsum.codecs import CODEC_NAMES, make_codec, run_round

from .distributed import run_distributed
from .workers import rank_input, synchronize_codecs, train_with_ddp_hook, train_with_gradient_sync

HOMOMORPHIC = ("none", "bfp", "thc", "thc-uniform")


def test_every_codec_over_allreduce_gives_every_worker_the_reference_estimate():
    world, length = 3, 5000
    results = run_distributed(synchronize_codecs, world, CODEC_NAMES, length, 2048)
    truth = [rank_input(rank, length) for rank in range(world)]
    for name in CODEC_NAMES:
        estimates = [results[rank][name] for rank in range(world)]
        assert all(torch.equal(estimates[0], e) for e in estimates[1:]), name
        reference = run_round(make_codec(name, workers=world), truth, key="t",
                              partition_elements=2048).average  # fmt: skip
        if name == "none":  # Gloo's ring adds in an order of its own
            assert torch.allclose(estimates[0], reference, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(estimates[0], reference), name


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "thc", "topk"])
def test_ddp_hook_trains_and_keeps_replicas_identical_through_bucket_rebuild(codec):
    steps = 12
    first, second = run_distributed(train_with_ddp_hook, 2, codec, steps)
    assert first["steps"] == steps
    for a, b in zip(first["snapshots"], second["snapshots"], strict=True):
        assert torch.equal(a, b)
    assert sum(first["losses"][-3:]) < sum(first["losses"][:3])
    # what the hook returned, bucket by bucket, against the exact average of the workers'
    # buckets: a hook that scaled its output (2x: error 1) trains and stays identical too
    errors = first["errors"]
    assert len(errors) >= steps and errors == second["errors"]
    if codec == "none":
        assert max(errors) < 1e-6, errors
    elif codec == "thc":  # 4 bits: about 0.1 on these buckets
        assert min(errors) > 0.02 and max(errors) < 0.3, errors


@pytest.mark.slow
@pytest.mark.parametrize(("codec", "fusion"), [("thc", None), ("bfp", 3000), ("qsgd", None)])
def test_gradient_sync_trains_and_keeps_replicas_identical(codec, fusion):
    steps = 12
    first, second = run_distributed(train_with_gradient_sync, 2, codec, steps, fusion)
    for a, b in zip(first["snapshots"], second["snapshots"], strict=True):
        assert torch.equal(a, b)
    assert sum(first["losses"][-3:]) < sum(first["losses"][:3])
    assert first["groups"] == (6 if fusion is None else 2)
