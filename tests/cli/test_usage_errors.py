"""A bad flag is one readable line and exit status 2, however gradsum is started: the console
script, or ``python -m gradsum.cli`` as torchrun runs it (where the module is ``__main__``)."""

import subprocess
import sys


def test_python_dash_m_reports_a_usage_error_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "gradsum.cli", "bench", "train", "--methods", "switch:none"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("gradsum bench: error: --methods switch:none: codec 'none' cannot run")
