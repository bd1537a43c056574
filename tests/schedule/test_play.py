"""The play of a PS plan in C (``schedule/_play.c``) ends every group where the Python loop
(``costs.ps_group_ends`` under GRADSUM_NATIVE=0) does, bit for bit: the planners' searches
compare plays to 1e-9 and break ties on them, so a play off in its last bit can change a
searched plan (and the seed tables' findings, tests/sim)."""

import dataclasses
import random

import pytest

from gradsum.schedule import costs
from gradsum.schedule.costs import ps_group_ends
from gradsum.schedule.placement import place_spread
from gradsum.schedule.plan import Group, Plan, plan_skeleton
from gradsum.sim.presets import get_preset

pytestmark = pytest.mark.skipif(costs._play is None, reason="the C play was not built")


def both(plan, cluster, ready, monkeypatch) -> tuple[list[float], list[float]]:
    monkeypatch.setenv("GRADSUM_NATIVE", "1")
    native = ps_group_ends(plan, cluster, ready)
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    python = ps_group_ends(plan, cluster, ready)
    return native, python


def random_plan(rng: random.Random, profile, cluster, interleave: bool, credit) -> Plan:
    """Layers cut into random groups, each spread over a random number of shards."""
    layers = len(profile.layers)
    cuts = sorted(rng.sample(range(1, layers), rng.randint(0, min(layers - 1, 12))))
    bounds = list(zip([0, *cuts], [*cuts, layers], strict=True))
    offsets = profile.offsets
    ranges = [(int(offsets[a]), int(offsets[b])) for a, b in bounds]
    spans = [rng.randint(1, cluster.shards) for _ in ranges]
    parts = place_spread(ranges, spans, cluster.shards)
    groups = tuple(Group(a, b, p) for (a, b), p in zip(ranges, parts, strict=True))
    return Plan("test", groups, interleave=interleave, credit_bytes=credit,
                **plan_skeleton(profile))  # fmt: skip


@pytest.mark.parametrize("preset", ["imerge-seed", "imerge-seed-fit", "imerge-prototype"])
@pytest.mark.parametrize("workers", [1, 3, 32])
def test_the_c_play_ends_every_group_where_the_python_play_does(preset, workers, monkeypatch):
    """The bug it fears: the C loop taking an event out of order (ties broken otherwise than
    by the sequence pushed), a window admitting otherwise than ``SendWindow``, a rotated gate
    or an expression computed in another order (a last bit off)."""
    spec = get_preset(preset)
    profile = spec.profile("resnet18")
    ready = profile.ready_times()
    rng = random.Random(f"{preset}-{workers}")
    base = spec.cluster(workers)
    clusters = [
        base,
        dataclasses.replace(base, shared_cores=2, worker_wait=base.alpha_worker / 3),
        dataclasses.replace(base, shard_one_core=not base.shard_one_core),
        dataclasses.replace(base, machines=1),
    ]
    total = profile.total_params * base.bytes_per_element
    played = 0
    for cluster in clusters:
        for credit in (None, total, total // 7):
            for interleave in (False, True):
                for _ in range(4):
                    plan = random_plan(rng, profile, cluster, interleave, credit)
                    native, python = both(plan, cluster, ready, monkeypatch)
                    assert native == python, (cluster, credit, interleave, plan.groups)
                    played += 1
    assert played == 4 * 3 * 2 * 4


def test_the_c_play_refuses_inconsistent_arrays():
    with pytest.raises(ValueError, match="inconsistent"):
        costs._play.play((1e-6, 1e9, 1e9, 1e9, None, 0.0, 1e-6), (2, 1, 0, None), [0, 2], [2],
                         [0], [0.0], [0, 2], [4], [0], [4], [0])  # fmt: skip
