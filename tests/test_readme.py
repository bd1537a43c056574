"""Every snippet of the README runs as written: each Python block in a fresh process (one worker,
Gloo's env:// rendezvous, a `gradsum switch` on loopback for the one that names it), and each
`gradsum ...` command line parses with gradsum's own parser (nothing is trained)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gradsum.cli import build_parser
from gradsum.net.loopback import DaemonProcess

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    blocks, language, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, body = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(body) + "\n"))
                language = None
        elif language is not None:
            body.append(line)
    return blocks


PYTHON = [body for language, body in _blocks(TEXT) if language == "python"]
SHELL = [body for language, body in _blocks(TEXT) if language == ""]


def _commands() -> list[list[str]]:
    """Every gradsum command line of the shell blocks (continuations joined, comments cut),
    as the words after `gradsum` (or after torchrun's `-m gradsum.cli`)."""
    commands = []
    for block in SHELL:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for start, word in enumerate(words):
                if word == "gradsum" or (word == "gradsum.cli" and words[start - 1] == "-m"):
                    commands.append(words[start + 1 :])
                    break
    return commands


def test_the_readme_has_the_snippets_this_test_runs():
    assert len(PYTHON) >= 4 and len(_commands()) >= 10


@pytest.mark.parametrize("words", _commands(), ids=lambda words: " ".join(words)[:60])
def test_every_gradsum_command_in_the_readme_parses(words):
    args = build_parser().parse_args(words)  # SystemExit (a usage error) fails the test
    assert callable(args.run)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_every_python_snippet_in_the_readme_runs(index, tmp_path):
    import torch.distributed as dist

    snippet = PYTHON[index]
    # torchrun's agent serves the rendezvous store and its workers connect to it: here, on a
    # port this process holds
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    environment = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    switch = DaemonProcess("switch") if "GRADSUM_SWITCH" in snippet else None
    try:
        if switch is not None:
            environment["GRADSUM_SWITCH"] = f"{switch.address[0]}:{switch.address[1]}"
        done = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=environment,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        if switch is not None:
            switch.stop()
    assert done.returncode == 0, f"README snippet {index}:\n{snippet}\n{done.stderr[-3000:]}"
