"""`gradsum bench ate` end to end at a tiny size: table, JSON rows, ratios to Gloo."""

import json
import statistics

import pytest

from gradsum.bench.ate import format_table
from gradsum.cli import main


@pytest.mark.slow
def test_bench_ate_writes_rows_for_every_method(tmp_path, capsys):
    path = tmp_path / "ate.json"
    methods = ["gloo", "switch+bfp", "server+topk"]
    status = main(["bench", "ate", "--workers", "2", "--sizes", "8192", "--steps", "2",
                   "--methods", *methods, "--drop-rate", "0.01", "--rounds", "2",
                   "--json", str(path)])  # fmt: skip
    assert status == 0
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == methods
    for row in rows:
        assert {"method", "workers", "elements", "ate_per_s", "drop_rate"} <= set(row)
        assert row["workers"] == 2 and row["elements"] == 8192 and row["ate_per_s"] > 0
        assert len(row["round_seconds"]) == 2 and row["cpu_ms"] > 0 and row["mtu"] is None
        assert row["seconds"] == statistics.median(row["round_seconds"])
    assert rows[1]["drop_rate"] == 0.01 and rows[0]["drop_rate"] == 0.0
    out = capsys.readouterr().out
    assert "(round 2 of 2)" in out
    table = out[out.index("method ") :]
    assert "1.00x" in table and "switch+bfp" in table and "rounds vs gloo" in table


def _row(method, seconds, cpu=10.0):
    return {"method": method, "workers": 4, "elements": 1000, "seconds": statistics.median(seconds),
            "ate_per_s": 1000 / statistics.median(seconds), "cpu_ms": cpu,
            "round_seconds": seconds}  # fmt: skip


def test_table_gives_cpu_and_the_range_of_per_round_ratios():
    rows = [_row("gloo", [1.0, 2.0, 1.5]), _row("switch+bfp", [0.5, 2.5, 1.0], cpu=None)]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[-5:] == ["CPU", "ms", "rounds", "vs", "gloo"]
    gloo, switch = lines[1].split(), lines[2].split()
    assert gloo[-2:] == ["10.0", "1.00-1.00x"]
    # per round: 1.0/0.5 = 2.0, 2.0/2.5 = 0.8, 1.5/1.0 = 1.5; medians 1.5 vs 1.0 give 1.50x
    assert switch[-3:] == ["1.50x", "-", "0.80-2.00x"]


def test_one_round_has_no_range_column():
    lines = format_table([_row("gloo", [1.0]), _row("switch+bfp", [0.5])]).splitlines()
    assert "rounds" not in lines[0] and lines[2].split()[-2:] == ["2.00x", "10.0"]


def test_a_gloo_worker_that_raises_is_reported_by_rank_and_exception():
    from gradsum.bench.ate import _gloo
    from gradsum.failures import WorkerFailed

    with pytest.raises(WorkerFailed) as caught:
        _gloo(workers=1, elements=-1, steps=1, warmup=0)  # torch refuses a negative size
    assert str(caught.value).startswith(
        "worker 0 failed: RuntimeError: Trying to create tensor with negative dimension -1"
    )
