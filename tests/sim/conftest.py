"""Simulations several test modules read, computed once per session (in parallel processes)."""

import pytest

from gradsum.sim.presets import get_preset
from gradsum.sim.scaling import default_processes, sweep

SEED_MODELS = ("resnet18", "vgg16", "alexnet", "resnet50")
SEED_POLICIES = ("default", "wfbp", "fusion", "mgwfbp", "priority", "merge", "imerge")


@pytest.fixture(scope="session")
def seed_table():
    """``imerge-seed`` at 32 workers: every model and policy, by (model, policy)."""
    rows = sweep(
        get_preset("imerge-seed"),
        SEED_MODELS,
        [32],
        SEED_POLICIES,
        processes=default_processes(),
    )
    return {(r["model"], r["policy"]): r for r in rows}


@pytest.fixture(scope="session")
def fit_table():
    """``imerge-seed-fit`` scored: the five scored policies at 1 and 32 workers (40 runs)."""
    from gradsum.sim.score import scored_rows

    return scored_rows(get_preset("imerge-seed-fit"), processes=default_processes())
