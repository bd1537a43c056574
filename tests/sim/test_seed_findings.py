"""`gradsum simulate --preset imerge-seed` at 32 workers against the IMerge seed's findings.

All four models, all seven policies (the ``seed_table`` fixture of conftest.py, computed once
per session in parallel; about a minute of CPU in all). docs/scheduling.md has the measured and
scored tables. Findings the model does not reproduce are strict xfails whose reasons name the
premises they rest on, so a change that fixes one shows up.

Premises of ``imerge-seed`` (docs/scheduling.md, "The stated hardware"): 150 µs per message
(α_worker 100 µs + α_shard 50 µs), BytePS partitions for the baselines, ByteScheduler slices (a
key each), batch 128, the 23.3M-parameter AlexNet, speed-up against compute alone in these
tables (against each policy's own one-worker run in the score).
"""

import pytest

from gradsum.schedule.planners import make_planner
from gradsum.sim.presets import get_preset

from .conftest import SEED_MODELS as MODELS

pytestmark = pytest.mark.slow

HIDDEN = (
    "communication hides behind backward on the ResNets and VGG16 at 150 us per message with "
    "BytePS partitions (wfbp within 1% of linear), so what the seed gained from fusion and "
    "interleaving has nothing left to win"
)


def xfail_on(models, reason):
    """``MODELS`` as parameters, the named ones strict xfails."""
    mark = pytest.mark.xfail(strict=True, reason=reason)
    return [pytest.param(m, marks=mark) if m in models else m for m in MODELS]


@pytest.fixture
def table(seed_table):
    return seed_table


def speedup(table, model, policy):
    return table[(model, policy)]["speedup"]


@pytest.mark.parametrize(
    "model",
    xfail_on(
        {"alexnet"},
        "AlexNet's default already overlaps nothing it could: its 16.8M-element FC layer is "
        "last in backward, so wfbp gains 9% over default, not 10% (seed +37%)",
    ),
)
def test_wfbp_beats_default(table, model):
    assert speedup(table, model, "wfbp") > 1.1 * speedup(table, model, "default")


@pytest.mark.parametrize("model", MODELS)
def test_imerge_at_least_as_fast_as_wfbp(table, model):
    assert speedup(table, model, "imerge") >= speedup(table, model, "wfbp")


@pytest.mark.parametrize("model", MODELS)
def test_merge_at_least_as_fast_as_wfbp(table, model):
    assert speedup(table, model, "merge") >= speedup(table, model, "wfbp") * (1 - 1e-9)


@pytest.mark.parametrize(
    "model",
    xfail_on(
        {"resnet50"},
        HIDDEN + ": merge and imerge both within 0.2% of linear, imerge 0.015% behind (31.936 "
        "against 31.941); the whole-plan play, serving ports first come first served, ranks "
        "imerge's spans ahead where the max-min network puts them a hair behind",
    ),
)
def test_imerge_at_least_as_fast_as_merge(table, model):
    assert speedup(table, model, "imerge") >= speedup(table, model, "merge")


@pytest.mark.parametrize("model", MODELS)
def test_merge_at_least_as_fast_as_static_fusion(table, model):
    assert speedup(table, model, "merge") >= speedup(table, model, "fusion")


@pytest.mark.parametrize(
    "model",
    xfail_on(
        {"resnet18", "vgg16", "resnet50"},
        HIDDEN + "; static fusion only delays layers (ResNet18 -5%, VGG16 -4%, ResNet50 -1% "
        "against wfbp; seed +13-33%)",
    ),
)
def test_static_fusion_beats_wfbp(table, model):
    assert speedup(table, model, "fusion") > speedup(table, model, "wfbp")


@pytest.mark.parametrize(
    "model",
    xfail_on(
        set(MODELS),
        HIDDEN + "; on AlexNet merge gains 4% over wfbp (seed +20%): 150 us per message is "
        "small against its 93 MB per worker",
    ),
)
def test_merge_beats_wfbp_by_a_margin(table, model):
    assert speedup(table, model, "merge") > 1.1 * speedup(table, model, "wfbp")


@pytest.mark.parametrize("model", xfail_on({"resnet18", "vgg16", "resnet50"}, HIDDEN))
def test_imerge_beats_merge_by_a_margin(table, model):
    assert speedup(table, model, "imerge") > 1.05 * speedup(table, model, "merge")


@pytest.mark.parametrize(
    "model",
    xfail_on(
        {"resnet18", "vgg16", "resnet50"},
        "BytePS partitions spread every big layer over the shards, so default reaches 69-86% "
        "at 32 workers; the seed's gains imply at most 54% (ResNet18), 32% (VGG16), 39% "
        "(ResNet50): a default that slow needs costlier messages or each layer on one shard",
    ),
)
def test_default_efficiency_at_most_55_percent_at_32_workers(table, model):
    assert table[(model, "default")]["efficiency"] <= 0.55


@pytest.mark.parametrize("model", MODELS)
def test_all_reduce_model_fusion_falls_behind_static_fusion(table, model):
    assert speedup(table, model, "mgwfbp") < speedup(table, model, "fusion")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("workers", [16, 32])
def test_all_reduce_model_puts_every_layer_in_one_group(model, workers):
    preset = get_preset("imerge-seed")
    plan = make_planner("mgwfbp")(preset.profile(model), preset.cluster(workers))
    assert len(plan.groups) == 1


@pytest.mark.xfail(
    strict=True,
    reason="ByteScheduler gives every slice its own key, so the 236 slices spread over the 32 "
    "shards (the collapse seen before came from placing a layer's 168 slices on one shard); "
    "at 150 us per message priority is 71% above default",
)
def test_priority_slicing_collapses_on_alexnet(table):
    assert speedup(table, "alexnet", "priority") < 0.5 * speedup(table, "alexnet", "default")


@pytest.mark.xfail(
    strict=True,
    reason="at 150 us per message the backward hides the per-slice costs and ByteScheduler's "
    "slices spread over every shard: priority ties wfbp on the ResNets and VGG16 (16-43% above "
    "default)",
)
@pytest.mark.parametrize("model", ["resnet18", "vgg16", "resnet50"])
def test_priority_slicing_at_most_default(table, model):
    assert speedup(table, model, "priority") <= speedup(table, model, "default")


def test_vgg16_scales_almost_linearly_with_imerge(table):
    assert table[("vgg16", "imerge")]["efficiency"] > 0.85


def test_alexnet_stays_far_from_linear_even_with_imerge(table):
    assert table[("alexnet", "imerge")]["efficiency"] < 0.7


@pytest.mark.xfail(
    strict=True,
    reason="26%: each NIC direction carries 16 x 93 MB per iteration, 119 ms at 100 Gbit/s "
    "against 48 ms of compute at batch 128, so even perfect overlap gives at most 40% "
    "(23.3M-parameter AlexNet, speed-up against compute alone; docs/scheduling.md)",
)
def test_alexnet_around_half_efficiency_with_imerge(table):
    assert 0.4 < table[("alexnet", "imerge")]["efficiency"] < 0.6
