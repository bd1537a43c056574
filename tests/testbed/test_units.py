"""Parsing and printing of rates, durations and loss."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradsum.testbed.units import (
    format_duration,
    format_loss,
    format_rate,
    parse_duration,
    parse_loss,
    parse_rate,
)


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("10gbit", 10_000_000_000),
        ("1.5gbit", 1_500_000_000),
        ("500kbit", 500_000),
        ("64000bit", 64_000),
        (" 1GBIT ", 1_000_000_000),
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "1gb", "-1gbit", "1 gbit/s", "100"])
def test_parse_rate_rejects_garbage_and_names_it(text):
    with pytest.raises(ValueError, match="not a link rate"):
        parse_rate(text)


def test_parse_rate_explains_bytes_per_second():
    with pytest.raises(ValueError, match="bytes/s"):
        parse_rate("100mbps")


def test_parse_rate_rejects_rates_too_slow_for_a_packet():
    with pytest.raises(ValueError, match="below 8kbit"):
        parse_rate("1kbit")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0", 0.0), ("5ms", 0.005), ("200us", 2e-4), ("1s", 1.0), ("1.5ms", 0.0015)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "ms", "5 min", "-1ms"])
def test_parse_duration_rejects_missing_or_unknown_units(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "fraction"), [("0", 0.0), ("1%", 0.01), ("0.1%", 0.001)])
def test_parse_loss(text, fraction):
    assert parse_loss(text) == pytest.approx(fraction)


@pytest.mark.parametrize("text", ["0.01", "1", "abc%"])
def test_parse_loss_wants_a_percentage(text):
    with pytest.raises(ValueError, match="percentage"):
        parse_loss(text)


def test_parse_loss_rejects_total_loss():
    with pytest.raises(ValueError, match="below 100%"):
        parse_loss("100%")


@given(st.integers(min_value=8_000, max_value=10**13))
def test_format_rate_round_trips(bits):
    assert parse_rate(format_rate(bits)) == bits


def test_format_rate_uses_the_largest_exact_unit():
    assert [format_rate(r) for r in (10**9, 100 * 10**6, 1_500_000, 12_345)] == [
        "1gbit",
        "100mbit",
        "1500kbit",
        "12345bit",
    ]


def test_format_duration_and_loss_are_tc_spellings():
    assert format_duration(0.005) == "5000us"
    assert format_loss(0.01) == "1%"
    assert format_loss(0.00125) == "0.125%"
