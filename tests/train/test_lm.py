"""The language-model workload: the standard library's sources as bytes, split by file; the
GPT model; a few steps of training through gradsum's switch + THC and torch's PowerSGD hook."""

import math

import pytest
import torch

from gradsum.train.data import DataError, load_dataset
from gradsum.train.launch import run_local
from gradsum.train.loop import TrainConfig, task_loss
from gradsum.train.models import GPT, GPTSizes, build_model, count_parameters


def _sources(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)


def test_stdlib_splits_by_file_deterministically_into_shifted_windows(tmp_path):
    files = {f"pkg{i % 3}/mod{i}.py": bytes([65 + i % 26]) * (300 + 7 * i) for i in range(60)}
    files["site-packages/foreign.py"] = b"@" * 500  # not the standard library
    _sources(tmp_path, files)
    first = load_dataset("stdlib", tmp_path, (16,), max_bytes=100_000)
    again = load_dataset("stdlib", tmp_path, (16,), max_bytes=100_000)
    assert torch.equal(first.train.inputs, again.train.inputs)
    assert torch.equal(first.test.inputs, again.test.inputs)
    assert first.num_classes == 256
    for split in (first.train, first.test):
        assert split.inputs.shape[1] == 16 and split.labels.shape == split.inputs.shape
        # labels are the next byte of each input position
        assert torch.equal(split.inputs[:, 1:], split.labels[:, :-1])
        assert int(split.inputs.max()) != ord("@")
    # by file: every file's (unique) byte value lands in exactly one split
    train_bytes = set(first.train.inputs.unique().tolist()) - {0}
    test_bytes = set(first.test.inputs.unique().tolist()) - {0}
    assert train_bytes and test_bytes
    # files sharing a byte value may sit in both splits; a value used by one file may not
    single = {65 + i % 26 for i in range(60) if sum(1 for j in range(60) if j % 26 == i % 26) == 1}
    assert not (train_bytes & test_bytes & single)


def test_stdlib_caps_its_text_and_refuses_a_folder_without_sources(tmp_path):
    capped = load_dataset("stdlib", None, (64,), max_bytes=50_000)
    assert len(capped.train) == (50_000 - 1) // 64  # windows of 65 bytes, overlapping by one
    with pytest.raises(DataError, match=r"no \.py files"):
        load_dataset("stdlib", tmp_path, (64,))


def test_gpt_is_causal_and_sized_by_its_options():
    torch.manual_seed(0)  # the models' initialisation, whatever ran before in this process
    model = build_model("gpt", 256, layers=2, width=32, heads=4, context=16)
    assert count_parameters(model) == count_parameters(GPT(256, GPTSizes(2, 32, 4, 16)))
    assert count_parameters(build_model("gpt", 256)) == 3_257_856  # the default: 4 x 256
    tokens = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        logits, later = model(tokens), model(changed)
    assert logits.shape == (3, 16, 256)
    assert torch.equal(logits[:, :10], later[:, :10])  # no position sees the future
    assert not torch.equal(logits[:, 10:], later[:, 10:])
    # the default model untrained is near uniform: ln 256 nats per byte (GPT-2's init)
    # (over 16 windows: on 3, the initialisation alone moved it by 0.14)
    windows = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(0))
    following = torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        start = task_loss(build_model("gpt", 256)(windows), following)
    assert abs(float(start) - math.log(256)) < 0.1
    with pytest.raises(ValueError, match="takes no size options"):
        build_model("digits-mlp", 10, layers=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [{"aggregator": "switch", "codec": "thc"}, {"aggregator": "ddp", "ddp_hook": "powersgd"}],
    ids=["switch:thc", "ddp:powersgd2"],
)
def test_a_few_steps_of_the_language_model_lower_its_validation_loss(method):
    config = TrainConfig(
        model="gpt", dataset="stdlib", workers=2, batch_size=8, optimizer="adamw", lr=1e-3,
        layers=2, width=64, heads=2, context=64, data_bytes=300_000, max_steps=30,
        eval_every=15, eval_samples=32, progress=False, **method,
    )  # fmt: skip
    summary = run_local(config)
    losses = [record["val_loss"] for record in summary["evals"]]
    assert [record["step"] for record in summary["evals"]] == [0, 15, 30]
    assert losses[0] > 5.0  # near ln 256 = 5.55 before training
    assert losses[-1] < losses[0] - 1.5, losses  # 5.48 -> 3.6 in the runs seen
    assert summary["bits_per_byte"] == pytest.approx(losses[-1] / math.log(2))
    assert summary["steps"] == 30 and summary["fallbacks"] == 0
    assert summary["compute_s"] > 0


