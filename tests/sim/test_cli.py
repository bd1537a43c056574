import json

import pytest

from gradsum.cli import main


def test_simulate_prints_tables_and_writes_json_and_png(tmp_path, capsys):
    rows_path, plot_path = tmp_path / "rows.json", tmp_path / "speedup.png"
    status = main(
        [
            "simulate",
            "--model",
            "digits-mlp",
            "--workers",
            "1,2",
            "--policies",
            "default,wfbp,imerge",
            "--json",
            str(rows_path),
            "--plot",
            str(plot_path),
            "--quiet",
        ]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "throughput" in out and "speedup" in out
    rows = json.loads(rows_path.read_text())
    assert len(rows) == 2 * 3
    assert {"model", "workers", "policy", "throughput", "speedup"} <= set(rows[0])
    assert plot_path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--policies", "wfbp,fastest"], "--policies"),
        (["--workers", "0,2"], "--workers"),
        (["--workers", "two"], "--workers"),
        (["--model", "lenet"], "--model"),
        (["--preset", "tofino"], "--preset"),
        (["--plot", "out.pdf"], "--plot"),
        (["--iterations", "2"], "--iterations"),
    ],
)
def test_bad_flags_are_usage_errors_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "digits-mlp", "--quiet", *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
