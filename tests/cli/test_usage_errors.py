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


def _usage_error(*argv: str) -> str:
    """The last line of stderr of a gradsum command that must stop at a usage error."""
    result = subprocess.run([sys.executable, "-m", "gradsum.cli", *argv],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_a_scheduler_option_the_policy_lacks_is_named():
    last = _usage_error("train", "--scheduler", "imerge(interleaved=true)")
    assert "argument --scheduler: scheduler 'imerge' has no option interleaved; " in last
    assert "its options are window, interleave, fuse, max_evaluations" in last


def test_bench_train_checks_each_scheduler_with_its_options():
    last = _usage_error("bench", "train", "--schedulers", "wfbp,imerge(window=group,nosuch=1)")
    assert "--schedulers 'imerge(window=group,nosuch=1)'" in last and "no option nosuch" in last


def test_a_fixed_cost_must_be_a_cost():
    for command in (["train"], ["bench", "train"]):
        last = _usage_error(*command, "--fixed-cost", "1e-3")
        assert "argument --fixed-cost: '1e-3': want ALPHA,BETA" in last
        last = _usage_error(*command, "--fixed-cost", "1e-3,0")
        assert "α must be >= 0 s and β > 0 s per byte" in last


def test_a_codec_spec_is_checked_without_loading_torch():
    """A bad option, value or word is refused before torch loads, so the usage error comes at
    once (the table in codecs/names.py; the registry checks it against the codecs when it loads)."""
    script = (
        "import sys\n"
        "from gradsum.train.methods import codec_spec, method_fields\n"
        "for spec in ('thc(bogus=1)', 'thc(correlated=maybe)', 'thc(scales=row)'):\n"
        "    try:\n"
        "        codec_spec(spec)\n"
        "    except ValueError as error:\n"
        "        print(error)\n"
        "assert 'torch' not in sys.modules, 'torch was loaded'\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert "no option bogus" in lines[0] and "scales" in lines[0]
    assert "correlated=maybe is not true or false" in lines[1]
    assert "scales=row is not one of tensor, partition" in lines[2]
