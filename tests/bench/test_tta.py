"""`gradsum bench tta`: method names, the flags a testbed job gets, bytes per step, and the
table, JSON and plot from runs' summaries."""

import json

import pytest
import torch

from gradsum.bench import tta
from gradsum.bench.train_testbed import train_flags
from gradsum.cli import UsageError, build_parser, main
from gradsum.train.config import TrainConfig
from gradsum.train.methods import method_fields, method_name, parse_methods
from gradsum.train.models import build_model
from gradsum.train.peers import wire_bytes_per_step


@pytest.mark.parametrize(
    "name", ["ddp", "ddp:fp16", "ddp:bf16", "ddp:powersgd2", "ddp:powersgd4", "switch:thc",
             "allreduce:none", "ps:topk", "switch:thc(correlated=true,bits=4)"],
)  # fmt: skip
def test_method_names_round_trip_through_the_config(name):
    assert method_name(TrainConfig(**method_fields(name))) == name


@pytest.mark.parametrize(
    ("name", "complaint"),
    [("ddp:powersgd", "ddp:powersgdR"), ("ddp:fp8", "ddp:powersgdR"),
     ("switch:topk", "cannot run on the switch"), ("thc", "not AGGREGATOR:CODEC"),
     ("switch:thc(colour=red)", "has no option colour"),
     ("switch:thc(bits=4", "AGGREGATOR:CODEC\\("),
     ("ddp:fp16(bits=4)", "AGGREGATOR:CODEC\\(")],
)  # fmt: skip
def test_unknown_methods_are_refused_naming_what_would_work(name, complaint):
    with pytest.raises(UsageError, match=complaint):
        method_fields(name)


def test_methods_split_at_commas_outside_a_codecs_options():
    methods = parse_methods("ddp, switch:thc(correlated=true,bits=4),ps:topk(ratio=0.01)")
    assert [name for name, _ in methods] == ["ddp", "switch:thc(correlated=true,bits=4)",
                                             "ps:topk(ratio=0.01)"]  # fmt: skip
    assert methods[1][1] == {"aggregator": "switch", "codec": "thc",
                             "codec_options": "correlated=true,bits=4"}  # fmt: skip
    for unbalanced in ("ddp,switch:thc(bits=4", "switch:thc)bits=4("):
        with pytest.raises(UsageError, match="without its"):
            parse_methods(unbalanced)


@pytest.mark.parametrize(
    "method", ["ddp:powersgd4", "switch:thc(correlated=true,bits=4)", "ps:topk(ratio=0.01)"]
)
def test_a_testbed_job_gets_every_workload_flag_back(method):
    """The flags a testbed's `gradsum train` gets rebuild the bench's configuration, less what
    does not apply to the method (a codec under DDP, a window on DDP's links)."""
    from gradsum.cli import UsageError
    from gradsum.train.cli import job_config

    config = TrainConfig(model="gpt", dataset="stdlib", batch_size=2, optimizer="adamw",
                         context=64, data_bytes=10_000, time_budget=30.0, eval_every=5,
                         eval_seconds=2.5, eval_samples=8, fallback="none", lr=3e-4, seed=3,
                         layers=2, width=64, heads=2, fusion_elements=12345, uncompressed_steps=2,
                         window_bytes=262144, fixed_cost=(1e-3, 3.3e-8),
                         **method_fields(method))  # fmt: skip
    flags = train_flags(config)
    assert "--codec" not in flags if config.aggregator == "ddp" else "--ddp-hook" not in flags
    args = build_parser().parse_args(["train", "--aggregator", config.aggregator, *flags])
    try:
        rebuilt = job_config(args)
    except UsageError as error:
        raise AssertionError(f"{flags}: {error}") from None
    assert flags[-2:] == ["--device", "cpu"]  # always: a worker given none takes cuda if any
    expected = dict(config.__dict__)
    if config.aggregator == "ddp":  # the codec and the window do not apply: train's defaults
        expected.update(codec="thc", codec_options="", window_bytes=None, message_delay=0.0)
    assert rebuilt.__dict__ == expected


