"""Aggregation services a local job needs, started on loopback and stopped afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .loop import TrainConfig


@contextlib.contextmanager
def local_services(config: TrainConfig) -> Iterator[dict]:
    """Yield the address overrides workers need (``switch``/``servers``); start what is missing:
    one switch, or one parameter server per worker (colocated shards, the seeds' 1:1 setup)."""
    needs_switch = config.aggregator == "switch" and not config.switch
    needs_servers = config.aggregator == "ps" and not config.servers
    if not (needs_switch or needs_servers):
        yield {}
        return
    from ..net.loopback import DaemonProcess

    kind = "switch" if needs_switch else "server"
    count = 1 if needs_switch else config.workers
    with contextlib.ExitStack() as stack:
        daemons = [
            stack.enter_context(DaemonProcess(kind, startup_timeout=config.timeout))
            for _ in range(count)
        ]
        addresses = [f"{host}:{port}" for host, port in (d.address for d in daemons)]
        yield {"switch": addresses[0]} if needs_switch else {"servers": addresses}
