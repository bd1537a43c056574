"""`gradsum bench plays`: every schedule's play on a profile, fusion's sweeps among them."""

import itertools
import json

import pytest

from gradsum.bench import plays
from gradsum.cli import main
from gradsum.schedule import AlphaBeta, make_planner, uniform_profile
from gradsum.schedule.calibration import cluster_from_fit
from gradsum.schedule.costs import ps_step_seconds
from gradsum.schedule.grouping import threshold_ladder

# a start-up fit of the gpt model at 1 Gbit/s, 4 workers, 2 shards (docs/scheduling.md)
TESTBED = cluster_from_fit(AlphaBeta(4.6e-3, 1 / 37e6), 4, 2, remote=3, shared_cores=2)


def gpt_shaped(blocks: int, width: int) -> object:
    """A gpt's gradient tensors in backward order (final LayerNorm, then each block's 12
    tensors from its MLP back to its first LayerNorm, then the embeddings), computed at 50 ns
    of backward per parameter and half that forward: the shape of the profiles measured here."""
    block = [width, width, 4 * width * width, width, 4 * width * width, 4 * width,
             width, width, width * width, width, 3 * width * width, 3 * width]  # fmt: skip
    params = [width, width] + block * blocks + [64 * width, 256 * width]
    return uniform_profile(params, [50e-9 * p for p in params], [25e-9 * p for p in params])


def test_the_best_fusion_is_the_fastest_threshold_and_of_equals_the_largest():
    profile = gpt_shaped(4, 64)
    ladder = threshold_ladder(profile.total_params, 2)
    best = plays.best_fusion(profile, TESTBED, ladder, "fusion")
    steps = {
        t: ps_step_seconds(make_planner("fusion", threshold=t)(profile, TESTBED), TESTBED, profile)
        for t in ladder
    }
    fastest = min(steps.values())
    assert best.step_s == pytest.approx(fastest)
    threshold = int(best.schedule.split()[-1].replace(",", ""))
    assert threshold == max(t for t, s in steps.items() if s == fastest)


@pytest.mark.parametrize(("blocks", "width"), [(8, 128), (8, 256)])  # 1.6M and 6.4M parameters
def test_every_role_is_played_and_a_finer_sweep_is_never_slower(blocks, width):
    profile = gpt_shaped(blocks, width)
    rows = plays.plays(profile, TESTBED.with_message_delay(5e-3))
    assert tuple(rows) == plays.ROLES
    assert rows["fusion finest"].step_s <= rows["fusion ×2"].step_s
    assert rows["wfbp"].groups == rows["default"].groups == len(profile.layers)
    # the fit's resolution only ever trades step time for fewer messages
    assert rows["imerge"].messages <= rows["imerge search"].messages
    assert rows["imerge"].step_s <= 1.1 * rows["imerge search"].step_s * (1 + 1e-9)


def test_a_model_is_named_with_its_sizes():
    assert plays.parse_model("gpt(layers=2,width=64)") == ("gpt", {"layers": 2, "width": 64})
    with pytest.raises(ValueError, match="takes no size options"):
        plays.parse_model("resnet18(layers=2)")


def test_the_command_profiles_plays_and_writes_a_row_per_point(tmp_path, capsys):
    out = tmp_path / "plays.json"
    code = main(["bench", "plays", "--models", "gpt(layers=2,width=32,heads=2,context=16),"
                 "digits-cnn", "--fixed-cost", "0.004,3e-8", "--message-delays", "0,0.005",
                 "--batch-size", "4", "--json", str(out)])  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["model"], r["message_delay"]) for r in rows] == [
        ("gpt(layers=2,width=32,heads=2,context=16)", 0.0),
        ("gpt(layers=2,width=32,heads=2,context=16)", 0.005),
        ("digits-cnn", 0.0),
        ("digits-cnn", 0.005),
    ]
    for r in rows:
        assert list(r["plays"]) == list(plays.ROLES)
        assert all(p["step_s"] >= r["forward_s"] + r["backward_s"] for p in r["plays"].values())
    # an injected delay holds every message: no schedule's step gets shorter
    for before, after in zip(rows[::2], rows[1::2], strict=True):
        for role in plays.ROLES:
            assert after["plays"][role]["step_s"] >= before["plays"][role]["step_s"] * 0.999
    printed = capsys.readouterr().out
    assert printed.count("finest fusion / imerge") == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "nosuch"], "--models nosuch: unknown model"),
        (["--models", "gpt(depth=2)"], "--models gpt(depth=2)"),
        (["--models", "digits-cnn", "--message-delays", "-1"], "each in [0, 1) s"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "plays", "--fixed-cost", "0.004,3e-8", *argv])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_the_ladder_runs_from_one_element_to_the_whole_model_in_even_steps():
    coarse, fine = threshold_ladder(3_213_568, 1), threshold_ladder(3_213_568, 4)
    assert coarse[0] == fine[0] == 1 and coarse[-1] == fine[-1] == 3_213_568
    assert set(coarse) <= set(fine)
    assert all(b / a <= 2**0.25 * 1.01 for a, b in itertools.pairwise(fine) if a > 100)
    assert threshold_ladder(1, 4) == [1]
    with pytest.raises(ValueError, match="per_octave"):
        threshold_ladder(10, 0)


def test_baselines_placed_whole_cannot_spread_a_big_group_that_imerge_spreads():
    """One 4M-element layer and two small ones (digits-wide's shape) on 2 shards: placed whole,
    every baseline puts the big layer on one shard, so its link carries it alone; BytePS's
    pieces and imerge's spans share it over both."""
    params = [4_194_304, 150_000, 5_658]
    profile = uniform_profile(params, [2e-9 * p for p in params], [1e-9 * p for p in params])
    whole = plays.plays(profile, TESTBED, placement="whole")
    pieces = plays.plays(profile, TESTBED, placement="pieces")
    assert whole["imerge"] == pieces["imerge"]  # imerge places by its own spans either way
    for role in ("default", "wfbp", "fusion finest"):
        assert whole[role].step_s > 1.5 * pieces[role].step_s
    assert whole["fusion finest"].step_s > 1.5 * whole["imerge"].step_s
    assert pieces["fusion finest"].step_s == pytest.approx(pieces["imerge"].step_s, rel=0.05)
