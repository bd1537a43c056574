"""The fluid network's two solvers (C and numpy) and its path classes give the per-flow max-min
rates bit for bit."""

import numpy as np
import pytest

from gradsum.sim import fluid
from gradsum.sim.fluid import FluidNetwork, max_min_rates

pytestmark = pytest.mark.slow  # tens of seconds on this shared host
needs_native = pytest.mark.skipif(fluid._maxmin is None, reason="the C solver is not built")


def random_network(rng, flows, resources=140, native=True):
    network = FluidNetwork(rng.uniform(1e9, 1e10, resources))
    network._native = native and network._native
    paths = []
    # Few distinct paths, many flows on each: what a 32-worker run looks like.
    choices = [tuple(rng.choice(resources, rng.integers(1, 5), replace=False)) for _ in range(60)]
    for i in range(flows):
        path = choices[rng.integers(len(choices))]
        paths.append(path + (-1,) * (4 - len(path)))
        network.add(i, path, rng.uniform(1e5, 1e7))
    return network, np.array(paths)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False])
def test_path_classes_give_the_per_flow_rates(native):
    rng = np.random.default_rng(7)
    for flows in (1, 2, 17, 500, 1_500):
        network, paths = random_network(rng, flows, native=native)
        per_flow = max_min_rates(paths, network.capacity)
        assert np.array_equal(network.rates(), per_flow)


@needs_native
def test_native_and_numpy_networks_drain_identically():
    rng = np.random.default_rng(3)
    native, _ = random_network(rng, 800)
    rng = np.random.default_rng(3)
    python, _ = random_network(rng, 800, native=False)
    assert native._native and not python._native
    finished = []
    while len(python):
        step = python.time_to_next_completion()
        assert native.time_to_next_completion() == step
        done = python.advance(step)
        assert native.advance(step) == done
        finished += done
        assert np.array_equal(native.rates(), python.rates())
    assert sorted(finished) == list(range(800)) and not len(native)


@needs_native
def test_native_solver_rejects_a_resource_outside_the_network():
    paths = np.array([[0], [5]], dtype=np.int64).T.copy()  # one slot row, two classes
    with pytest.raises(ValueError, match="crosses resource 5"):
        fluid._maxmin.fill(paths, 1, 2, 2, np.ones(2), np.ones(3), np.empty(2))
