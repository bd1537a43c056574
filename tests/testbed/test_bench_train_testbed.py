"""`gradsum bench train --link-rate` trains through every aggregator across a real testbed."""

import json

import pytest

from gradsum.cli import main
from gradsum.testbed import shell
from gradsum.testbed.plan import owned_namespaces

from .conftest import host_interfaces


@pytest.mark.slow
def test_every_aggregator_trains_across_shaped_links_and_nothing_is_left(
    namespaces, tmp_path, monkeypatch
):
    monkeypatch.setenv(shell.STATE_DIR_ENV, str(tmp_path / "state"))
    before = host_interfaces()
    path = tmp_path / "rows.json"
    methods = "allreduce:none,switch:thc,ps:bfp"
    argv = ["bench", "train", "--link-rate", "100mbit", "--methods", methods]
    argv += ["--workers", "2", "--epochs", "1", "--json", str(path)]
    assert main(argv) == 0
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == [f"{m}/wfbp" for m in methods.split(",")]
    for row in rows:
        assert row["link_rate"] == "100mbit"
        assert row["samples_per_s"] > 0
        assert row["test_accuracy"] > 0.5  # one epoch on digits learns a lot
        # a PS row says over how many shards it ran (one per worker by default)
        assert row["shards"] == (2 if row["aggregator"] == "ps" else None)
    assert owned_namespaces(shell.list_namespaces(), "benchtrain") == []
    assert host_interfaces() == before
