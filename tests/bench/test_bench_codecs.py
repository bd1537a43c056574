import json

import pytest

from gradsum.cli import main
from gradsum.codecs import CODEC_NAMES

REQUIRED_KEYS = {
    "codec",
    "nmse",
    "bits_up",
    "bits_down",
    "encode_ms",
    "aggregate_ms",
    "decode_ms",
    "copy_ms",
}


def test_bench_codecs_writes_rows_for_every_codec_and_input(tmp_path, capsys):
    out = tmp_path / "rows.json"
    plot = tmp_path / "rows.png"
    status = main(
        [
            "bench",
            "codecs",
            "--size",
            "2^12",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    assert status == 0
    rows = json.loads(out.read_text())
    assert {r["input"] for r in rows} == {"gaussian", "lognormal", "real"}
    assert len(rows) == 3 * len(CODEC_NAMES)
    assert all(set(r) >= REQUIRED_KEYS for r in rows)
    assert plot.stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "thc" in table and "copy=" in table
    gaussian = {r["codec"]: r for r in rows if r["input"] == "gaussian"}
    assert gaussian["thc"]["bits_up"] == pytest.approx(4.0, abs=0.01)
    assert gaussian["thc"]["bits_down"] == pytest.approx(7.0, abs=0.01)
    for baseline in ("topk", "dgc", "terngrad", "qsgd"):
        assert gaussian["thc"]["nmse"] < gaussian[baseline]["nmse"]
    # powersgd on i.i.d. input: rank-1 of a 64 x 64 view, at most the mean's energy lost
    assert gaussian["powersgd"]["bits_up"] < 2 and gaussian["powersgd"]["nmse"] <= 0.26


def test_real_input_is_gradients_of_a_digits_model():
    from gradsum.bench.inputs import digits_gradients

    first, second = digits_gradients(2, 1 << 20)
    assert first.numel() == 1 << 20
    assert float(first.abs().sum()) > 0
    assert not first.equal(second)  # different batches per worker


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "codecs", "--input", "bogus"], "--input: unknown bogus"),
        (["bench", "codecs", "--codecs", "thc,zip"], "--codecs: unknown zip"),
        (["bench", "codecs", "--size", "lots"], "not a size"),
        (["bench", "codecs", "--workers", "0"], "must be at least 1"),
        (["bench", "codecs", "--options", "thc:bogus=1"], "thc has no option bogus"),
        (["bench", "codecs", "--options", "rotation_block=4"], "expected CODEC:name=value"),
    ],
)
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
