"""`gradsum bench ate --link-rate` across a real testbed: rows with their link rate, and the
testbed removed afterwards, also when a measurement fails midway."""

import json

import pytest

from gradsum.bench import ate_testbed
from gradsum.cli import main
from gradsum.testbed import shell
from gradsum.testbed.plan import owned_namespaces

from .conftest import host_interfaces


@pytest.fixture
def clean_host(namespaces, tmp_path, monkeypatch):
    """The host's links and qdiscs before; afterwards no namespace of testbed ``bench<n>``."""
    monkeypatch.setenv(shell.STATE_DIR_ENV, str(tmp_path / "state"))
    before = host_interfaces()
    yield
    assert owned_namespaces(shell.list_namespaces(), "benchate") == []
    assert host_interfaces() == before


@pytest.mark.slow
def test_rows_for_gloo_and_the_switch_at_the_link_rate_and_nothing_left(clean_host, tmp_path,
                                                                        capsys):  # fmt: skip
    path = tmp_path / "rows.json"
    status = main(["bench", "ate", "--link-rate", "100mbit", "--workers", "2", "--sizes", "2^16",
                   "--methods", "gloo", "switch+bfp", "--steps", "2", "--testbed-id", "benchate",
                   "--json", str(path)])  # fmt: skip
    assert status == 0
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == ["gloo", "switch+bfp"]
    for row in rows:
        assert row["link_rate"] == 10**8 and row["workers"] == 2 and row["elements"] == 1 << 16
        assert row["ate_per_s"] > 0 and row["wire_seconds"] > 0
        # 2^16 float32 cannot cross a 100 Mbit/s link faster than its wire time
        assert row["seconds"] > 0.5 * row["wire_seconds"]
    assert rows[1]["codec_cpu_seconds"] > 0 and rows[1]["up_bytes"] >= 4 << 16
    assert rows[1]["injected_drops"] == 0
    table = capsys.readouterr().out
    assert "1.00x" in table and "100mbit" in table


@pytest.mark.slow
def test_a_failure_midway_still_removes_the_testbed(clean_host, monkeypatch):
    def broken(tb, method, elements, setup, rate):
        assert owned_namespaces(shell.list_namespaces(), "benchate")  # the testbed is up
        raise RuntimeError("a worker died")

    monkeypatch.setattr(ate_testbed, "measure_method", broken)
    with pytest.raises(RuntimeError, match="a worker died"):
        main(["bench", "ate", "--link-rate", "1gbit", "--workers", "2", "--methods", "gloo",
              "--testbed-id", "benchate"])  # fmt: skip


@pytest.mark.slow
def test_loss_at_the_testbed_switch_is_injected_and_recorded(clean_host, tmp_path):
    path = tmp_path / "rows.json"
    status = main(["bench", "ate", "--link-rate", "1gbit", "--workers", "2", "--sizes", "2^16",
                   "--methods", "switch+bfp", "--steps", "2", "--drop-rate", "0.05",
                   "--testbed-id", "benchate", "--json", str(path)])  # fmt: skip
    assert status == 0
    (row,) = json.loads(path.read_text())
    assert row["drop_rate"] == 0.05
    assert row["injected_drops"] > 0  # the switch dropped packets, and the run still finished
