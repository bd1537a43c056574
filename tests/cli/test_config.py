"""The configuration declared once (gradsum/config.py, train/config.py) and the one spec grammar
(gradsum/spec.py): every field has one flag, spelt alike by every command that offers it; a bad
spec, a flag that does not apply and a resume from another method's checkpoint stop the command
before any process starts."""

import argparse
import dataclasses
import functools
import multiprocessing.process
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gradsum.bench import train_testbed, tta
from gradsum.cli import UsageError, build_parser, main
from gradsum.config import flags_of, runs_from
from gradsum.train import launch
from gradsum.train.cli import job_config
from gradsum.train.config import BENCH_SECTIONS, SECTIONS, TrainConfig

THC_OPTIONS = ("bits, granularity, p, rotation_block, correlated, spread_clamp, scales, "
               "error_feedback, feedback_bound")


@pytest.fixture
def started(monkeypatch):
    """Every process a command would start, recorded instead: the local launcher's workers and
    services (multiprocessing), torchrun's and the testbed's (subprocess)."""
    seen = []

    def record(what):
        def refuse(*args, **kwargs):
            seen.append(what)
            raise AssertionError(f"{what} started")

        return refuse

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", record("a process"))
    monkeypatch.setattr(subprocess.Popen, "__init__", record("a subprocess"))
    monkeypatch.setattr(launch, "run_local", record("the local launcher"))
    monkeypatch.setattr(train_testbed, "train_in_testbed", record("a testbed"))
    return seen


