"""The aggregation data plane, sans-IO: packets, slot pools, aggregator ops, the worker protocol.

Nothing in this package opens a socket or reads a clock; ``gradsum.net`` wraps it in UDP daemons
and a worker client, and tests drive it directly or through an in-memory network.
"""

from .actions import Drop, Send, Store
from .aggregator import Aggregator, Profile, server_profile, switch_profile
from .collective import Collective, JobHandle
from .jobspec import DecodeSumEncode, FloatSum, IntegerSum, JobSpec, ParentLink, SpecError
from .packet import HEADER_SIZE, Flag, Header, Kind, MalformedPacket, Op, parse_header
from .transfer import Transfer
from .worker import AggregationTimeout, ChunkStream, RetryPolicy, StaleChunkError

__all__ = [
    "HEADER_SIZE",
    "AggregationTimeout",
    "Aggregator",
    "ChunkStream",
    "Collective",
    "DecodeSumEncode",
    "Drop",
    "Flag",
    "FloatSum",
    "Header",
    "IntegerSum",
    "JobHandle",
    "JobSpec",
    "Kind",
    "MalformedPacket",
    "Op",
    "ParentLink",
    "Profile",
    "RetryPolicy",
    "Send",
    "SpecError",
    "StaleChunkError",
    "Store",
    "Transfer",
    "parse_header",
    "server_profile",
    "switch_profile",
]
