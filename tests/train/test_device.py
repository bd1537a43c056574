"""`--device` of `gradsum train` and of the benches that train (`bench tta`, `bench train`): cuda
when present, cpu as before, a clear error for cuda without CUDA (this machine and CI have
none), and every run of a bench on the device it was given."""

from types import SimpleNamespace

import pytest
import torch

from gradsum.cli import main
from gradsum.devices import resolve_device
from gradsum.train.launch import backend_for
from gradsum.train.loop import TrainConfig, device_of

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")


@no_cuda
def test_device_cuda_without_cuda_is_a_clear_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--device", "cuda", "--epochs", "1"])
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert "gradsum train: error: --device cuda: no CUDA device is available" in message
    assert "use --device cpu" in message


@no_cuda
@pytest.mark.parametrize("bench", ["tta", "train"])
def test_a_bench_asked_for_cuda_without_cuda_says_so_before_it_trains(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", bench, "--device", "cuda", "--max-steps", "1"])
    assert exit_.value.code == 2
    assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_every_run_of_a_bench_trains_on_its_device(monkeypatch):
    """The bug feared: a bench that takes --device but runs its methods on the default."""
    from gradsum.bench import tta
    from gradsum.devices import resolve_device as real

    asked = []
    monkeypatch.setattr("gradsum.devices.resolve_device",
                        lambda device: asked.append(device) or "cuda")  # fmt: skip
    devices = []

    def run_method(name, config, *rest):
        devices.append(config.device)
        return SimpleNamespace(failed=False)

    monkeypatch.setattr(tta, "run_method", run_method)
    monkeypatch.setattr(tta, "_print_row", lambda *args: None)
    monkeypatch.setattr(tta, "format_table", lambda *args: "")
    main(["bench", "tta", "--device", "cuda", "--methods", "ddp,switch:thc", "--seeds", "0,1",
          "--max-steps", "1"])  # fmt: skip
    assert asked == ["cuda"] and devices == ["cuda"] * 4
    assert real("cpu") == "cpu"


@no_cuda
def test_the_default_device_is_the_cpu_without_cuda():
    assert resolve_device(None) == "cpu" == resolve_device("cpu")


def test_cpu_training_keeps_gloo_and_the_cpu():
    config = TrainConfig(device="cpu")
    assert backend_for(config) == "gloo"
    assert device_of(config) == torch.device("cpu")


def test_workers_sharing_a_gpu_use_gloo_which_takes_two_ranks_on_one_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = TrainConfig(device="cuda")
    assert backend_for(config) == backend_for(config, local_workers=2) == "cuda:nccl,cpu:gloo"
    assert backend_for(config, local_workers=3) == "gloo"  # NCCL: "Duplicate GPU detected"
