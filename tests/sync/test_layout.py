"""Plans' element ranges mapped onto parameter pieces, and plans executed by GradientSync."""

import pytest
import torch

from gradsum.schedule import make_planner, uniform_profile
from gradsum.schedule.cluster import ClusterSpec
from gradsum.sync.layout import BufferLayout, Segment


def _plan(params, **options):
    profile = uniform_profile(params, [1e-3] * len(params))
    return make_planner("priority", **options)(profile, ClusterSpec(workers=2, shards=2))


def test_slices_map_to_pieces_of_parameters_across_boundaries():
    plan = _plan([5, 3], slice_elements=4)  # layer i holds parameter i
    layout = BufferLayout(plan, [5, 3])
    assert layout.segments(0, 4) == (Segment(0, 0, 4),)
    assert layout.segments(3, 7) == (Segment(0, 3, 5), Segment(1, 0, 2))
    assert layout.segments(5, 8) == (Segment(1, 0, 3),)


def test_a_plan_for_another_model_is_refused():
    plan = _plan([5, 3])
    with pytest.raises(ValueError, match="another model"):
        BufferLayout(plan, [5, 4])
    with pytest.raises(ValueError, match="another model"):
        BufferLayout(plan, [5, 3, 1])


def _doubled(flat, **_):
    """One worker's 'average' that doubles, so writes are visible."""
    return flat * 2


def test_gradient_sync_writes_every_slice_back_and_honours_after_backward():
    from gradsum.sync.gradient_sync import GradientSync

    from .fakes import answering_session

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    profile = uniform_profile(sizes[::-1], [1e-3] * 4)
    profile = type(profile)(
        "m",
        tuple(
            type(layer)(layer.name, layer.params, layer.backward_s, 0.0, (3 - i,))
            for i, layer in enumerate(profile.layers)
        ),
    )
    cluster = ClusterSpec(workers=2, shards=2)
    model.zero_grad()
    model(torch.ones(1, 4)).sum().backward()
    expected = [p.grad.clone() * 2 for p in params]  # before any hook: sends start in backward
    for name, options in (("priority", {"slice_elements": 5}), ("default", {})):
        plan = make_planner(name, **options)(profile, cluster)
        sync = GradientSync(model, answering_session(_doubled), plan=plan)
        released_mid_backward = []
        probe = params[2].register_post_accumulate_grad_hook(  # the last layer: ready first
            lambda _, seen=released_mid_backward, s=sync: seen.append(s._released)
        )
        model.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        probe.remove()
        assert (released_mid_backward[0] == 0) == (plan.trigger == "after_backward"), name
        sync.wait()
        sync.close()
        for p, e in zip(params, expected, strict=True):
            assert torch.equal(p.grad, e), name


def test_cut_shapes_keeps_whole_tensors_and_flattens_parts():
    from gradsum.sync.layout import cut_shapes

    shapes = [(4, 5), (3,), (2, 3, 4)]  # 20, 3, 24 elements
    assert cut_shapes(shapes, 0, 47) == [(4, 5), (3,), (2, 3, 4)]
    assert cut_shapes(shapes, 10, 30) == [(10,), (3,), (7,)]
    assert cut_shapes(shapes, 20, 23) == [(3,)]
    assert cut_shapes(shapes, 5, 5) == []
