"""Correlated rounding (Suresh et al., ICML 2022) as an option of THC and uniform THC: each
worker's rounding stays unbiased on the same wire, and the workers' errors partly cancel."""

import pytest
import torch

from gradsum.codecs import CodecContext, make_codec, nmse, run_round
from gradsum.codecs.thc.tables import clamp_threshold, correlated_clamp

from .conftest import gaussian_inputs


def test_stratified_draws_are_uniform_and_take_distinct_strata():
    workers, count = 4, 1 << 16
    draws = torch.stack([CodecContext(seed=3, worker=w, step=2, partition=9)
                         .stratified_uniform(count, workers) for w in range(workers)])  # fmt: skip
    strata = (draws * workers).floor()
    assert torch.equal(strata.sort(dim=0).values, torch.arange(4.0)[:, None].expand(4, count))
    for w in range(workers):  # each worker's draws alone are U[0, 1)
        counts = torch.histc(draws[w], bins=10, min=0, max=1)
        assert bool(((counts / count - 0.1).abs() < 0.006).all())
        assert float(draws[w].max()) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
def test_correlated_rounding_is_unbiased(name):
    """The average of many independent rounds converges to the workers' mean: its error
    shrinks like 1 / trials (seeded; nothing clamped, so the estimate has no bias at all)."""
    trials, workers = 200, 4
    inputs = gaussian_inputs(workers, 512, seed=8)
    codec = make_codec(name, workers=workers, error_feedback=False, correlated=True, p=1e-9)
    total, single = torch.zeros(512, dtype=torch.float64), 0.0
    for step in range(trials):
        estimate = run_round(codec, inputs, step=step).average
        total += estimate
        single += nmse(estimate, inputs) / trials
    assert nmse((total / trials).float(), inputs) < 2.0 * single / trials
    assert single > 0


def test_correlated_thc_at_4_workers_4_bits_beats_thc_on_gaussian_input():
    inputs = gaussian_inputs(4, 1 << 18, seed=1)
    thc = nmse(run_round(make_codec("thc", workers=4, error_feedback=False), inputs).average,
               inputs)  # fmt: skip
    codec = make_codec("thc", workers=4, error_feedback=False, correlated=True)
    correlated = nmse(run_round(codec, inputs).average, inputs)
    assert correlated <= 0.0032
    assert correlated <= 0.62 * thc
    # the same wire: 4 bits up, and the downstream width of THC's 30 grid steps
    assert codec.lane_widths() == make_codec("thc", workers=4).lane_widths() == (4, 7)


def test_the_clamp_is_re_solved_for_correlated_rounding():
    t = clamp_threshold(correlated_clamp(4, 31, 4))
    assert 2.3 <= t <= 2.7  # out from independent rounding's 2.15: less rounding error to trade
    assert make_codec("thc", workers=4, correlated=True).inner.p == correlated_clamp(4, 31, 4)


@pytest.mark.slow
def test_correlated_thc_on_real_gradients():
    from gradsum.bench.inputs import make_inputs

    ratios = []
    for seed in (0, 1, 2):
        inputs = make_inputs("real", 4, 1 << 20, seed)
        thc = make_codec("thc", workers=4, error_feedback=False)
        codec = make_codec("thc", workers=4, error_feedback=False, correlated=True)
        ratios.append(nmse(run_round(codec, inputs).average, inputs)
                      / nmse(run_round(thc, inputs).average, inputs))  # fmt: skip
    # bench codecs' seed 0 gives 0.62x, seeds 1 and 2 0.60x and 0.54x (docs/benchmarks.md)
    assert sum(ratios) / len(ratios) <= 0.62 and max(ratios) <= 0.65, ratios
