"""The executor's checks and messages, state files and the CLI's flag handling (no root needed)."""

import os
import subprocess
import sys

import pytest

from gradsum.cli import build_parser, main
from gradsum.testbed import shell
from gradsum.testbed.cli import describe, report_text
from gradsum.testbed.plan import TestbedSpec
from gradsum.testbed.shell import TestbedError, explain_failure, preflight


def test_preflight_refuses_non_root():
    with pytest.raises(TestbedError, match="needs root"):
        preflight(euid=1000, which=lambda tool: f"/usr/sbin/{tool}")


@pytest.mark.parametrize("missing", ["ip", "tc", "sysctl"])
def test_preflight_names_the_missing_tool_and_the_package(missing):
    def which(tool):
        return None if tool == missing else f"/usr/sbin/{tool}"

    hint = "apt-get install -y iproute2 procps"
    with pytest.raises(TestbedError, match=f"'{missing}' not found.*{hint}"):
        preflight(euid=0, which=which)


def test_preflight_passes_for_root_with_tools():
    preflight(euid=0, which=lambda tool: f"/usr/sbin/{tool}")


def test_run_command_names_a_missing_program():
    with pytest.raises(TestbedError, match="'no-such-program-x' not found"):
        shell.run_command(("no-such-program-x", "arg"))


def test_run_command_reports_command_exit_and_stderr():
    with pytest.raises(
        TestbedError, match=r"`sh -c echo oops >&2; exit 3` failed \(exit 3\): oops"
    ):
        shell.run_command(("sh", "-c", "echo oops >&2; exit 3"))


def test_run_command_times_out():
    with pytest.raises(TestbedError, match=r"did not finish within 0\.2 s"):
        shell.run_command(("sleep", "5"), timeout=0.2)


def test_failure_messages_name_the_missing_kernel_feature():
    netem = ("tc", "-n", "x", "qdisc", "add", "dev", "eth0", "parent", "1:1", "netem", "delay")
    assert "CONFIG_NET_SCH_NETEM" in explain_failure(netem, "Specified qdisc kind is unknown.", 2)
    bpf = ("tc", "-n", "x", "filter", "add", "dev", "eth0", "bpf", "bytecode", "...")
    assert "CONFIG_NET_CLS_BPF" in explain_failure(bpf, 'Unknown filter "bpf"', 2)
    netns = ("ip", "netns", "add", "gradsum-0-w0")
    assert "namespaces are unavailable" in explain_failure(netns, "Permission denied", 1)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(shell.STATE_DIR_ENV, str(tmp_path))
    return tmp_path


def test_state_files_round_trip_and_list_valid_ids(state_dir):
    spec = TestbedSpec(id="abc", workers=3, switch=True, rate=10**9, loss=0.01)
    shell.write_state(spec)
    (state_dir / "Not-An-Id.json").write_text("{}")
    assert shell.read_state("abc") == spec
    assert shell.read_state("missing") is None
    assert shell.saved_ids() == ["abc"]


def test_a_testbed_in_use_by_another_process_is_refused_not_rebuilt(state_dir):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_CLAIM, "busy"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, shell.STATE_DIR_ENV: str(state_dir)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TestbedError, match=rf"'busy' is in use by pid {holder.pid}"):
            shell.claim("busy")
        shell.claim("other").close()  # other ids are free
    finally:
        holder.kill()
        holder.wait()
    shell.claim("busy").close()  # released when its holder exits, however it exits


HOLD_CLAIM = """
import sys, time
from gradsum.testbed import shell
handle = shell.claim(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def test_corrupt_state_file_is_named(state_dir):
    (state_dir / "bad.json").write_text('{"workers": "many"}')
    with pytest.raises(TestbedError, match=r"bad\.json is corrupt"):
        shell.read_state("bad")


def test_status_tells_up_broken_and_stale_testbeds():
    spec = TestbedSpec(id="s1", workers=2, switch=True)
    complete = ["gradsum-s1-tor", "gradsum-s1-w0", "gradsum-s1-w1", "gradsum-s2-w0"]
    assert describe("s1", spec, complete)["state"] == "up"
    assert describe("s1", spec, complete[:2])["state"] == "broken (missing gradsum-s1-w1)"
    stale = describe("s2", None, complete)
    assert stale == {"id": "s2", "state": "stale (no state file)", "namespaces": ["gradsum-s2-w0"]}
    assert "gradsum testbed down --id s2" in report_text(stale)
    text = report_text(describe("s1", spec, complete))
    assert "switch   gradsum-s1-tor" in text and "10.77.0.1" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rate", "fast"], "argument --rate: not a link rate"),
        (["--delay", "5"], "argument --delay: not a duration"),
        (["--loss", "0.01"], "argument --loss: not a loss rate"),
    ],
)
def test_up_rejects_bad_flags_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["testbed", "up", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_up_rejects_bad_counts_before_touching_anything(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["testbed", "up", "--workers", "0", "--id", "never"])
    assert exit_info.value.code == 2
    assert "workers must be an integer from 1" in capsys.readouterr().err


def test_exec_without_a_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["testbed", "exec", "w0", "--"])
    assert exit_info.value.code == 2
    assert "exec needs a command" in capsys.readouterr().err


def test_exec_on_a_testbed_that_is_not_up_fails_clearly(state_dir, capsys):
    assert main(["testbed", "exec", "--id", "gone", "w0", "--", "true"]) == 1
    assert "testbed 'gone' is not up" in capsys.readouterr().err
