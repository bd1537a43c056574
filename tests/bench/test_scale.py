"""`gradsum bench scale`: workers simulated in one process through the exact codec round."""

import json
import warnings
from dataclasses import replace

import pytest
import torch

from gradsum.bench.scale import (
    ScaleSetup,
    Stragglers,
    WorkerGradients,
    lm_dataset,
    quorum_size,
    train_simulated,
)
from gradsum.cli import main
from gradsum.train.models import build_model

TINY = ScaleSetup(
    steps=4,
    global_batch=8,
    layers=1,
    width=32,
    heads=2,
    context=16,
    eval_every=2,
    eval_samples=32,
    data_bytes=1 << 16,
)


@pytest.fixture(scope="module")
def dataset():
    return lm_dataset(TINY)


def test_fp32_trains_the_same_model_at_every_worker_count_and_the_loss_falls(dataset):
    """The global batch is fixed: n workers' averaged fp32 gradients are the global batch's, so
    the trajectory is n's only through the order of additions; THC's is its own."""
    two = train_simulated("none", 2, TINY, dataset=dataset)
    four = train_simulated("none", 4, TINY, dataset=dataset, grads="vmap")
    assert two.evals[-1]["val_loss"] < two.evals[0]["val_loss"] - 0.2
    assert abs(two.val_loss - four.val_loss) < 1e-4
    thc = train_simulated("thc", 4, TINY, dataset=dataset)
    assert abs(thc.val_loss - four.val_loss) > 1e-3  # compressed: not fp32's trajectory
    assert thc.bits_up < 8 and four.bits_up == 32


def test_a_scaled_global_batch_gives_each_worker_its_own_sequences(dataset):
    scaled = replace(TINY, per_worker_batch=1)
    assert scaled.batch(2) == 2 and scaled.batch(4) == 4 and TINY.batch(4) == 8
    two = train_simulated("none", 2, scaled, dataset=dataset)
    four = train_simulated("none", 4, scaled, dataset=dataset)
    assert abs(two.val_loss - four.val_loss) > 1e-3  # twice the sequences per step


