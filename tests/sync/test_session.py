"""A Session pairs the run's codec with its wire format once, connects it to the aggregator once,
and builds the lossless Session of uncompressed steps once, the first time one is asked for."""

import torch

from gradsum.codecs import make_codec
from gradsum.dataplane.codec_wire import wire_format
from gradsum.sync.session import Session

from .fakes import Answering


def test_a_session_connects_its_wire_format_once_and_its_lossless_one_once():
    aggregator = Answering(lambda flat, **_: flat)
    codec = make_codec("topk", workers=2, ratio=0.5)
    session = Session(codec, aggregator, options={"ratio": 0.5}, seed=3)
    assert session.wire == wire_format(codec, {"ratio": 0.5}, 3)  # the server's copy: options
    for step in range(3):
        session.synchronize(torch.ones(8), key="g", step=step)
    assert aggregator.connected == [session.wire]
    lossless = session.uncompressed()
    assert session.uncompressed() is lossless and lossless.codec.name == "none"
    assert (lossless.seed, lossless.partition_elements) == (3, session.partition_elements)
    assert aggregator.connected == [session.wire, lossless.wire]


def test_a_switchs_lossless_codec_is_bfp():
    aggregator = Answering(lambda flat, **_: flat)
    aggregator.sums_floats = False  # a switch adds integers only
    assert Session(make_codec("thc", workers=2), aggregator).uncompressed().codec.name == "bfp"

