"""A secret that is set but empty, or too short, is an error at start, never an open daemon."""

import os
import subprocess
import sys

import pytest

from gradsum.dataplane.authentication import load_secrets


@pytest.mark.parametrize("name", ["GRADSUM_ADMISSION_SECRET", "GRADSUM_ADMISSION_FILE"])
def test_a_set_but_empty_secret_is_an_error_naming_the_variable(name):
    with pytest.raises(ValueError, match=f"{name} is set but empty.*token_urlsafe"):
        load_secrets(environ={name: ""})
    with pytest.raises(ValueError, match="at least 16 characters, it has 5"):
        load_secrets(environ={"GRADSUM_ADMISSION_SECRET": "short"})
    assert load_secrets(environ={}) == {}  # unset: open, with the daemon's warning
    assert load_secrets(environ={"GRADSUM_ADMISSION_SECRET": "x" * 16}) == {"default": b"x" * 16}


@pytest.mark.parametrize("daemon", ["switch", "server"])
def test_the_daemons_refuse_to_start_with_an_empty_secret(daemon):
    environment = {**os.environ, "GRADSUM_ADMISSION_SECRET": ""}
    environment.pop("GRADSUM_ADMISSION_FILE", None)
    done = subprocess.run(
        [sys.executable, "-m", "gradsum.cli", daemon, "--bind", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, env=environment,
    )  # fmt: skip
    assert done.returncode == 2
    first = done.stderr.strip().splitlines()[0]
    assert first.startswith(f"gradsum {daemon}: error: GRADSUM_ADMISSION_SECRET is set but empty")
