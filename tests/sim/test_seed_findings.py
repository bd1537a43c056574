"""`gradsum simulate --preset imerge-seed` at 32 workers against the IMerge seed's findings.

All four models, all seven policies (the ``seed_table`` fixture of conftest.py, computed once
per session in parallel; ~50 s of CPU in all, the 32-worker priority and imerge runs carrying
thousands of concurrent flows). docs/scheduling.md has the measured table. Findings the
calibrated model does not reproduce are strict xfails with the reason, so a change that fixes
them shows up.
"""

import pytest

from gradsum.schedule.planners import make_planner
from gradsum.sim.presets import get_preset

from .conftest import SEED_MODELS as MODELS

pytestmark = pytest.mark.slow


@pytest.fixture
def table(seed_table):
    return seed_table


def speedup(table, model, policy):
    return table[(model, policy)]["speedup"]


@pytest.mark.parametrize("model", MODELS)
def test_wfbp_beats_default(table, model):
    assert speedup(table, model, "wfbp") > 1.1 * speedup(table, model, "default")


@pytest.mark.parametrize("model", MODELS)
def test_imerge_at_least_as_fast_as_wfbp(table, model):
    assert speedup(table, model, "imerge") >= speedup(table, model, "wfbp")


@pytest.mark.parametrize("model", MODELS)
def test_merge_at_least_as_fast_as_wfbp(table, model):
    assert speedup(table, model, "merge") >= speedup(table, model, "wfbp")


@pytest.mark.parametrize("model", MODELS)
def test_imerge_at_least_as_fast_as_merge(table, model):
    assert speedup(table, model, "imerge") >= speedup(table, model, "merge")


@pytest.mark.parametrize("model", MODELS)
def test_all_reduce_model_fusion_falls_behind_static_fusion(table, model):
    assert speedup(table, model, "mgwfbp") < speedup(table, model, "fusion")


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("workers", [16, 32])
def test_all_reduce_model_puts_every_layer_in_one_group(model, workers):
    preset = get_preset("imerge-seed")
    plan = make_planner("mgwfbp")(preset.profile(model), preset.cluster(workers))
    assert len(plan.groups) == 1


def test_priority_slicing_collapses_on_alexnet(table):
    assert speedup(table, "alexnet", "priority") < 0.5 * speedup(table, "alexnet", "default")


@pytest.mark.xfail(
    strict=True,
    reason="at 150 us per message the backward hides the per-slice costs (ResNet18 +34%, "
    "ResNet50 +21% over default) and VGG16 priority stays 8% above default; the per-message "
    "and per-core costs that put them below default break other findings (docs/scheduling.md)",
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
    reason="29%: each NIC direction carries 16 x 93 MB per iteration, 119 ms at 100 Gbit/s "
    "against 48 ms of compute, so even perfect overlap gives at most 40% (docs/scheduling.md)",
)
def test_alexnet_around_half_efficiency_with_imerge(table):
    assert 0.4 < table[("alexnet", "imerge")]["efficiency"] < 0.6