def test_bytes_per_step_of_the_ddp_hooks_follow_the_tensor_shapes():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 2))
    sizes = {kind: wire_bytes_per_step(TrainConfig(ddp_hook=kind, powersgd_rank=2), model)
             for kind in ("allreduce", "fp16", "powersgd")}  # fmt: skip
    count = 64 * 32 + 32 + 32 * 2 + 2
    assert sizes["allreduce"] == 4 * count and sizes["fp16"] == 2 * count
    # 32x64 is factored (rank 2: P 32x2 and Q 64x2); 2x32 would not save half: sent whole
    assert sizes["powersgd"] == 4 * 2 * (32 + 64) + 4 * 32 + 4 * (2 * 32) + 4 * 2


def test_bytes_per_step_of_a_gradsum_codec_come_from_its_round():
    config = TrainConfig(model="gpt", layers=1, width=32, heads=2, context=16, workers=4)
    fp32 = tta.bytes_per_step(TrainConfig(**{**config.__dict__, "codec": "none"}))
    thc = tta.bytes_per_step(TrainConfig(**{**config.__dict__, "codec": "thc"}))
    # embeddings 256x32 and 16x32, one block (LayerNorms, qkv, proj, MLP), the final LayerNorm
    parameters = 256 * 32 + 16 * 32 + (4 * 32 + 32 * 96 + 96 + 32 * 32 + 32)
    parameters += 32 * 128 + 128 + 128 * 32 + 32 + 2 * 32
    assert fp32 == 4 * parameters
    assert 0.11 < thc / fp32 < 0.2  # 4 bits of 32, padded to a power of two, plus ‖x‖


@pytest.mark.parametrize(
    "sizes",
    [dict(layers=2, width=64, heads=2, context=16), dict(layers=4, width=256, heads=4, context=64)],
    ids=["gpt 2x64", "gpt 4x256, 3.2M parameters"],
)  # fmt: skip
def test_gradsum_powersgd_sends_per_tensor_what_torchs_hook_sends(sizes):
    """Both factor each weight matrix at rank r and send the rest whole: the same numbers of
    coordinates, 4 bytes each (torch in fp32, gradsum in int32 lanes, plus one shared exponent
    per block). Counted over the flat gradient viewed as one near-square matrix, gradsum's was
    a third of torch's on the 3.2M-parameter gpt."""
    config = TrainConfig(model="gpt", workers=4, **sizes)
    model = build_model("gpt", 256, **sizes)
    for rank in (2, 4):
        torch_hook = wire_bytes_per_step(
            TrainConfig(**{**config.__dict__, "aggregator": "ddp", "ddp_hook": "powersgd",
                           "powersgd_rank": rank}), model)  # fmt: skip
        gradsum = tta.bytes_per_step(TrainConfig(**{**config.__dict__, "aggregator": "switch",
                                                    "codec": "powersgd",
                                                    "codec_options": f"rank={rank}"}))  # fmt: skip
        assert torch_hook <= gradsum <= 1.1 * torch_hook


def _summary(seconds_per_step, losses, compute=0.5):
    evals = [{"step": 10 * i, "seconds": 10 * i * seconds_per_step, "val_loss": loss,
              "val_accuracy": 0.0} for i, loss in enumerate(losses)]  # fmt: skip
    return {"evals": evals, "steps": evals[-1]["step"], "train_seconds": evals[-1]["seconds"],
            "step_s": seconds_per_step, "compute_s": compute, "val_loss": losses[-1],
            "bits_per_byte": losses[-1] / 0.693, "fallbacks": 0}  # fmt: skip


