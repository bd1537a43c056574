"""Emulated clusters on one Linux host: network namespaces joined by shaped, lossy veth links.

``plan`` (pure) turns a ``TestbedSpec`` into the exact namespaces, links, addresses and ``tc``
rules; ``shell`` applies and removes them; ``Testbed`` is the context manager for tests and
benchmarks; ``gloo`` times torch.distributed all-reduce across the testbed's workers.
"""

from .plan import Host, Link, Tc, TestbedPlan, TestbedSpec, plan
from .shell import TestbedError, preflight
from .testbed import Call, RemoteError, Testbed, make_spec

__all__ = [
    "Call",
    "Host",
    "Link",
    "RemoteError",
    "Tc",
    "Testbed",
    "TestbedError",
    "TestbedPlan",
    "TestbedSpec",
    "make_spec",
    "plan",
    "preflight",
]
