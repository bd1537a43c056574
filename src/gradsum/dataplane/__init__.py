"""The aggregation data plane, sans-IO: packets, slot pools, aggregator ops, the worker protocol.

Nothing in this package opens a socket or reads a clock; ``gradsum.net`` wraps it in UDP daemons
and a worker client, and tests drive it directly or through an in-memory network.

The names below load on first use (PEP 562): a switch needs the packets, slot pools and integer
ops, not the worker's collective, which loads torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_HOMES = {
    "Drop": "actions",
    "Send": "actions",
    "Store": "actions",
    "DataPlane": "plane",
    "Profile": "plane",
    "server_profile": "plane",
    "switch_profile": "plane",
    "Collective": "collective",
    "JobHandle": "collective",
    "DecodeSumEncode": "jobspec",
    "FloatSum": "jobspec",
    "IntegerSum": "jobspec",
    "JobSpec": "jobspec",
    "ParentLink": "jobspec",
    "SpecError": "jobspec",
    "HEADER_SIZE": "packet",
    "Flag": "packet",
    "Header": "packet",
    "Kind": "packet",
    "MalformedPacket": "packet",
    "Op": "packet",
    "parse_header": "packet",
    "Transfer": "transfer",
    "AggregationTimeout": "stream",
    "ChunkStream": "stream",
    "RetryPolicy": "stream",
    "StaleChunkError": "stream",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
