import itertools

import numpy as np
import pytest

from gradsum.codecs.thc.tables import clamp_threshold, interval_variance, solve_table, table_error

REFERENCE_TABLE = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)


def test_reproduces_reference_table():
    assert solve_table(4, 30, 1 / 32) == REFERENCE_TABLE


def test_reference_errors_match_the_analysis():
    rounding, clamp = table_error(REFERENCE_TABLE, 1 / 32)
    assert rounding == pytest.approx(0.01307, abs=5e-5)
    assert clamp == pytest.approx(0.00727, abs=5e-5)


@pytest.mark.parametrize(
    ("inverse_p", "threshold"),
    [(16, 1.8627), (32, 2.1539), (64, 2.4176), (128, 2.6601), (256, 2.8856), (1024, 3.2972)],
)
def test_clamp_thresholds(inverse_p, threshold):
    assert clamp_threshold(1 / inverse_p) == pytest.approx(threshold, abs=1e-4)


def _brute_force(bits, granularity, p):
    """Best symmetric table by enumeration (small cases only)."""
    size = 1 << bits
    t = clamp_threshold(p)
    grid = -t + np.arange(granularity + 1) * (2 * t / granularity)
    best, best_cost = None, np.inf
    for inner in itertools.combinations(range(1, granularity), size - 2):
        table = (0, *inner, granularity)
        if any(table[i] + table[size - 1 - i] != granularity for i in range(size)):
            continue
        points = grid[list(table)]
        cost = interval_variance(points[:-1], points[1:]).sum()
        if cost < best_cost - 1e-12:
            best, best_cost = table, cost
    return best


@pytest.mark.parametrize(("bits", "granularity"), [(2, 7), (2, 12), (3, 11), (3, 16), (3, 21)])
def test_dynamic_program_is_optimal(bits, granularity):
    assert solve_table(bits, granularity, 1 / 32) == _brute_force(bits, granularity, 1 / 32)


@pytest.mark.parametrize(
    ("bits", "granularity", "p"), [(1, 5, 0.1), (4, 15, 1 / 16), (8, 600, 1 / 512)]
)
def test_tables_are_symmetric_increasing_and_span_the_grid(bits, granularity, p):
    table = solve_table(bits, granularity, p)
    assert len(table) == 1 << bits
    assert table[0] == 0 and table[-1] == granularity
    assert all(a < b for a, b in itertools.pairwise(table))
    assert all(a + b == granularity for a, b in zip(table, reversed(table), strict=True))


def test_uniform_granularity_gives_identity_table():
    assert solve_table(3, 7, 1 / 32) == tuple(range(8))


@pytest.mark.parametrize(
    ("bits", "granularity", "p"), [(4, 14, 1 / 32), (0, 30, 1 / 32), (4, 30, 0.0)]
)
def test_rejects_impossible_parameters(bits, granularity, p):
    with pytest.raises(ValueError):
        solve_table(bits, granularity, p)
