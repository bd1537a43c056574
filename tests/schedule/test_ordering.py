"""The fixed send order every worker follows."""

from gradsum.schedule import make_planner, uniform_profile
from gradsum.schedule.cluster import ClusterSpec
from gradsum.schedule.ordering import group_ready_times, send_order

CLUSTER = ClusterSpec(workers=4, shards=4)


def test_fifo_plans_go_in_list_order():
    profile = uniform_profile([10, 10, 10], [1.0, 1.0, 1.0])
    plan = make_planner("wfbp")(profile, CLUSTER)
    assert send_order(plan, profile, lambda n: 5.0) == (0, 1, 2)


def test_priority_sends_front_layers_first_once_the_sender_is_free():
    # Backward order: layer 0 ready at 1 s, layer 1 at 2 s, layer 2 (the front) at 3 s.
    profile = uniform_profile([10, 10, 10], [1.0, 1.0, 1.0])
    plan = make_planner("priority", slice_elements=5)(profile, CLUSTER)
    # Two slices per layer. A slice keeps the sender busy 1.5 s: at 1 s slice 0 leaves (only one
    # ready), at 2.5 s layer 1 is ready and more urgent than layer 0's second slice, at 4 s the
    # front layer is ready and goes first; layer 0's second slice goes last.
    order = send_order(plan, profile, lambda n: 1.5)
    assert order == (0, 2, 4, 5, 3, 1)


def test_after_backward_groups_are_all_ready_at_the_end():
    profile = uniform_profile([10, 10], [1.0, 2.0])
    plan = make_planner("default")(profile, CLUSTER)
    assert list(group_ready_times(plan, profile)) == [3.0, 3.0]