def _usage_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--codec", "thc(bogus=1)"],
         f"argument --codec: codec 'thc' has no option bogus; its options are {THC_OPTIONS}"),
        (["train", "--scheduler", "imerge(bogus=1)"],
         "argument --scheduler: scheduler 'imerge' has no option bogus; its options are window, "
         "interleave, fuse, max_evaluations"),
        (["bench", "tta", "--methods", "switch:thc(bogus=1)"],
         f"--methods switch:thc(bogus=1): codec 'thc' has no option bogus; its options are "
         f"{THC_OPTIONS}"),
        (["bench", "train", "--methods", "ps:none", "--schedulers", "wfbp,merge(bogus=1)"],
         "--schedulers 'merge(bogus=1)': scheduler 'merge' has no option bogus"),
        (["bench", "scale", "--methods", "none,thc(bogus=1)"], "codec 'thc' has no option bogus"),
    ],
)  # fmt: skip
def test_an_option_the_spec_lacks_is_a_usage_error_before_any_process_starts(
    argv, named, started, capsys
):
    assert named in _usage_error(capsys, *argv)
    assert started == []


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["train", "--codec", "thc(correlated=maybe)"], "correlated=maybe is not true or false"),
        (["train", "--codec", "thc(bits=4.5)"], "bits=4.5 is not an integer"),
        (["train", "--codec", "topk(ratio=most)"], "ratio=most is not a number"),
        (["train", "--scheduler", "imerge(interleave=maybe)"],
         "interleave=maybe is not true or false or none"),
        (["bench", "tta", "--methods", "ddp,switch:thc(correlated=maybe)"],
         "correlated=maybe is not true or false"),
        (["bench", "scale", "--methods", "thc(correlated=1)"], "correlated=1 is not true or false"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_refused_naming_the_option(argv, named, started, capsys):
    last = _usage_error(capsys, *argv)
    assert named in last and "its options are" in last
    assert started == []


def test_every_field_has_exactly_one_flag_declared_once():
    declared = [field.name for section in SECTIONS for field in dataclasses.fields(section)]
    assert sorted(declared) == sorted(field.name for field in dataclasses.fields(TrainConfig))
    assert len(declared) == len(set(declared))  # no two sections declare one field
    flag_of: dict[str, list[str]] = {}
    for flag in flags_of(SECTIONS):
        for field in flag.fields:
            flag_of.setdefault(field, []).append(flag.name)
    assert set(flag_of) == set(declared)
    assert all(len(flags) == 1 for flags in flag_of.values()), flag_of
    assert flag_of["codec"] == flag_of["codec_options"] == ["--codec"]
    names = [flag.name for flag in flags_of(SECTIONS)]
    assert len(names) == len(set(names))


def _command(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def test_train_and_the_benches_spell_each_field_alike():
    """A field a command offers has its declared flag there; a field it runs over has the
    declared sweep (``--methods``, ``--schedulers``, ``--seeds``); ``train`` offers them all."""
    commands = {("train",): SECTIONS, ("bench", "train"): BENCH_SECTIONS,
                ("bench", "tta"): BENCH_SECTIONS}  # fmt: skip
    for path, sections in commands.items():
        parser = _command(*path)
        by_dest: dict[str, list[str]] = {}
        for action in parser._actions:
            by_dest.setdefault(action.dest, []).extend(action.option_strings)
        options = {option for action in parser._actions for option in action.option_strings}
        for flag in flags_of(sections):
            if flag.field in by_dest:
                assert by_dest[flag.field][0] == flag.name, (path, flag.field)
            else:
                assert flag.setting.sweep in options, (path, flag.field)
        if path == ("train",):
            assert {flag.field for flag in flags_of(SECTIONS)} <= set(by_dest)
        assert "--codec-options" not in {o for a in parser._actions if a.help != "==SUPPRESS=="
                                         for o in a.option_strings}  # fmt: skip
    assert "--checkpoint" not in _command("bench", "tta").format_help()  # not offered there


def test_the_codec_takes_its_options_in_the_spec_on_the_command_line_and_in_python():
    args = build_parser().parse_args(["train", "--codec", "thc(correlated=true, bits=2)"])
    config = job_config(args)
    assert (config.codec, config.codec_options) == ("thc", "correlated=true, bits=2")
    api = TrainConfig(codec="thc(correlated=true,bits=2)")
    assert (api.codec, api.codec_options) == ("thc", "correlated=true,bits=2")
    with pytest.raises(ValueError, match="give the options in one of them"):
        TrainConfig(codec="thc(bits=2)", codec_options="bits=4")


def test_codec_options_points_to_the_spec_form(capsys):
    last = _usage_error(capsys, "train", "--codec-options", "correlated=true")
    assert last.endswith("give the options with the codec, --codec 'thc(correlated=true)'")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--aggregator", "ddp", "--codec", "thc"],
         "--codec thc: does not apply to --aggregator ddp: torch DDP compresses with --ddp-hook"),
        (["--aggregator", "switch", "--ddp-hook", "fp16"],
         "--ddp-hook fp16: applies to --aggregator ddp only"),
        (["--aggregator", "ddp", "--powersgd-rank", "4"],
         "--powersgd-rank 4: applies to --aggregator ddp --ddp-hook powersgd only"),
        (["--aggregator", "allreduce", "--window-bytes", "65536"],
         "--window-bytes 65536: applies to --aggregator switch and ps only"),
        (["--aggregator", "ps", "--switch", "127.0.0.1:1"],
         "--switch 127.0.0.1:1: applies to --aggregator switch only"),
        (["--optimizer", "adamw", "--momentum", "0.5"],
         "--momentum 0.5: applies to --optimizer sgd only"),
        (["--layers", "2"], "--layers 2: applies to --model gpt only"),
        (["--max-steps", "5", "--epochs", "2"], "--epochs 2: applies to epoch-based runs only"),
        (["--time-budget", "60"], "--time-budget 60.0: applies to step-based runs only"),
    ],
)  # fmt: skip
def test_a_flag_that_does_not_apply_is_refused(argv, named, started, capsys):
    assert f"error: {named}" in _usage_error(capsys, "train", *argv)
    assert started == []


def test_a_bench_refuses_a_flag_only_where_it_applies_to_none_of_its_runs(capsys):
    last = _usage_error(capsys, "bench", "tta", "--methods", "ddp,ddp:fp16", "--window-bytes", "9")
    assert last.endswith("--window-bytes 9: applies to --aggregator switch and ps only (in every "
                         "run)")  # fmt: skip
    args = build_parser().parse_args(["bench", "tta", "--methods", "ddp,switch:thc",
                                      "--window-bytes", "9"])  # fmt: skip
    runs = [{"aggregator": "ddp"}, {"aggregator": "switch"}]
    base, configs = runs_from(args, BENCH_SECTIONS, TrainConfig(**tta.DEFAULTS), runs)
    assert base.window_bytes == 9 and [c.aggregator for c in configs] == ["ddp", "switch"]


