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
    from gradsum.codecs.thc import native

    assert f"THC's CPU path: {native.path()}" in table  # the path its times depend on
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
        (["bench", "codecs", "--codecs", "thc,zip"], "--codecs zip: unknown codec 'zip'"),
        (["bench", "codecs", "--codecs", "thc(bogus=1)"], "codec 'thc' has no option bogus"),
        (["bench", "codecs", "--codecs", "thc(correlated=maybe)"], "is not true or false"),
        (["bench", "codecs", "--size", "lots"], "not a size"),
        (["bench", "codecs", "--workers", "0"], "must be at least 1"),
        (["bench", "codecs", "--options", "thc:bits=4"], "--codecs 'thc(...)'"),
    ],
)
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_seeds_measure_several_draws_and_pair_each_codec_with_the_first(tmp_path, capsys):
    out = tmp_path / "rows.json"
    codecs = "thc,thc(correlated=true)"
    argv = ["bench", "codecs", "--size", "2^12", "--repeats", "1", "--input", "real",
            "--codecs", codecs, "--seeds", "0-2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert sorted((r["seed"], r["codec"]) for r in rows) == sorted(
        (s, c) for s in range(3) for c in ("thc", "thc(correlated=true)")
    )
    # different draws are different gradients: the NMSE moves between them
    assert len({r["nmse"] for r in rows if r["codec"] == "thc"}) == 3
    assert all(0 < r["norm_spread"] <= 1 for r in rows)
    ratios = [
        next(r["nmse"] for r in rows if r["seed"] == s and r["codec"] == "thc(correlated=true)")
        / next(r["nmse"] for r in rows if r["seed"] == s and r["codec"] == "thc")
        for s in range(3)
    ]
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("thc(correlated=true) ") and "[" in x)
    assert f"{sum(ratios) / 3:.4f}" in line
    assert f"{min(ratios):.3f}" in line and f"{max(ratios):.3f}" in line


def test_seed_summary_is_the_paired_ratio_with_a_t_interval():
    from gradsum.bench.codecs import CodecRow, summarize_seeds

    def row(codec, seed, nmse):
        return CodecRow("real", codec, 4, 16, True, nmse, 4, 7, 1, 1, 1, 1, 1, seed=seed,
                        norm_spread=0.9)  # fmt: skip

    # the baseline's NMSE doubles between draws while the ratio stays near 0.5: pairing keeps
    # the draws' difficulty out of the ratio's interval
    rows = [row("a", 0, 1.0), row("a", 1, 2.0), row("a", 2, 4.0),
            row("b", 0, 0.4), row("b", 1, 1.0), row("b", 2, 2.4)]  # fmt: skip
    a, b = summarize_seeds(rows)
    assert (a.codec, a.ratio_mean, a.ratio_ci95) == ("a", 1.0, 0.0)
    assert b.ratio_mean == pytest.approx(0.5)
    assert (b.ratio_min, b.ratio_max) == (pytest.approx(0.4), pytest.approx(0.6))
    # t(0.975, 2) = 4.303; sd of (0.4, 0.5, 0.6) = 0.1
    assert b.ratio_ci95 == pytest.approx(4.303 * 0.1 / 3**0.5, rel=1e-3)
    assert b.nmse_mean == pytest.approx(3.8 / 3)


@pytest.mark.parametrize("text", ["3", "1,1", "a-b", "0-0"])
def test_seeds_need_two_distinct_draws(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "codecs", "--seeds", text])
    assert exit_info.value.code == 2
    assert "--seeds" in capsys.readouterr().err


def test_the_thc_path_named_is_the_one_that_runs(monkeypatch):
    """A benchmark's header names the path its THC times come from: the torch path where the
    native one is switched off, and the widest native one the kernels run otherwise."""
    from gradsum.codecs.thc import native

    if not native.built():
        assert native.path().startswith("torch")
        return
    kernels = native._kernels
    was_wide, was_v3 = kernels.wide(), kernels.v3()
    try:
        kernels.wide(False)
        kernels.v3(False)
        assert native.path() == "C kernels, portable"
        if kernels.v3(True):
            assert native.path() == "C kernels, eight floats wide (AVX2)"
        if kernels.wide(True):
            assert native.path() == "C kernels, sixteen floats wide (AVX-512)"
        monkeypatch.setenv("GRADSUM_NATIVE", "0")
        assert native.path() == "torch (GRADSUM_NATIVE=0)"
    finally:
        kernels.wide(was_wide)
        kernels.v3(was_v3)