def test_vmap_and_the_loop_give_every_worker_the_same_gradient(dataset):
    torch.manual_seed(0)
    model = build_model("gpt", 256, layers=1, width=32, heads=2, context=16)
    inputs = dataset.train.inputs[:8].view(4, 2, -1)
    labels = dataset.train.labels[:8].view(4, 2, -1)
    with warnings.catch_warnings():  # vmap's fallback for CPU attention
        warnings.simplefilter("ignore")
        vectorised, loss_v = WorkerGradients(model, "vmap")(inputs, labels)
    looped, loss_l = WorkerGradients(model, "loop")(inputs, labels)
    assert abs(loss_v - loss_l) < 1e-5
    for a, b in zip(vectorised, looped, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert not torch.allclose(vectorised[0], vectorised[1])  # each worker's own batch


def test_the_straggler_model_ends_a_round_at_the_kth_arrival():
    model = Stragglers(10, delay=0.2, seed=3)
    chosen, ends = model.round(step=5, quorum=7)
    assert len(chosen) == 7 and chosen == sorted(set(chosen))
    full, full_ends = model.round(step=5, quorum=10)
    assert full == list(range(10)) and ends < full_ends  # the 3 slowest were left out
    assert model.round(step=5, quorum=7) == (chosen, ends)  # seeded
    assert model.round(step=6, quorum=7)[0] != chosen or model.round(step=7, quorum=7)[0] != chosen
    assert Stragglers(4, delay=0.0, seed=0).round(1, 2)[1] == 1.0
    assert [quorum_size(10, q) for q in (1.0, 0.9, 0.8, 0.7)] == [10, 9, 8, 7]


def test_a_quorum_run_aggregates_fewer_workers_in_less_modelled_time(dataset):
    full = train_simulated("thc", 4, TINY, dataset=dataset)
    partial = train_simulated("thc", 4, TINY, quorum=3, dataset=dataset)
    assert partial.quorum == 3 and partial.modelled_time < full.modelled_time
    assert partial.val_loss != full.val_loss


def test_the_command_writes_rows_as_it_goes_and_keeps_them_on_the_next_run(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    flags = [
        "bench",
        "scale",
        "--workers",
        "1,2",
        "--methods",
        "none,thc",
        "--steps",
        "2",
        "--global-batch",
        "4",
        "--layers",
        "1",
        "--width",
        "16",
        "--heads",
        "2",
        "--context",
        "8",
        "--eval-every",
        "2",
        "--eval-samples",
        "8",
        "--data-bytes",
        "16384",
        "--json",
        str(rows),
        "--plot",
        str(tmp_path / "g.png"),
    ]
    assert main(flags) == 0
    written = json.loads(rows.read_text())
    assert [(r["method"], r["workers"]) for r in written] == [
        ("none", 1),
        ("thc", 1),
        ("none", 2),
        ("thc", 2),
    ]
    assert (tmp_path / "g.png").stat().st_size > 0
    assert main(flags) == 0
    assert capsys.readouterr().out.count("kept from") == 4
    with pytest.raises(SystemExit) as usage:  # 3 does not divide the global batch
        main([*flags[:-4], "--workers", "3"])
    assert usage.value.code == 2
    assert "--workers 3: must divide --global-batch 4" in capsys.readouterr().err


def test_a_row_that_fails_is_named_and_the_others_are_written(tmp_path, capsys, monkeypatch):
    from gradsum.bench import scale

    real = scale.train_simulated

    def failing_for_thc(method, *args, **kwargs):
        if method == "thc":
            raise FloatingPointError("gradient turned non-finite")
        return real(method, *args, **kwargs)

    monkeypatch.setattr(scale, "train_simulated", failing_for_thc)
    rows = tmp_path / "rows.json"
    flags = ["bench", "scale", "--workers", "1,2", "--methods", "thc,none", "--steps", "2",
             "--global-batch", "4", "--layers", "1", "--width", "16", "--heads", "2",
             "--context", "8", "--eval-every", "2", "--eval-samples", "8",
             "--data-bytes", "16384", "--json", str(rows)]  # fmt: skip
    assert main(flags) == 1
    written = json.loads(rows.read_text())
    assert [(r["method"], r["workers"]) for r in written] == [("none", 1), ("none", 2)]
    err = capsys.readouterr().err
    assert "failed: thc n=1 quorum=1: FloatingPointError: gradient turned non-finite" in err
    assert "failed: thc n=2 quorum=2: FloatingPointError" in err


def test_methods_take_codec_options_and_rows_of_two_seeds_pair_by_seed(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    flags = ["bench", "scale", "--workers", "2", "--methods",
             "none,thc(error_feedback=true,feedback_bound=inf,bits=4)", "--steps", "2",
             "--global-batch", "4",
             "--layers", "1", "--width", "16", "--heads", "2", "--context", "8",
             "--eval-every", "2", "--eval-samples", "8", "--data-bytes", "16384",
             "--json", str(rows)]  # fmt: skip
    assert main([*flags, "--seed", "0"]) == 0
    assert main([*flags, "--seed", "1"]) == 0
    written = json.loads(rows.read_text())
    assert [(r["method"], r["setup"]["seed"]) for r in written] == [
        ("none", 0), ("thc(error_feedback=true,feedback_bound=inf,bits=4)", 0),
        ("none", 1), ("thc(error_feedback=true,feedback_bound=inf,bits=4)", 1),
    ]  # fmt: skip
    from gradsum.bench.scale import ScaleRow, format_table, gap

    parsed = [ScaleRow(**r) for r in written]
    fp32 = [written[2 * (i // 2)]["val_loss"] for i in range(4)]  # the same seed's none
    expected = [r["val_loss"] / base - 1 for r, base in zip(written, fp32, strict=True)]
    assert [gap(r, parsed) for r in parsed] == pytest.approx(expected)
    table = capsys.readouterr().out.splitlines()
    assert table[-1].split()[:2] == ["thc(error_feedback=true,feedback_bound=inf,bits=4)", "1"]
    assert format_table(parsed).splitlines()[-2].split()[:2] == ["none", "1"]
    with pytest.raises(SystemExit) as usage:
        main([*flags[:5], "thc(nonsense=1)", *flags[6:]])
    assert usage.value.code == 2
    assert "has no option nonsense" in capsys.readouterr().err


def test_powersgd_factors_each_weight_matrix_as_in_training(dataset):
    """The simulated round describes the model's tensors as training's senders do, so PowerSGD
    sends each weight matrix's rank-r factors and the rest whole: the bits a coordinate that
    `bench tta` counts for the same model, not those of one square view of the buffer."""
    from gradsum.bench import tta
    from gradsum.train.config import TrainConfig

    row = train_simulated("powersgd(rank=2)", 4, replace(TINY, steps=2), dataset=dataset)
    config = TrainConfig(model="gpt", layers=1, width=32, heads=2, context=16, workers=4,
                         aggregator="switch", codec="powersgd", codec_options="rank=2")  # fmt: skip
    parameters = sum(p.numel() for p in build_model("gpt", 256, layers=1, width=32, heads=2,
                                                    context=16).parameters())  # fmt: skip
    assert row.bits_up * parameters / 8 == pytest.approx(tta.bytes_per_step(config), rel=0.01)
