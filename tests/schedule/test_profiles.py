import pytest
import torch

from gradsum.schedule.costs import fit_alpha_beta
from gradsum.schedule.profile import ModelProfile, uniform_profile
from gradsum.schedule.profiling import analytic_profile, measure_profile, parameter_layers
from gradsum.train.models import build_model


def test_measured_profile_covers_every_parameter_in_backward_order():
    torch.manual_seed(0)
    model = build_model("digits-cnn")
    profile = measure_profile(model, torch.randn(16, 64), warmup=1, iterations=2)
    assert profile.total_params == sum(p.numel() for p in model.parameters())
    indices = sorted(i for layer in profile.layers for i in layer.param_indices)
    assert indices == list(range(len(list(model.parameters()))))
    # Backward reaches the classifier first and the first convolution last.
    assert profile.layers[0].name == "classifier"
    assert profile.layers[-1].name == "features.0"
    assert all(layer.backward_s >= 0 and layer.forward_s >= 0 for layer in profile.layers)
    assert profile.compute_s > 0


def test_analytic_profile_scales_with_device_speed_and_batch():
    model = build_model("digits-mlp")
    slow = analytic_profile(model, (64,), flops_per_s=1e9, batch_size=8)
    fast = analytic_profile(model, (64,), flops_per_s=4e9, batch_size=8)
    big = analytic_profile(model, (64,), flops_per_s=1e9, batch_size=16)
    assert slow.compute_s == pytest.approx(4 * fast.compute_s)
    assert big.compute_s == pytest.approx(2 * slow.compute_s)
    # 64→128 then 128→10: forward FLOPs per sample are 2·64·128 and 2·128·10.
    assert [layer.name for layer in slow.layers] == ["net.2", "net.0"]
    assert slow.layers[1].forward_s == pytest.approx(2 * 64 * 128 * 8 / 1e9)
    assert slow.layers[1].backward_s == pytest.approx(2 * slow.layers[1].forward_s)


def test_analytic_profile_orders_resnet_layers_backward():
    profile = analytic_profile(build_model("resnet18"), (3, 32, 32), flops_per_s=1e12, batch_size=1)
    assert profile.layers[0].name == "linear"
    assert profile.layers[-1].name in {"conv1", "bn1"}
    assert len(profile.layers) == len(parameter_layers(build_model("resnet18")))


def test_profile_round_trips_through_json(tmp_path):
    profile = uniform_profile([10, 20, 30], [0.1, 0.2, 0.3], [0.01, 0.02, 0.03])
    path = tmp_path / "profile.json"
    profile.save(path)
    assert ModelProfile.load(path) == profile


def test_profile_rejects_empty_layers():
    with pytest.raises(ValueError):
        uniform_profile([0], [0.1])


def test_alpha_beta_fit_recovers_a_line_from_noisy_samples():
    rng = torch.Generator().manual_seed(1)
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7] * 4
    noise = (torch.rand(len(sizes), generator=rng) - 0.5) * 1e-6
    samples = [(m, 50e-6 + m / 1e9 + float(e)) for m, e in zip(sizes, noise, strict=True)]
    fit = fit_alpha_beta(samples)
    assert fit.alpha == pytest.approx(50e-6, abs=2e-6)
    assert fit.beta == pytest.approx(1e-9, rel=1e-3)
    assert fit.time(1e6) == pytest.approx(50e-6 + 1e-3, rel=1e-3)


def test_alpha_beta_fit_needs_two_sizes():
    with pytest.raises(ValueError):
        fit_alpha_beta([(100, 1.0), (100, 1.1)])


def test_a_per_tensor_profile_keeps_every_ready_time_and_the_compute():
    model = build_model("resnet18")
    layers = analytic_profile(model, (3, 32, 32), flops_per_s=1e12, batch_size=8)
    sizes = [p.numel() for p in model.parameters()]
    tensors = layers.per_tensor(sizes)
    assert len(tensors.layers) == len(sizes)
    assert sorted(i for t in tensors.layers for i in t.param_indices) == list(range(len(sizes)))
    assert tensors.total_params == layers.total_params
    assert tensors.compute_s == pytest.approx(layers.compute_s)
    # every layer's tensors are ready when the layer is: the same set of ready times
    assert set(tensors.ready_times().round(12)) == set(layers.ready_times().round(12))
    bn = next(t for t in layers.layers if len(t.param_indices) == 2)
    apart = [t for t in tensors.layers if t.param_indices[0] in bn.param_indices]
    assert [t.params for t in apart] == [sizes[i] for i in sorted(bn.param_indices)]
    with pytest.raises(ValueError, match="do not add up"):
        layers.per_tensor([1] * len(sizes))
