"""One run, one Session: a worker builds the run's codec once, and nothing below the Session
builds another (no throw-away copies for checks, clients or wire formats).

The codecs are counted where every one is made, ``Codec.__init__``, inside each worker of a
real run. What one ``make_codec`` of the run's codec constructs (THC: the codec and its error
feedback wrapper) is the run's codec, built once. Steps that go uncompressed (here the first
two, ``uncompressed_steps``) add the aggregator's lossless codec, built once as well (the
Session's ``uncompressed()``) and only in runs that have such steps; it is counted apart, since
it is a second codec of the run, not a copy of the first.

The optimizer asks the codec, not its name, whether to apply momentum (DGC carries its own).
"""

from collections import Counter

import pytest

from gradsum.train.config import TrainConfig

from ..sync.distributed import run_distributed

WORKERS = 2


def _counting_constructions(build) -> Counter:
    """The codec classes constructed while ``build()`` runs, with how many of each."""
    from gradsum.codecs.base import Codec

    built: Counter = Counter()
    original = Codec.__init__

    def counted(self, *args, **kwargs):
        built[type(self).__name__] += 1
        original(self, *args, **kwargs)

    Codec.__init__ = counted
    try:
        build()
    finally:
        Codec.__init__ = original
    return built


def _train_counting(rank, world, config) -> dict:
    from gradsum.train.loop import train_worker

    return dict(_counting_constructions(lambda: train_worker(config, rank, world)))


def _one(name: str) -> Counter:
    from gradsum.codecs import make_codec

    return _counting_constructions(lambda: make_codec(name, workers=WORKERS))


@pytest.mark.slow
@pytest.mark.parametrize("uncompressed_steps", [0, 2])
@pytest.mark.parametrize("aggregator", ["allreduce", "switch", "ps"])
def test_each_worker_builds_the_runs_codec_once(aggregator, uncompressed_steps):
    from gradsum.train.services import local_services

    config = TrainConfig(aggregator=aggregator, codec="thc", workers=WORKERS, max_steps=4,
                         eval_every=4, eval_samples=32, progress=False,
                         uncompressed_steps=uncompressed_steps)  # fmt: skip
    with local_services(config) as addresses:
        config = TrainConfig(**{**config.__dict__, **addresses})
        counts = run_distributed(_train_counting, WORKERS, config, timeout=300)
    expected = _one("thc")
    if uncompressed_steps:
        expected += _one("bfp" if aggregator == "switch" else "none")
    for rank, built in enumerate(counts):
        assert Counter(built) == expected, f"worker {rank} on {aggregator}"


def test_the_optimizer_leaves_momentum_to_a_codec_that_carries_it():
    import torch

    from gradsum.codecs import make_codec
    from gradsum.train.loop import _make_optimizer

    model = torch.nn.Linear(3, 2)
    config = TrainConfig(momentum=0.9)
    momentum = {name: _make_optimizer(config, model.parameters(), make_codec(name, workers=2))
                .param_groups[0]["momentum"] for name in ("dgc", "topk", "thc")}  # fmt: skip
    assert momentum == {"dgc": 0.0, "topk": 0.9, "thc": 0.9}
    ddp = _make_optimizer(config, model.parameters(), None)
    assert ddp.param_groups[0]["momentum"] == 0.9
