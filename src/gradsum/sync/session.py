"""One run's gradient exchange on one worker: its codec, its aggregator's channel, its round.

    session = Session(make_codec("thc", workers=world), AllReduceAggregator(), seed=0)
    average = session.synchronize(flat, key="bucket", step=step)

A worker builds one Session per run, from the codec it built once and the aggregator it
connected to. The Session computes the job's wire format once (the codec's lanes, or for a
codec a parameter server decodes, its name, ``options`` and ``seed``, from which the server
builds its own copy), connects it to the aggregator once, and fixes the round's options (seed,
partition size). Everything below it (the DDP hook, ``GradientSync``, the senders, the
aggregator's channel, the transport) is handed what it needs and never builds a codec, a wire
format or a job of its own.

``uncompressed()`` is the Session of the aggregator's lossless codec (fp32, or bfp on a switch)
for warm-up steps and retried steps: built, and connected, the first time a step needs it, and
the same one after that.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import torch

from ..codecs import Codec, make_codec
from ..codecs.round import PARTITION_ELEMENTS, CodecRound
from ..dataplane.codec_wire import wire_format
from .aggregator import Aggregator


class Session:
    def __init__(self, codec: Codec, aggregator: Aggregator, *, options: dict | None = None,
                 seed: int = 0, partition_elements: int = PARTITION_ELEMENTS):  # fmt: skip
        """``options``: the codec's options as it was built with them (a decoding server
        builds its copy from its name and these); ``partition_elements``: the round's
        partition size, where the transport can carry one that large."""
        if codec.workers < aggregator.world_size:
            raise ValueError(
                f"the codec {codec.name!r} was built for {codec.workers} worker(s), and the "
                f"aggregator has {aggregator.world_size}: its sums would overflow; build it with "
                f"make_codec({codec.name!r}, workers={aggregator.world_size}) (or leave workers "
                "out where a process group is initialized)"
            )
        self.codec = codec
        self.aggregator = aggregator
        self.seed = seed
        self.partition_elements = partition_elements
        self.wire = wire_format(codec, options, seed)
        self.channel = aggregator.connect(self.wire)
        self.round = CodecRound(codec, seed, self.channel.partition_size(partition_elements))
        self._lossless: Session | None = None
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.aggregator.rank

    @property
    def shards(self) -> int:
        """The shards a plan can address one by one (0: none, see ``Channel``)."""
        return self.channel.shards

    def describe(self, key: Hashable, shapes: Sequence[tuple[int, ...]]) -> None:
        """The tensors the flat buffers of ``key`` hold, for codecs that work per tensor."""
        self.codec.describe(key, shapes)

    def synchronize(self, flat: torch.Tensor, *, key: Hashable, step: int) -> torch.Tensor:
        """The average over workers of ``flat`` (1-D float32), as the codec estimates it."""
        return self.channel.run(self.round, flat, worker=self.rank, key=key, step=step)

    def synchronize_many(self, flats: Sequence[torch.Tensor], *, keys: Sequence[Hashable],
                         step: int) -> list[torch.Tensor]:  # fmt: skip
        """The averages of several gradients (``keys`` theirs) at once: one batched round where
        the codec batches a step, each ``synchronize``'s values. Every worker must call it with
        the same gradients, in the same order (a deterministic release, never one that depends
        on which gradients happened to be ready)."""
        return self.channel.run_many(self.round, flats, worker=self.rank, keys=keys, step=step)

    def part(self, shard: int, flat: torch.Tensor, *, key: Hashable, step: int) -> torch.Tensor:
        """The same round as ``synchronize``, aggregated on ``shard`` alone (a plan's part)."""
        return self.channel.run(self.round, flat, worker=self.rank, key=key, step=step,
                                shard=shard)  # fmt: skip

    def state_dict(self) -> dict:
        """The codec's state (error feedback, PowerSGD's factors): what a checkpoint keeps.
        The lossless Session keeps none."""
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.codec.load_state_dict(state["codec"])

    def close(self) -> None:
        """Close the aggregator (its jobs torn down on a service, its sockets and threads)."""
        self.aggregator.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def uncompressed(self) -> Session:
        """The Session of the aggregator's lossless codec, with this one's round options. Every
        worker asks for it at the same step (a service registers its job then)."""
        with self._lock:
            if self._lossless is None:
                name = self.aggregator.lossless_codec_name()
                lossless = make_codec(name, workers=self.codec.workers)
                self._lossless = Session(lossless, self.aggregator, seed=self.seed,
                                         partition_elements=self.partition_elements)  # fmt: skip
            return self._lossless
