"""A counting shim around the places where torch code reads a tensor's value on the host.

On a GPU each of these waits for the device to catch up (a host sync): ``.item()``,
``.tolist()``, ``.numpy()``, ``.cpu()`` / ``.to("cpu")``, ``bool()`` / ``float()`` / ``int()``
of a tensor, ``torch.equal``, and the ops whose output size depends on values (``nonzero``,
``masked_select``, ``unique``, indexing with a boolean mask). On the CPU nothing waits, so a
test there patches these entry points and records every call: code that makes none of them on
the CPU makes none on a GPU either, where the same torch path runs.

The one exemption is ``codecs.base.draw_uniform``'s CPU branch, which fills its buffer through a
numpy view (numpy's generator, CPU only); devices draw with torch's generator instead.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator

import torch

_EXEMPT = {"draw_uniform"}  # the CPU-only numpy fill of random draws (see the docstring)

_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__",
            "__array__", "nonzero", "masked_select", "unique")  # fmt: skip
_FUNCTIONS = ("equal", "allclose", "nonzero", "masked_select", "unique", "is_nonzero")


def _is_cpu(target) -> bool:
    if isinstance(target, str):
        return target.startswith("cpu")
    return isinstance(target, torch.device) and target.type == "cpu"


class SyncCounter:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.paused = 0

    def record(self, name: str) -> None:
        if self.paused or sys._getframe(2).f_code.co_name in _EXEMPT:
            return
        site = traceback.extract_stack(limit=3)[0]  # [caller, wrapper, record]
        self.calls.append(f"{name} at {site.filename}:{site.lineno} ({site.name})")

    @property
    def count(self) -> int:
        return len(self.calls)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Patch every sync point for the duration; yields the counter of calls made."""
    counter = SyncCounter()
    saved: list[tuple[object, str, object]] = []

    def patch(owner, name: str, check=None) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if check is None or check(args, kwargs):
                counter.record(f"{getattr(owner, '__name__', owner)}.{name}")
            counter.paused += 1  # what the original calls internally is not counted again
            try:
                return original(*args, **kwargs)
            finally:
                counter.paused -= 1

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    for name in _METHODS:
        patch(torch.Tensor, name)
    for name in _FUNCTIONS:
        patch(torch, name)
    patch(torch.Tensor, "to", lambda args, kwargs: any(
        _is_cpu(a) for a in (*args[1:], kwargs.get("device"))))  # fmt: skip
    patch(torch.Tensor, "__getitem__", lambda args, kwargs: isinstance(args[1], torch.Tensor)
          and args[1].dtype == torch.bool)  # fmt: skip
    try:
        yield counter
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
