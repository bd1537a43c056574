"""Every data plane test that builds a slot pool runs against both implementations: the C pools
of integer jobs (``native_pool``) and slots.py's ``SlotPool`` everywhere.

Pools are built only by a ``DataPlane`` registering a job, so a test is run twice when its code
names ``DataPlane``, itself or through functions of these tests it calls by name (``switch_with``,
``one_switch``) or defines inside it (hypothesis' checks). The other tests (lanes, streams, round
trips, pipelines) run once, and fail should one of them register a job after all: then the rule
above missed how it builds its pool."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from gradsum.dataplane import DataPlane, native_pool

POOLS = ["native-pools", "python-pools"]
HERE = Path(__file__).parent


def pytest_generate_tests(metafunc):
    if builds_a_pool(metafunc.function):
        metafunc.parametrize("pools", POOLS, indirect=True)


def builds_a_pool(function, seen: set | None = None) -> bool:
    seen = set() if seen is None else seen
    inner = getattr(getattr(function, "hypothesis", None), "inner_test", None)
    function = inspect.unwrap(inner or function)
    if function.__code__ in seen:
        return False
    seen.add(function.__code__)
    for name in _names(function.__code__):
        value = function.__globals__.get(name)
        if value is DataPlane:
            return True
        if inspect.isfunction(value) and _of_these_tests(value) and builds_a_pool(value, seen):
            return True
    return False


def _names(code):
    yield from code.co_names
    for constant in code.co_consts:
        if inspect.iscode(constant):
            yield from _names(constant)


def _of_these_tests(function) -> bool:
    return Path(function.__code__.co_filename).resolve().is_relative_to(HERE.resolve())


@pytest.fixture(autouse=True)
def pools(request, monkeypatch):
    which = getattr(request, "param", None)
    if which is None:
        monkeypatch.setattr(native_pool, "serves", _unparametrised(request.node.nodeid))
    elif which == "python-pools":
        monkeypatch.setattr(native_pool, "_pool", None)
    elif native_pool._pool is None:
        pytest.skip("the _pool extension is not built")
    return which


def _unparametrised(test: str):
    def serves(spec):
        pytest.fail(
            f"{test} registers a job (builds a slot pool) but is not run against both pool "
            "implementations: see how tests/dataplane/conftest.py finds the tests that build one"
        )

    return serves
