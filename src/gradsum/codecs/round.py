"""One aggregation round of a codec, run in-process (no transport): tests, benchmarks, examples.

Each phase is a separate function so callers can time or interpose on it; ``run_round`` chains
them in the order a real system does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Codec, CodecContext, Payload, aggregator_context, combine_summaries


@dataclass
class RoundResult:
    average: torch.Tensor  # what every worker decodes
    payloads: list[Payload]  # upstream, one per contributing worker
    aggregate: Payload  # downstream
    shared: torch.Tensor | None  # result of the preliminary round


def worker_contexts(
    workers: int, seed: int = 0, step: int = 0, partition: int = 0
) -> list[CodecContext]:
    return [
        CodecContext(seed=seed, worker=w, step=step, partition=partition) for w in range(workers)
    ]


def prepare(codec: Codec, inputs: Sequence[torch.Tensor], contexts: Sequence[CodecContext]):
    """Precondition every worker's input and run the preliminary round."""
    prepared = [codec.precondition(x, ctx) for x, ctx in zip(inputs, contexts, strict=True)]
    summaries = [codec.summarize(x, ctx) for x, ctx in zip(prepared, contexts, strict=True)]
    return prepared, combine_summaries(summaries)


def run_round(
    codec: Codec,
    inputs: Sequence[torch.Tensor],
    *,
    seed: int = 0,
    step: int = 0,
    partition: int = 0,
    contributors: Sequence[int] | None = None,
) -> RoundResult:
    """Aggregate ``inputs`` (one per worker). ``contributors`` limits which workers' payloads
    reach the aggregator (partial aggregation); all of them take part in the preliminary round."""
    contexts = worker_contexts(len(inputs), seed, step, partition)
    prepared, shared = prepare(codec, inputs, contexts)
    chosen = range(len(inputs)) if contributors is None else contributors
    payloads = [codec.encode(prepared[w], contexts[w], shared) for w in chosen]
    aggregate = codec.aggregate(payloads, aggregator_context(contexts[0]))
    average = codec.decode(aggregate, contexts[0], shared)
    return RoundResult(average, payloads, aggregate, shared)


def nmse(estimate: torch.Tensor, inputs: Sequence[torch.Tensor]) -> float:
    """||estimate - mean||^2 / mean_i ||x_i||^2 (the THC paper's normalisation)."""
    stacked = torch.stack([x.reshape(-1).to(torch.float64) for x in inputs])
    truth = stacked.mean(dim=0)
    error = (estimate.reshape(-1).to(torch.float64) - truth).pow(2).sum()
    scale = stacked.pow(2).sum(dim=1).mean()
    return float(error / scale) if scale > 0 else float(error)
