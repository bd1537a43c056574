"""`gradsum bench ate --link-rate`: the pure parts (rates, window, wire model, rows, table, plot)
and the command's argument errors. The run across a real testbed is in
tests/testbed/test_bench_ate_testbed.py."""

import json

import pytest

from gradsum.bench import ate_testbed as at
from gradsum.cli import main

PROFILE = {"encode_seconds": 0.05, "decode_seconds": 0.02, "server_seconds": 0.0,
           "up_bytes": 2_000_000, "down_bytes": 4_000_000}  # fmt: skip


def test_rates_are_parsed_in_order_and_bad_items_are_named():
    assert at.parse_rates("100mbit, 1gbit,10gbit") == [10**8, 10**9, 10**10]
    with pytest.raises(ValueError, match="'1gbps'"):
        at.parse_rates("100mbit,1gbps")
    with pytest.raises(ValueError, match="twice"):
        at.parse_rates("1gbit,1000mbit")
    with pytest.raises(ValueError, match="empty item"):
        at.parse_rates("1gbit,")


def test_the_testbed_has_a_switch_and_a_ps_host_only_when_a_method_needs_them():
    assert at.topology(["gloo"]) == {"switch": False, "ps": 0}
    assert at.topology(["gloo", "switch+thc", "server+topk"]) == {"switch": True, "ps": 1}


def test_the_window_fits_the_link_queue_and_the_aggregator_buffer():
    buffer = 8 << 20
    assert at.default_slots(10**8, 4, buffer) == 4  # 20 ms at 100 Mbit/s: 250 kB + a burst
    assert at.default_slots(10**9, 4, buffer) == buffer // (2 * 4 * at.DATAGRAM_TRUESIZE)
    assert at.default_slots(10**10, 1, 1 << 30) == at.MAX_SLOTS
    assert at.default_slots(10**6, 4, buffer) == 2  # never fewer than two
    # a server's one NIC queues all four workers' windows: a quarter each, at least one
    assert at.default_slots(10**8, 4, buffer, shared=True) == 1
    assert at.default_slots(10**9, 4, 1 << 30, shared=True) == 9  # (2.5 MB + a burst) / 4


def test_wire_time_is_the_busiest_link_a_ps_nic_carries_every_worker():
    switch = at.wire_seconds("switch+thc", PROFILE, 4, 1 << 22, 10**9)
    server = at.wire_seconds("server+thc", PROFILE, 4, 1 << 22, 10**9)
    assert switch == pytest.approx(4_000_000 * 8 / 1e9)
    assert server == pytest.approx(4 * switch)
    gloo = at.wire_seconds("gloo", None, 4, 1 << 22, 10**9)
    assert gloo == pytest.approx(1.5 * (1 << 22) * 4 * 8 / 1e9)


def _rows():
    setup = at.Setup(4, (1 << 22,), ("gloo", "switch+thc"), 5, 1, None)
    rows = []
    for rate, (gloo_s, thc_s) in {10**8: (2.4, 0.5), 10**9: (0.22, 0.2)}.items():
        rows.append(at.make_row("gloo", setup, 1 << 22, rate, gloo_s, None))
        rows.append(at.make_row("switch+thc", setup, 1 << 22, rate, thc_s, PROFILE))
    return rows


def test_rows_carry_the_loopback_fields_the_link_rate_and_the_breakdown():
    gloo, thc = _rows()[:2]
    assert {"method", "workers", "elements", "ate_per_s", "drop_rate", "link_rate"} <= set(thc)
    assert thc["link_rate"] == 10**8 and thc["ate_per_s"] == pytest.approx((1 << 22) / 0.5)
    assert thc["codec_cpu_seconds"] == pytest.approx(0.07)
    assert thc["wire_seconds"] == pytest.approx(0.32)
    assert thc["slots"] == 4 and gloo["slots"] is None
    assert gloo["codec_cpu_seconds"] == 0.0


def test_loss_at_the_aggregator_is_in_the_gradsum_rows_only():
    setup = at.Setup(4, (1 << 22,), ("gloo", "switch+bfp"), 5, 1, None, drop_rate=0.01)
    gloo = at.make_row("gloo", setup, 1 << 22, 10**9, 0.2, None)
    bfp = at.make_row("switch+bfp", setup, 1 << 22, 10**9, 0.15, PROFILE)
    assert (gloo["drop_rate"], bfp["drop_rate"]) == (0.0, 0.01)
    assert "1.00%" in at.loss_note(0.01) and at.loss_note(0.0) == ""


def test_the_table_gives_ratios_to_gloo_at_the_same_rate():
    table = at.format_table(_rows())
    lines = table.splitlines()
    assert "vs gloo" in lines[0] and "codec ms" in lines[0] and "wire ms" in lines[0]
    assert "4.80x" in lines[2] and "100mbit" in lines[2]  # 2.4 s / 0.5 s
    assert "1.10x" in lines[4] and "1gbit" in lines[4]


def test_the_plot_has_one_line_per_method_over_rates(tmp_path):
    series = at.plot_series(_rows(), 1 << 22)
    assert sorted(series) == ["gloo", "switch+thc"]
    assert [rate for rate, _ in series["gloo"]] == [10**8, 10**9]
    path = tmp_path / "ate.png"
    at.write_plot(_rows(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plotting_earlier_rows_writes_the_png_and_the_table(tmp_path, capsys):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(_rows()))
    png = tmp_path / "plot.png"
    assert main(["bench", "ate", "--from-json", str(rows), "--plot", str(png)]) == 0
    assert png.exists() and "4.80x" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--link-rate", "1gbps"], "'1gbps'"),
        (["--plot", "x.png"], "--plot needs --link-rate or --from-json"),
        (["--from-json", "rows.json"], "--from-json needs --plot"),
        (["--link-rate", "1gbit", "--drop-rate", "1.5"], "--drop-rate must be in [0, 1)"),
        (["--link-rate", "1gbit", "--rounds", "3"], "--rounds is for loopback runs"),
        (["--mtu", "500"], "--mtu 500: must be between 576 and 65535"),
        (["--mtu", "1500", "--link-rate", "1gbit"], "--mtu is for loopback runs"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "ate", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_packet_counters_sum_every_worker_and_job():
    stats = [
        {"a/1": {"packets_sent": 10, "retransmissions": 2, "results": 8}},
        {"a/1": {"packets_sent": 9, "retransmissions": 1}, "b/1": {"packets_sent": 1}},
    ]
    assert at.packet_counters(stats) == {"packets_sent": 20, "retransmissions": 3}


def test_injected_drops_are_summed_over_directions_and_pipelines():
    def line(pipeline, dropped_in, dropped_out):
        stats = {"daemon": {"injected_dropped_in": dropped_in, "injected_dropped_out": dropped_out,
                            "received": 10}, "jobs": {}}  # fmt: skip
        return f"gradsum switch pipeline {pipeline}: stopped; statistics {json.dumps(stats)}"

    stderr = "\n".join(["gradsum switch: listening", line(0, 3, 1), line(1, 0, 2)])
    assert at.injected_drops(stderr) == 6
    assert at.injected_drops("") == 0
