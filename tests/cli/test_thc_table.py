import itertools
import subprocess
import sys

import pytest

from gradsum.cli import main


def test_thc_table_prints_the_table_on_one_line(capsys):
    assert main(["thc-table", "--bits", "4", "--granularity", "30", "--p", "1/32"]) == 0
    assert capsys.readouterr().out == "0 3 5 7 9 11 13 14 16 17 19 21 23 25 27 30\n"


def test_thc_table_grid_follows_the_bits_by_default(capsys):
    assert main(["thc-table", "--bits", "8"]) == 0
    table = [int(v) for v in capsys.readouterr().out.split()]
    assert len(table) == 256 and table[0] == 0 and table[-1] == 510
    assert all(a < b for a, b in itertools.pairwise(table))


def test_thc_table_rejects_impossible_granularity(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["thc-table", "--bits", "4", "--granularity", "10"])
    assert exit_info.value.code == 2
    assert "granularity g=10 must be at least" in capsys.readouterr().err


def test_console_script_runs():
    result = subprocess.run(
        [sys.executable, "-m", "gradsum.cli", "thc-table"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert result.stdout.split()[:3] == ["0", "3", "5"]
