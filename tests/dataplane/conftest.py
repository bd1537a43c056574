"""Every data plane test runs against both slot pool implementations: the C pools of integer
jobs (``native_pool``) and slots.py's ``SlotPool`` everywhere."""

import pytest

from gradsum.dataplane import native_pool


@pytest.fixture(autouse=True, params=["native-pools", "python-pools"])
def pools(request, monkeypatch):
    if request.param == "python-pools":
        monkeypatch.setattr(native_pool, "_pool", None)
    elif native_pool._pool is None:
        pytest.skip("the _pool extension is not built")
    return request.param
