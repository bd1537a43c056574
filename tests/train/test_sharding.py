"""`gradsum train --shard fsdp2`: the model sharded with FSDP2, gradients through its
reduce-scatter (gradsum's codec or torch's own); a resumed run continues bit for bit."""

from __future__ import annotations

import re

import pytest

from gradsum.cli import UsageError
from gradsum.train.config import Method, TrainConfig
from gradsum.train.launch import run_local
from gradsum.train.methods import method_fields, method_name


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("fsdp2", {"aggregator": "ddp", "ddp_hook": "allreduce", "shard": "fsdp2"}),
        ("fsdp2:bf16", {"aggregator": "ddp", "ddp_hook": "bf16", "shard": "fsdp2"}),
        ("fsdp2:thc(correlated=true)", {"aggregator": "allreduce", "codec": "thc",
                                        "codec_options": "correlated=true", "shard": "fsdp2"}),
    ],
)  # fmt: skip
def test_fsdp2_methods_name_their_fields_and_back(name, fields):
    assert method_fields(name) == fields
    assert method_name(TrainConfig(**fields)) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fsdp2:powersgd", "cannot compress FSDP2's reduce-scatter"),
        ("fsdp2:topk", "cannot compress FSDP2's reduce-scatter"),
        ("fsdp2:zip", "unknown codec 'zip'"),
    ],
)
def test_a_codec_a_reduce_scatter_cannot_sum_is_refused_by_name(name, message):
    with pytest.raises(UsageError, match=message):
        method_fields(name)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"aggregator": "switch", "codec": "thc"}, "runs over torch.distributed"),
        ({"aggregator": "ddp", "ddp_hook": "powersgd"}, "fp32 (--ddp-hook allreduce) or bf16"),
        ({"aggregator": "allreduce", "codec": "powersgd"}, "cannot compress FSDP2's"),
    ],
)
def test_sharding_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Method.check(TrainConfig(shard="fsdp2", **fields))


@pytest.mark.slow
def test_resume_with_fsdp2_continues_bit_identically_to_an_uninterrupted_run(tmp_path):
    """The codec's step, its error feedback per rank and unit, and the gathered model and
    optimizer state carry a sharded run across a checkpoint."""
    common = {"aggregator": "allreduce", "codec": "thc", "shard": "fsdp2", "workers": 2,
              "optimizer": "adamw", "lr": 1e-3, "progress": False}  # fmt: skip
    whole = run_local(TrainConfig(epochs=2, **common))
    checkpoint = tmp_path / "ckpt.pt"
    run_local(TrainConfig(epochs=1, checkpoint=str(checkpoint), **common))
    resumed = run_local(TrainConfig(epochs=2, resume=str(checkpoint), **common))
    assert resumed["parameter_digest"] == whole["parameter_digest"]
    assert resumed["method"] == "fsdp2:thc"


def test_bytes_per_step_count_the_fp32_all_gather_and_the_reduce_scatters_lanes():
    from gradsum.bench.tta import bytes_per_step
    from gradsum.train.models import build_model

    count = sum(p.numel() for p in build_model("digits-mlp").parameters())
    sizes = {name: bytes_per_step(TrainConfig(model="digits-mlp", workers=4,
                                              **method_fields(name)))
             for name in ("fsdp2", "fsdp2:bf16", "fsdp2:thc")}  # fmt: skip
    assert sizes["fsdp2"] == 8 * count and sizes["fsdp2:bf16"] == 6 * count
    # THC's sums of 4 workers fit a byte: 4 + 1 bytes a coordinate, and its norms and the
    # rotation's padding (the small model's tensors pad by a tenth)
    assert 5 * count <= sizes["fsdp2:thc"] < 6 * count


@pytest.mark.parametrize("flags", [["--scheduler", "fusion"], ["--fusion-elements", "1000"]])
def test_a_schedule_given_with_fsdp2_is_refused_rather_than_ignored(flags, capsys):
    from gradsum.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--shard", "fsdp2", "--aggregator", "allreduce", *flags,
              "--max-steps", "1"])  # fmt: skip
    assert exit_.value.code == 2
    assert f"{flags[0]} {flags[1]}: does not apply to --shard fsdp2" in capsys.readouterr().err
