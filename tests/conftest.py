"""Settings every test directory shares.

Hypothesis profiles: ``ci`` (``pytest --hypothesis-profile=ci``, what .ci/run passes) draws
the same examples on every run (``derandomize``), so a failure in CI is one anyone can
reproduce, and it gives no deadline (the CI host is shared and its timings are not the code's).
Locally the default profile keeps drawing new examples.
"""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# Fixtures that set GRADSUM_NATIVE themselves (tests/codecs/conftest.py and the codec tests):
# a test using one runs its own path(s) whichever way the suite is run.
PATH_FIXTURES = {"both", "gpu_path", "torch_path"}


def pytest_collection_modifyitems(config, items):
    """Mark ``pins_native`` every test that sets its own path: by one of PATH_FIXTURES, or by a
    ``native`` parameter (["1", "0"]). CI's GRADSUM_NATIVE=0 pass leaves them out: they ran in
    full in the first pass, on the paths they name."""
    for item in items:
        params = getattr(item, "callspec", None)
        if PATH_FIXTURES & set(item.fixturenames) or (params and "native" in params.params):
            item.add_marker(pytest.mark.pins_native)
    if getattr(config.option, "dist", "no") != "no":
        _longest_files_first(items)


# Files whose tests stand alone (no module fixture, nothing one test leaves for the next) and
# that are long enough to keep one worker busy after the others finish: under pytest-xdist
# their tests go one by one to whichever worker is free. Every other file runs whole on one.
SPREAD = {
    "tests/train/test_training.py",
    "tests/train/test_lm.py",
    "tests/sync/test_plans_through_shards.py",
    "tests/codecs/test_step.py",  # interpreted kernels: a minute on one worker, whole
}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, but the files in SPREAD test by test. A file whole on one worker, in
    its own order, keeps what its tests share: a module fixture (a daemon) starts once, and a
    test may read what an earlier one left (tests/net/test_daemon_malformed.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if "testbed" in path:  # network namespaces of fixed names: one testbed at a time
                return "testbed"
            return nodeid if path in SPREAD else path

    return ByFile(config, log)


def _longest_files_first(items) -> None:
    """pytest-xdist hands out work in the order collected: the files with the most slow tests
    first, so that no long file starts last and keeps one worker busy after the others have
    finished. Each file's own order stays."""
    slow, first = {}, {}
    for index, item in enumerate(items):
        path = item.nodeid.split("::")[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
        first.setdefault(path, index)
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-slow[p := item.nodeid.split("::")[0]], first[p], order[id(item)]))


_RETIRED_GROUPS: list = []  # process groups a test ended: destroyed with the interpreter


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """This process as the one rank of a Gloo group, for code that needs a process group.

    The group is taken out of torch.distributed at the end but its object is kept until the
    interpreter exits. Destroyed right after a collective (when its last holder, a DDP
    reducer, goes), ``~ProcessGroupGloo`` waits, holding the GIL, for a Gloo thread that is
    still releasing the finished work's tensors and needs the GIL: a deadlock, or, where that
    thread drops the last reference itself, a self-join that aborts the test process
    ("Resource deadlock avoided"; 2 of 3 loops of 300 such groups, 0 of 1,000 kept)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "gloo-store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        yield
    finally:
        _RETIRED_GROUPS.append(dist.distributed_c10d._get_default_group())
        dist.destroy_process_group()