def test_the_run_tabulates_writes_and_plots_each_method(tmp_path, monkeypatch, capsys):
    outcomes = {
        "ddp": _summary(2.0, [5.5, 4.0, 3.5, 3.2]),
        "switch:thc": _summary(1.0, [5.5, 4.1, 3.5, 3.3, 3.1, 3.0, 2.9]),
        "ddp:fp16": RuntimeError("no route to host"),
    }

    def fake(args, config):
        outcome = outcomes[method_name(config)]
        if isinstance(outcome, Exception):
            return tta.Failure.of(outcome)
        return outcome

    monkeypatch.setattr(tta, "_outcome", fake)
    path, png = tmp_path / "rows.json", tmp_path / "tta.png"
    status = main(["bench", "tta", "--methods", "ddp,switch:thc,ddp:fp16", "--layers", "1",
                   "--width", "32", "--heads", "2", "--context", "16", "--target-loss", "3.5",
                   "--json", str(path), "--plot", str(png)])  # fmt: skip
    assert status == 1  # a row failed
    out = capsys.readouterr().out
    assert "communication-to-compute ratio 3.00" in out  # (2.0 - 0.5) / 0.5
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == ["ddp", "switch:thc", "ddp:fp16"]
    assert rows[0]["time_to_target"] == 40.0 and rows[1]["time_to_target"] == 20.0
    assert rows[2]["error"]["message"] == "no route to host"
    table = out[out.index("method ") :]
    thc_line = next(line for line in table.splitlines() if line.startswith("switch:thc"))
    assert "2.00x" in thc_line  # 40 s / 20 s
    assert "+3.1%" in thc_line  # at the last step both evaluated (30): 3.3 / 3.2
    assert png.stat().st_size > 10_000
    # re-tabulated with another target: the baseline never reached 3.0, THC did after 50 s
    assert main(["bench", "tta", "--from-json", str(path), "--target-loss", "3.0"]) == 0
    again = capsys.readouterr().out
    assert (
        next(line for line in again.splitlines() if line.startswith("switch:thc")).split()[1]
        == "50.0"
    )


def test_several_seeds_compare_each_run_with_its_seeds_baseline_and_take_medians(
    tmp_path, monkeypatch, capsys
):
    # seed -> method -> (seconds per step, losses every 10 steps)
    curves = {
        0: {"ddp": (2.0, [5.5, 4.0, 3.5, 3.2]), "switch:thc": (1.0, [5.5, 4.2, 3.6, 3.3, 3.1])},
        1: {"ddp": (2.0, [5.5, 4.0, 3.4, 3.3]), "switch:thc": (1.0, [5.5, 4.0, 3.4, 3.2, 3.1])},
        2: {"ddp": (2.0, [5.5, 3.9, 3.6, 3.2]), "switch:thc": (1.0, [5.5, 4.3, 3.7, 3.6, 3.5])},
    }
    seen = []

    def fake(args, config):
        seen.append((config.seed, method_name(config)))
        return _summary(*curves[config.seed][seen[-1][1]])

    monkeypatch.setattr(tta, "_outcome", fake)
    path, png = tmp_path / "rows.json", tmp_path / "tta.png"
    assert main(["bench", "tta", "--methods", "ddp,switch:thc", "--seeds", "0,1,2",
                 "--layers", "1", "--width", "32", "--heads", "2", "--context", "16",
                 "--target-loss", "3.5", "--json", str(path), "--plot", str(png)]) == 0  # fmt: skip
    assert seen == [(0, "ddp"), (0, "switch:thc"), (1, "ddp"), (1, "switch:thc"),
                    (2, "ddp"), (2, "switch:thc")]  # fmt: skip
    rows = json.loads(path.read_text())
    assert [(r["seed"], r["time_to_target"]) for r in rows] == [
        (0, 40.0), (0, 30.0), (1, 40.0), (1, 20.0), (2, 60.0), (2, 40.0)]  # fmt: skip
    out = capsys.readouterr().out
    lines = out.splitlines()
    # each run against its own seed's baseline: seed 1, 40 / 20 s; at step 30, 3.2 / 3.3
    seed1 = next(line for line in lines if line.startswith("switch:thc seed 1"))
    assert "2.00x" in seed1 and "-3.0%" in seed1
    medians = lines[next(i for i, line in enumerate(lines) if line.startswith("medians")) :]
    thc = next(line for line in medians if line.startswith("switch:thc")).split()
    # medians: ddp 40 s, thc 30 s -> 1.33x; per seed 40/30, 40/20, 60/40 -> paired 1.50x;
    # gaps +3.1 %, -3.0 %, +12.5 % -> median +3.1 %
    assert thc[1:5] == ["30.0", "1.33x", "1.50x", "+3.1%"] and thc[5] == "-3.0..+12.5%"
    assert thc[6] == "3/3"
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        main(["bench", "tta", "--seeds", "1,1", "--max-steps", "2"])
