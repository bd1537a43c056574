"""A codec may be driven from several threads at once (a plan's shard streams share the worker's
codec): concurrent rounds through one codec give the payloads and averages of sequential ones."""

import threading

import pytest
import torch

from gradsum.codecs import CODEC_NAMES, make_codec
from gradsum.codecs.round import CodecRound

from .conftest import gaussian_inputs

THREADS, ROUNDS, LENGTH = 3, 10, 70_000  # non-power-of-two: THC pads and rotates


class Recorder:
    """A one-worker reducer that keeps every payload it is handed."""

    def __init__(self):
        self.payloads = []

    def max(self, summaries):
        return list(summaries)

    def sum(self, phase):
        payloads = phase.payloads()
        self.payloads += [{k: v.clone() for k, v in p.fields.items()} for p in payloads]
        phase.deliver_all([phase.codec.aggregate([p], phase.aggregator_context(i))
                           for i, p in enumerate(payloads)])  # fmt: skip


def rounds(codec, inputs, keys):
    """Each input through its own round (key), in order; every round's payloads (one per
    stage of a codec's round) and its average."""
    round_ = CodecRound(codec, seed=3)
    payloads, averages = [], []
    for x, k in zip(inputs, keys, strict=True):
        recorder = Recorder()
        averages.append(round_.run(x, recorder, worker=0, key=k, step=0))
        payloads.append(recorder.payloads)
    return payloads, averages


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_concurrent_rounds_through_one_codec_give_the_sequential_payloads(name, native,
                                                                          monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", native)
    inputs = gaussian_inputs(THREADS * ROUNDS, LENGTH, seed=4)
    keys = [("part", i) for i in range(len(inputs))]
    want_payloads, want_averages = rounds(make_codec(name, workers=1), inputs, keys)

    shared = make_codec(name, workers=1)
    results: dict[int, tuple] = {}
    start = threading.Barrier(THREADS)

    def stream(t: int) -> None:
        start.wait()
        mine = range(t, len(inputs), THREADS)  # interleaved, so threads overlap all along
        results[t] = (list(mine), *rounds(shared, [inputs[i] for i in mine],
                                          [keys[i] for i in mine]))  # fmt: skip

    threads = [threading.Thread(target=stream, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(results) == THREADS
    for indices, payloads, averages in results.values():
        for i, stages, average in zip(indices, payloads, averages, strict=True):
            assert len(stages) == len(want_payloads[i])
            for payload, want in zip(stages, want_payloads[i], strict=True):
                assert payload.keys() == want.keys()
                for field in payload:
                    assert torch.equal(payload[field], want[field]), (name, i, field)
            assert torch.equal(average, want_averages[i]), (name, i)
