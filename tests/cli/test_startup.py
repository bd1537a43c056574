"""The command line parses without torch: `gradsum --help` and flag errors answer at once, and
the name lists it offers are the ones the heavy modules accept."""

import subprocess
import sys

import pytest

from gradsum.codecs import names
from gradsum.train import config


def test_building_every_command_parser_imports_no_torch():
    probe = (
        "import sys; from gradsum.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'gradsum.codecs.base', 'gradsum.train.models') "
        "if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_light_name_lists_match_what_the_modules_build():
    """Each list the command line offers (codecs/names.py, train/config.py) against what the
    module behind it builds: the registry's codecs, the models' builders and input shapes, the
    data sets that load, the aggregator each name gets."""
    from gradsum.codecs import make_codec, registry
    from gradsum.train import models

    assert tuple(registry._CODECS) == names.CODEC_NAMES
    for name in names.CODEC_NAMES:
        make_codec(name, workers=2)
    assert tuple(models._BUILDERS) == config.MODEL_NAMES
    assert tuple(models.INPUT_SHAPES) == config.MODEL_NAMES
    for name in config.MODEL_NAMES:
        models.input_shape(name)


def test_every_listed_data_set_is_one_the_loader_knows(tmp_path):
    from gradsum.train.data import DataError, load_dataset

    for name in config.DATASET_NAMES:
        try:  # cifar10 needs its files: refused for that, not for the name
            assert load_dataset(name, data_dir=tmp_path, input_shape=(4,)).name == name
        except DataError as error:
            assert not str(error).startswith("unknown dataset"), error
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("no-such-data-set")


def test_every_listed_aggregator_gets_its_own_implementation(monkeypatch):
    """`make_aggregator` with the three implementations replaced by recorders: each listed name
    reaches a different one, whose name is the one listed, and every implementation is reached."""
    from gradsum.codecs import make_codec
    from gradsum.sync import allreduce, service, sharded
    from gradsum.train.aggregators import make_aggregator

    implementations = {
        allreduce: "AllReduceAggregator",
        service: "ServiceAggregator",
        sharded: "ShardedServiceAggregator",
    }
    real = {attr: getattr(module, attr) for module, attr in implementations.items()}
    for module, attr in implementations.items():
        monkeypatch.setattr(module, attr, lambda *args, attr=attr, **options: (attr, args))
    reached = {}
    for name in config.AGGREGATOR_NAMES:
        job = config.TrainConfig(aggregator=name, codec="bfp", switch="127.0.0.1:1",
                                 servers=["127.0.0.1:1"])  # fmt: skip
        attr, args = make_aggregator(job, 0, 1, make_codec("bfp"))
        called = args[0] if attr == "ServiceAggregator" else real[attr].name  # its kind
        assert called == name, (name, attr)
        reached[name] = attr
    assert sorted(reached.values()) == sorted(implementations.values()), reached


def test_codecs_load_on_first_use_and_unknown_names_still_fail():
    import gradsum.codecs as codecs

    assert codecs.make_codec("bfp", workers=2).workers == 2
    assert "make_codec" in dir(codecs)
    with pytest.raises(AttributeError, match="no_such_thing"):
        codecs.no_such_thing  # noqa: B018
