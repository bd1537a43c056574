"""Build a :class:`ModelProfile` from a real torch model: measured with hooks, or analytically.

Measured: forward hooks time stamp the end of every layer's forward, post-accumulate-grad hooks time
stamp when every parameter's gradient lands; a layer's time is the gap since the previous stamp, so
parameter-free work (activations, pooling) is charged to the next layer that has parameters — which
is what a scheduler needs, since it only sees gradient-ready events. Warm-up iterations are
discarded, the rest averaged. On CUDA each stamp synchronises the device first.

Analytic: per-layer FLOPs from one batch-1 forward pass (shapes only matter), forward time = FLOPs
× batch / device speed, backward = 2 × forward (input and weight gradients). Use it when nothing can
be measured, e.g. to stand in for a K80 in the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from .profile import LayerProfile, ModelProfile

BACKWARD_TO_FORWARD = 2.0


def parameter_layers(model: nn.Module) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """(name, module, parameter indices) for every module that owns parameters directly."""
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    layers = []
    for name, module in model.named_modules():
        own = [index_of[id(p)] for p in module.parameters(recurse=False) if id(p) in index_of]
        if own:
            layers.append((name or type(module).__name__, module, tuple(own)))
    return layers


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_profile(
    model: nn.Module,
    example_input: torch.Tensor,
    *,
    model_name: str = "model",
    warmup: int = 2,
    iterations: int = 5,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> ModelProfile:
    """Time every layer's forward and backward on whatever device ``example_input`` lives on."""
    if iterations < 1 or warmup < 0:
        raise ValueError("iterations must be >= 1 and warmup >= 0")
    device = example_input.device
    loss_fn = loss_fn or (lambda out: out.float().square().mean())
    layers = parameter_layers(model)
    params = list(model.parameters())
    layer_of_param = {i: k for k, (_, _, indices) in enumerate(layers) for i in indices}
    forward_end: dict[int, float] = {}
    grad_ready: dict[int, float] = {}

    def on_forward(k: int):
        def hook(_module, _inputs, _output):
            if k not in forward_end:
                _synchronise(device)
                forward_end[k] = time.perf_counter()

        return hook

    def on_grad(k: int):
        def hook(_param):
            _synchronise(device)
            grad_ready[k] = time.perf_counter()  # the last tensor of a layer wins

        return hook

    handles = [
        module.register_forward_hook(on_forward(k)) for k, (_, module, _) in enumerate(layers)
    ]
    handles += [
        params[i].register_post_accumulate_grad_hook(on_grad(layer_of_param[i]))
        for i in layer_of_param
    ]
    forward_samples, backward_samples = [], []
    try:
        for step in range(warmup + iterations):
            forward_end.clear()
            grad_ready.clear()
            model.zero_grad(set_to_none=True)
            _synchronise(device)
            start = time.perf_counter()
            loss = loss_fn(model(example_input))
            _synchronise(device)
            backward_start = time.perf_counter()
            loss.backward()
            if step >= warmup:
                forward_samples.append(_relative(forward_end, start))
                backward_samples.append(_relative(grad_ready, backward_start))
    finally:
        for handle in handles:
            handle.remove()
    return _assemble(
        layers,
        forward_samples,
        backward_samples,
        model_name,
        example_input.shape[0],
        f"measured on {device}",
    )


def _relative(stamps: dict[int, float], origin: float) -> dict[int, float]:
    return {k: stamp - origin for k, stamp in stamps.items()}


def _mean_stamps(samples: list[dict[int, float]], count: int) -> dict[int, float]:
    """Average time stamp per layer; a layer missing from a sample never ran and is dropped."""
    seen = [k for k in range(count) if all(k in sample for sample in samples)]
    return {k: sum(sample[k] for sample in samples) / len(samples) for k in seen}


def _durations(mean_stamps: dict[int, float]) -> tuple[list[int], dict[int, float]]:
    """Layers in stamp order and each one's gap since the previous stamp."""
    order = sorted(mean_stamps, key=mean_stamps.__getitem__)
    durations, previous = {}, 0.0
    for k in order:
        durations[k] = max(mean_stamps[k] - previous, 0.0)
        previous = max(previous, mean_stamps[k])
    return order, durations


def _assemble(layers, forward_samples, backward_samples, model_name, batch, source):
    _, forward = _durations(_mean_stamps(forward_samples, len(layers)))
    order, backward = _durations(_mean_stamps(backward_samples, len(layers)))
    profiled = tuple(
        LayerProfile(
            layers[k][0],
            sum(p.numel() for p in layers[k][1].parameters(recurse=False)),
            backward[k],
            forward.get(k, 0.0),
            layers[k][2],
        )
        for k in order
    )
    return ModelProfile(model_name, profiled, int(batch), source)


def layer_flops(module: nn.Module, inputs: tuple, output: torch.Tensor) -> float:
    """Forward FLOPs of one sample through a parameterised layer (multiply-add = 2 FLOPs)."""
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        per_output = 2.0 * module.in_channels // module.groups * kh * kw
        return per_output * output[0].numel()
    if isinstance(module, nn.Linear):
        return 2.0 * module.in_features * output[0].numel()
    # Normalisation and other element-wise layers: a few FLOPs per element.
    return 4.0 * output[0].numel()


def analytic_profile(
    model: nn.Module,
    sample_shape: tuple[int, ...],
    *,
    flops_per_s: float,
    batch_size: int,
    model_name: str = "model",
    layer_overhead_s: float = 0.0,
) -> ModelProfile:
    """Per-layer times from FLOP shares: forward = FLOPs·batch/speed (+ overhead), backward = 2×."""
    if flops_per_s <= 0 or batch_size < 1:
        raise ValueError("flops_per_s must be positive and batch_size at least 1")
    layers = parameter_layers(model)
    flops: dict[int, float] = {}
    order: list[int] = []

    def count(k: int):
        def hook(module, inputs, output):
            if k not in flops:
                flops[k] = layer_flops(module, inputs, output)
                order.append(k)

        return hook

    handles = [module.register_forward_hook(count(k)) for k, (_, module, _) in enumerate(layers)]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(torch.zeros((1, *sample_shape)))
        model.train(was_training)
    finally:
        for handle in handles:
            handle.remove()
    profiled = []
    for k in reversed(order):  # backward order is the reverse of execution order
        forward_s = flops[k] * batch_size / flops_per_s + layer_overhead_s
        name, module, indices = layers[k]
        params = sum(p.numel() for p in module.parameters(recurse=False))
        profiled.append(
            LayerProfile(name, params, BACKWARD_TO_FORWARD * forward_s, forward_s, indices)
        )
    source = f"analytic @ {flops_per_s:.3g} FLOP/s"
    notes = {"forward_flops_per_sample": sum(flops.values())}
    return ModelProfile(model_name, tuple(profiled), batch_size, source, notes)
