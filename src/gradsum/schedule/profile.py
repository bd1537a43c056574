"""Per-layer profiles: what a planner knows about a model.

A *layer* is a module that owns parameters directly (a convolution, a BatchNorm, a linear layer):
the unit whose gradients become ready together during backward. A profile lists layers in
**backward order** (the order their gradients become ready), with their parameter count, backward
time and forward time, and the indices of their tensors in ``list(model.parameters())`` so that a
runtime can map a plan back onto the model.

Gradients are laid out, conceptually, as one flat buffer in backward order; a plan's groups and
slices are element ranges of that buffer (see :mod:`gradsum.schedule.plan`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LayerProfile:
    name: str
    params: int
    backward_s: float
    forward_s: float
    param_indices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ValueError(f"layer {self.name!r}: a layer has at least one parameter")
        if self.backward_s < 0 or self.forward_s < 0:
            raise ValueError(f"layer {self.name!r}: times must be non-negative")


@dataclass(frozen=True)
class ModelProfile:
    """Layers in backward order (first entry = first gradient ready = last layer of forward)."""

    model: str
    layers: tuple[LayerProfile, ...]
    batch_size: int = 1
    source: str = "manual"  # "measured on <device>", "analytic @ <flops>", "manual"
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a profile needs at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def params(self) -> np.ndarray:
        return np.array([layer.params for layer in self.layers], dtype=np.int64)

    @property
    def backward_s(self) -> np.ndarray:
        return np.array([layer.backward_s for layer in self.layers], dtype=float)

    @property
    def forward_s(self) -> np.ndarray:
        return np.array([layer.forward_s for layer in self.layers], dtype=float)

    @property
    def offsets(self) -> np.ndarray:
        """Start of each layer in the backward-order flat buffer, plus the total at the end."""
        return np.concatenate([[0], np.cumsum(self.params)])

    @property
    def total_params(self) -> int:
        return int(self.params.sum())

    @property
    def compute_s(self) -> float:
        return float(self.backward_s.sum() + self.forward_s.sum())

    def ready_times(self) -> np.ndarray:
        """When each layer's gradient is ready, measured from the start of backward."""
        return np.cumsum(self.backward_s)

    def scaled(self, factor: float) -> ModelProfile:
        """The same profile with every compute time multiplied by ``factor`` (a slower device)."""
        layers = tuple(
            LayerProfile(
                lp.name, lp.params, lp.backward_s * factor, lp.forward_s * factor, lp.param_indices
            )
            for lp in self.layers
        )
        return ModelProfile(self.model, layers, self.batch_size, self.source, dict(self.notes))

    def per_tensor(self, sizes: Sequence[int]) -> ModelProfile:
        """One entry per parameter tensor instead of per layer (``sizes``: element counts of
        ``list(model.parameters())``): what a PS client sends that pushes each gradient as its
        hook hands it over (a weight and its bias apart). A layer's tensors are ready together:
        the first (its lowest parameter index) carries the layer's compute, the others none,
        so the ready times and the compute total are the layer profile's."""
        layers = []
        for lp in self.layers:
            if sum(sizes[i] for i in lp.param_indices) != lp.params:
                raise ValueError(f"layer {lp.name!r}: tensor sizes do not add up to its params")
            for k, i in enumerate(sorted(lp.param_indices)):
                first = k == 0
                layers.append(
                    LayerProfile(
                        f"{lp.name}[{i}]",
                        int(sizes[i]),
                        lp.backward_s if first else 0.0,
                        lp.forward_s if first else 0.0,
                        (i,),
                    )
                )
        return ModelProfile(
            self.model, tuple(layers), self.batch_size, self.source, dict(self.notes)
        )

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "source": self.source,
            "notes": self.notes,
            "layers": [
                asdict(layer) | {"param_indices": list(layer.param_indices)}
                for layer in self.layers
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> ModelProfile:
        layers = tuple(
            LayerProfile(
                str(entry["name"]),
                int(entry["params"]),
                float(entry["backward_s"]),
                float(entry["forward_s"]),
                tuple(int(i) for i in entry.get("param_indices", ())),
            )
            for entry in data["layers"]
        )
        return cls(
            str(data["model"]),
            layers,
            int(data.get("batch_size", 1)),
            str(data.get("source", "manual")),
            dict(data.get("notes", {})),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_json(json.loads(Path(path).read_text()))


def uniform_profile(
    params: list[int], backward_s: list[float], forward_s: list[float] | None = None
) -> ModelProfile:
    """A hand-built profile (backward order) for tests and what-if studies."""
    forward = forward_s if forward_s is not None else [0.0] * len(params)
    layers = tuple(
        LayerProfile(f"layer{i}", int(p), float(b), float(f), (i,))
        for i, (p, b, f) in enumerate(zip(params, backward_s, forward, strict=True))
    )
    return ModelProfile("hand-built", layers)