@pytest.mark.parametrize(("every", "steps"), [(None, [0, 3, 6, 9, 12, 15, 18, 20]),
                                              (10, [0, 3, 6, 9, 10, 12, 15, 18, 20])])  # fmt: skip
def test_evaluations_come_every_eval_seconds_of_training_on_worker_0s_clock(
    monkeypatch, every, steps
):
    """0.7 s steps, an evaluation every 2 s of training: after steps 3 (2.1 s), 6 (4.2 s), ...;
    the evaluations' own time is not training time, and the step schedule still applies."""
    from gradsum.train import loop, trainer

    now = [0.0]

    class Clock:
        @staticmethod
        def perf_counter():
            return now[0]

    class Replicas:
        step = 0

        def forward(self, inputs, labels):
            now[0] += 0.7
            return torch.zeros(()), None

        def agree(self, loss, stop):
            return 0.0, stop

        def backward(self, loss):
            self.step += 1

        zero_grad = apply = lambda self: None

    class Batches:
        def epoch(self, epoch):
            return [(torch.zeros(1), torch.zeros(1))] * 1000

        def prepare(self, inputs, labels):
            return inputs, labels

    def validation(model, data, samples):
        now[0] += 100.0  # evaluating takes long; none of it counts as training
        return 1.0, 0.5

    monkeypatch.setattr(trainer, "time", Clock)
    monkeypatch.setattr(loop, "validation", validation)
    config = TrainConfig(max_steps=20, eval_seconds=2.0, eval_every=every, progress=False)
    log = type("Log", (), {"write": lambda self, record: None})()
    dataset = type("Data", (), {"train": None, "test": None})()
    report = loop._Evaluations(config, 0, 1, torch.nn.Linear(1, 1), dataset, log, None)
    run = trainer.Trainer(Replicas(), Batches(), report, loop.schedule_of(config)).run()
    evals, durations = report.evals, run.durations
    assert [e["step"] for e in evals] == steps
    assert [e["seconds"] for e in evals] == pytest.approx([0.7 * s for s in steps])
    assert durations == pytest.approx([0.7] * 20)  # each step's, evaluations left out
    summary = loop._stepped_summary(evals, None, durations, samples_per_step=8)
    assert summary["median_step_s"] == pytest.approx(0.7)
    assert summary["samples_per_s"] == pytest.approx(8 / 0.7)


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [{"aggregator": "allreduce", "codec": "powersgd", "codec_options": "rank=2"},
     {"aggregator": "ddp", "ddp_hook": "fp16"}],
    ids=["allreduce:powersgd", "ddp:fp16"],
)  # fmt: skip
def test_the_first_steps_go_uncompressed_when_asked(method):
    """--uncompressed-steps N: the first N steps are fp32's, bit for bit (the lossless codec's
    average of the same gradients), and compression starts at step N + 1."""
    common = dict(model="gpt", dataset="stdlib", workers=2, batch_size=4, optimizer="adamw",
                  lr=1e-3, layers=1, width=32, heads=2, context=32, data_bytes=100_000,
                  eval_samples=16, progress=False)  # fmt: skip
    fp32 = {"aggregator": method["aggregator"]} | (
        {"codec": "none"} if method["aggregator"] != "ddp" else {"ddp_hook": "allreduce"}
    )

    def digest(steps: int, **fields) -> str:
        return run_local(TrainConfig(max_steps=steps, **common, **fields))["parameter_digest"]

    assert digest(3, **method, uncompressed_steps=3) == digest(3, **fp32)
    assert digest(3, **method, uncompressed_steps=2) != digest(3, **fp32)
