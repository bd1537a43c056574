"""Every flag of `gradsum train` says what it does and shows its default."""

import contextlib
import re

from gradsum.config import flags_of, sections_of
from gradsum.train.config import TrainConfig


def test_every_train_flag_has_help_and_shows_its_default(capsys):
    from gradsum.cli import main

    with contextlib.suppress(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    # each option's entry: from its line "  --flag ..." to the next option or group
    entries = {}
    for entry in re.split(r"\n(?=  -|\S)", out[out.index("options:") :]):
        words = entry.split()
        if words and words[0].startswith("--"):
            entries[words[0].rstrip(",")] = " ".join(words)
    for flag in flags_of(sections_of(TrainConfig)):
        assert flag.setting.help, f"{flag.name} has no help"
        entry = entries.get(flag.name)
        assert entry and "(default: " in entry, (flag.name, entry)
        assert flag.setting.help.split()[0] in entry, (flag.name, entry)
