"""The command line parses without torch: `gradsum --help` and flag errors answer at once, and
the name lists it offers are the ones the heavy modules accept."""

import subprocess
import sys

import pytest

from gradsum.codecs.names import CODEC_NAMES
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
    from gradsum.codecs import make_codec
    from gradsum.train.aggregators import AGGREGATOR_NAMES
    from gradsum.train.data import DATASET_NAMES
    from gradsum.train.models import MODEL_NAMES

    for name in CODEC_NAMES:  # every listed name builds (registry.py also checks the order)
        make_codec(name, workers=2)
    assert MODEL_NAMES == config.MODEL_NAMES
    assert DATASET_NAMES == config.DATASET_NAMES
    assert AGGREGATOR_NAMES == config.AGGREGATOR_NAMES


def test_codecs_load_on_first_use_and_unknown_names_still_fail():
    import gradsum.codecs as codecs

    assert codecs.make_codec("bfp", workers=2).workers == 2
    assert "make_codec" in dir(codecs)
    with pytest.raises(AttributeError, match="no_such_thing"):
        codecs.no_such_thing  # noqa: B018