def _checkpoint(path, method: str) -> None:
    """A checkpoint as training saves it (train/loop.py)."""
    from gradsum.train import loop

    model = torch.nn.Linear(2, 1)
    config = TrainConfig(checkpoint=str(path), **_fields(method))
    sync = SimpleNamespace(step=3)
    loop._save(config, 0, 0, model, torch.optim.SGD(model.parameters(), lr=0.1), None, sync)


def _fields(method: str) -> dict:
    from gradsum.train.methods import method_fields

    return method_fields(method)


def test_resuming_with_another_method_than_the_checkpoints_is_refused_naming_the_difference(
    tmp_path, started, capsys
):
    path = tmp_path / "ckpt.pt"
    _checkpoint(path, "switch:thc(correlated=true)")
    last = _usage_error(capsys, "train", "--aggregator", "ps", "--codec", "thc",
                        "--resume", str(path))  # fmt: skip
    assert last.endswith(
        f"--resume {path}: the checkpoint was made with switch:thc(correlated=true), this run is "
        "ps:thc: the aggregator (switch, not ps) and the codec's options (correlated=true, not "
        "none) differ"
    )
    last = _usage_error(capsys, "train", "--codec", "bfp(block_size=64)", "--resume", str(path))
    assert "the codec (thc, not bfp) and the codec's options" in last
    _checkpoint(path, "ddp:powersgd2")
    last = _usage_error(capsys, "train", "--aggregator", "ddp", "--resume", str(path))
    assert last.endswith("the DDP hook (powersgd, not allreduce) and the PowerSGD rank (2, not "
                         "none) differ")  # fmt: skip
    assert "no such checkpoint" in _usage_error(capsys, "train", "--resume", str(tmp_path / "x"))
    assert started == []
    same = ["train", "--aggregator", "ddp", "--ddp-hook", "powersgd", "--resume", str(path)]
    assert job_config(build_parser().parse_args(same)).resume == str(path)


def test_a_usage_error_is_raised_where_the_command_line_is_checked():
    """`job_config` is what `gradsum train` runs before anything starts: usage errors come from
    it, not from a worker."""
    args = build_parser().parse_args(["train", "--aggregator", "switch", "--codec", "qsgd"])
    with pytest.raises(UsageError, match="codec 'qsgd' cannot run on the switch"):
        job_config(args)


def test_a_spec_on_the_command_line_reaches_the_codec_that_trains(gloo_world_of_one, monkeypatch):
    """`gradsum train --codec 'thc(correlated=true)'` as one worker trains with a correlated THC:
    the options parsed on the command line are the ones the worker's codec is built with."""
    from gradsum.codecs.thc.codec import THC
    from gradsum.train import loop

    built = []
    init = THC.__init__

    @functools.wraps(init)  # the signature the codec's options are checked against
    def recording(self, *args, **options):
        built.append(options.get("correlated"))
        init(self, *args, **options)

    monkeypatch.setattr(THC, "__init__", recording)
    argv = ["train", "--aggregator", "allreduce", "--codec", "thc(correlated=true)",
            "--workers", "1", "--max-steps", "3", "--eval-every", "3", "--eval-samples", "32",
            "--no-progress", "--device", "cpu"]  # fmt: skip
    config = job_config(build_parser().parse_args(argv))
    summary = loop.train_worker(config, 0, 1)
    assert summary["steps"] == 3 and summary["method"] == "allreduce:thc(correlated=true)"
    assert built and all(built), built  # every THC the run built is the correlated one


@pytest.mark.slow
def test_gradsum_train_trains_with_a_codec_spec_and_resumes_only_with_the_same(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    common = ["-m", "gradsum.cli", "train", "--workers", "2", "--no-progress"]

    trained = subprocess.run(
        [sys.executable, *common, "--codec", "thc(correlated=true)", "--epochs", "1",
         "--checkpoint", str(checkpoint)], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert "switch:thc(correlated=true)" in trained.stdout
    assert "done: test accuracy" in trained.stdout
    refused = subprocess.run(
        [sys.executable, *common, "--epochs", "2", "--resume", str(checkpoint)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "the codec's options (correlated=true, not none) differs" in refused.stderr
