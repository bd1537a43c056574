"""`gradsum bench ps-core`: the fit reads a PS core's cost back from known rounds, and the real
two processes (Gloo send/recv on loopback) produce a row per size."""

import pytest

from gradsum.bench.ps_core import CoreRow, fit_core, measure


def rounds_of(senders, alpha, rate, worker_alpha, sizes=(256, 16_384, 262_144)):
    """Rows as a PS with cost α + bytes/rate per message would give: a round is 2k messages."""
    rows = []
    for elements in sizes:
        nbytes = elements * 4
        ps = 2 * senders * (alpha + nbytes / rate)
        rows.append(CoreRow(senders, elements, 10, ps * 1.5, 0.1, ps, 2 * senders * worker_alpha))
    return rows


def test_the_fit_reads_alpha_and_rate_back_per_sender_count():
    rows = rounds_of(1, 50e-6, 4e9, 20e-6) + rounds_of(32, 80e-6, 2e9, 30e-6)
    one, many = fit_core(rows)
    assert (one.senders, many.senders) == (1, 32)
    assert one.ps_alpha_s == pytest.approx(50e-6)
    assert one.ps_rate == pytest.approx(4e9)
    assert many.ps_alpha_s == pytest.approx(80e-6)
    assert many.ps_rate == pytest.approx(2e9)
    assert many.worker_alpha_s == pytest.approx(30e-6)
    # the wall-clock line is the CPU line × 1.5 here: α × 1.5, rate / 1.5
    assert many.wall_alpha_s == pytest.approx(120e-6)
    assert many.wall_rate == pytest.approx(2e9 / 1.5)


def test_time_not_growing_with_size_is_an_infinite_rate_not_a_negative_one():
    rows = [CoreRow(4, e, 10, 1e-3, 0.1, t, 1e-4) for e, t in ((256, 2e-3), (262_144, 1e-3))]
    (fit,) = fit_core(rows)
    assert fit.ps_rate == float("inf")
    assert fit.ps_alpha_s > 0


@pytest.mark.slow
def test_two_senders_through_gloo_give_a_row_per_size():
    rows = measure(2, [64, 4096], rounds=3, warmup=1, port=29_741, timeout_s=60)
    assert [(r.senders, r.elements) for r in rows] == [(2, 64), (2, 4096)]
    assert all(r.wall_s > 0 and r.ps_cpu_s > 0 and r.sender_cpu_s > 0 for r in rows)
