"""`gradsum bench ate` end to end at a tiny size: table, JSON rows, ratios to Gloo."""

import json

import pytest

from gradsum.cli import main


@pytest.mark.slow
def test_bench_ate_writes_rows_for_every_method(tmp_path, capsys):
    path = tmp_path / "ate.json"
    methods = ["gloo", "switch+bfp", "server+topk"]
    status = main(["bench", "ate", "--workers", "2", "--sizes", "8192", "--steps", "2",
                   "--methods", *methods, "--drop-rate", "0.01", "--json", str(path)])  # fmt: skip
    assert status == 0
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == methods
    for row in rows:
        assert {"method", "workers", "elements", "ate_per_s", "drop_rate"} <= set(row)
        assert row["workers"] == 2 and row["elements"] == 8192 and row["ate_per_s"] > 0
    assert rows[1]["drop_rate"] == 0.01 and rows[0]["drop_rate"] == 0.0
    table = capsys.readouterr().out
    assert "1.00x" in table and "switch+bfp" in table


def test_bench_ate_rejects_a_bad_drop_rate(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "ate", "--drop-rate", "1.0"])
    assert exit_info.value.code == 2
    assert "--drop-rate must be in [0, 1)" in capsys.readouterr().err
