"""The GPU path on a real device: codec rounds against the CPU, no host sync in a THC round,
the fused kernels against the torch path, and gradient sync with streams (a side-stream
backward, channels-last weights, the DDP hook and GradientSync over 2 ranks)."""

import os

import pytest
import torch

from gradsum.codecs import CODEC_NAMES, make_codec, nmse, run_round
from gradsum.codecs.base import DeviceChecks
from gradsum.codecs.round import PARTITION_ELEMENTS, CodecRound

from ..codecs.test_host_syncs import OneWorker
from ..sync.distributed import run_distributed

CUDA = torch.device("cuda")
LENGTH = PARTITION_ELEMENTS + 12_345


def inputs(workers: int, length: int, device) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(length, generator=generator).to(device) for _ in range(workers)]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_estimates_on_the_gpu_as_on_the_cpu(name):
    """Different random streams (numpy's on the CPU, torch's on the GPU): the same error."""
    errors = {}
    for device in ("cpu", "cuda"):
        xs = inputs(4, LENGTH, device)
        result = run_round(make_codec(name, workers=4), xs, seed=1)
        assert result.average.device.type == device
        errors[device] = nmse(result.average.cpu(), [x.cpu() for x in xs])
    assert errors["cuda"] == pytest.approx(errors["cpu"], rel=0.1, abs=1e-6)


@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
def test_a_thc_round_makes_no_host_sync_on_the_gpu(name):
    round_ = CodecRound(make_codec(name, workers=1), seed=3)
    xs = inputs(2, LENGTH, CUDA)
    round_.run(xs[0], OneWorker(), worker=0, key="b", step=0)  # tables, rotations
    torch.cuda.synchronize()
    checks = DeviceChecks()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_.run(xs[1], OneWorker(), worker=0, key="b", step=1, checks=checks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    checks.raise_if_failed()


def test_the_fused_kernels_give_the_torch_paths_rounds(monkeypatch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":  # tests/codecs/test_triton.py in this process
        pytest.skip("the kernels would run interpreted: run tests/gpu in a process of its own")
    averages = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("GRADSUM_TRITON", fused)
        codec = make_codec("thc", workers=4)
        xs = inputs(4, 3 * PARTITION_ELEMENTS + 12_345, CUDA)
        averages[fused] = [run_round(codec, xs, step=s, seed=2).average for s in range(2)]
    for fused, plain in zip(averages["1"], averages["0"], strict=True):
        assert torch.equal(fused, plain)


def _gpt_like_groups() -> list[int]:
    """Gradients of a small GPT's group sizes: one of ten partitions, the others under one."""
    return [9_649_344, 196_608, 111_168, 37_440, 148_224, 148_032, 384]


def test_a_batched_step_on_the_gpu_is_every_gradients_round():
    """thc.step on the compiled kernels (tests/codecs/test_step.py runs them interpreted): a
    step of ragged gradients gives each gradient's round, bit for bit, memory carried."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels would run interpreted: run tests/gpu in a process of its own")
    from gradsum.codecs.round import run_step_round
    from gradsum.codecs.thc.step import StepRound

    sizes = _gpt_like_groups()
    batched, reference = (make_codec("thc", workers=2, error_feedback=True) for _ in range(2))
    for step in range(2):
        generator = torch.Generator(device=CUDA).manual_seed(step)
        grads = [[torch.randn(n, generator=generator, device=CUDA) for n in sizes]
                 for _ in range(2)]  # fmt: skip
        assert StepRound.build(batched, grads[0], worker=0, keys=range(len(sizes)),
                               step=step) is not None  # fmt: skip
        got = run_step_round(batched, grads, step=step)
        for key, average in enumerate(got):
            want = run_round(reference, [w[key] for w in grads], step=step, key=key).average
            assert torch.equal(average, want), (step, key)


def test_a_captured_step_replays_the_eager_steps_bits():
    """thc.graphs: the step's halves captured as CUDA graphs (not refused) and replayed give
    the eager step's averages and memory, bit for bit."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the kernels would run interpreted: run tests/gpu in a process of its own")
    from gradsum.codecs.round import run_step_round
    from gradsum.codecs.thc.graphs import StepGraph, run_recorded_step

    sizes, keys = _gpt_like_groups(), list(range(7))
    recorded, eager = (make_codec("thc", workers=2, error_feedback=True) for _ in range(2))
    graphs = None
    for step in range(4):  # eager, recorded, replayed twice
        generator = torch.Generator(device=CUDA).manual_seed(step)
        grads = [[torch.randn(n, generator=generator, device=CUDA) for n in sizes]
                 for _ in range(2)]  # fmt: skip
        if graphs is None:
            graphs = [StepGraph(recorded, grads[w], worker=w, keys=keys) for w in range(2)]
        checks = DeviceChecks()
        with checks.deferring():
            got = [g.clone() for g in run_recorded_step(graphs, grads, step)]
        checks.raise_if_failed()
        want = run_step_round(eager, grads, step=step)
        for key, (average, expected) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(average, expected), (step, key)
    assert all(r.graph is not None for r in graphs[0]._recorded.values())  # none refused
    for state_key, memory in eager.memory.items():
        assert torch.equal(recorded.memory[state_key], memory), state_key


def _forward_backward(model, make_input):
    loss = model(make_input()).square().mean()
    for _ in range(20):  # keep the stream busy: a thread that did not wait would read early
        loss = loss + model(make_input()).square().mean() * 0
    loss.backward()


def _one_rank(rank, world, side_stream, channels_last):
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.gradient_sync import GradientSync
    from gradsum.sync.session import Session

    # cuDNN's default convolution backward sums with atomics, so two backward passes differ
    # in the last bits: the reference below must be the same computation as the synced one.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    if channels_last:
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3), torch.nn.Conv2d(64, 8, 3))
        model = model.cuda().to(memory_format=torch.channels_last)

        def make_input():
            return torch.randn(32, 3, 64, 64, device=CUDA).to(memory_format=torch.channels_last)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 8)).cuda()

        def make_input():
            return torch.randn(512, 2048, device=CUDA)

    torch.manual_seed(1)
    sync = GradientSync(model, Session(make_codec("none", workers=1), AllReduceAggregator()))
    try:
        stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            _forward_backward(model, make_input)
        torch.cuda.current_stream().wait_stream(stream)
        sync.wait()
        got = [p.grad.clone() for p in model.parameters()]
    finally:
        sync.close()
    torch.manual_seed(1)
    model.zero_grad()
    _forward_backward(model, make_input)  # no sync: the gradients themselves (one worker)
    # the largest difference (0.0 where every gradient is equal), so a failure shows its size
    return max(
        (a - p.grad).abs().max().item() for a, p in zip(got, model.parameters(), strict=True)
    )


@pytest.mark.parametrize(("side_stream", "channels_last"), [(True, False), (False, True)])
def test_gradient_sync_reads_gradients_only_after_backward_wrote_them(side_stream, channels_last):
    assert run_distributed(_one_rank, 1, side_stream, channels_last, timeout=300) == [0.0]


def _ddp_and_sync(rank, world):
    """Three steps through the DDP hook, then three through GradientSync, THC over all-reduce
    (Gloo with CUDA tensors: two ranks may share one GPU)."""
    from gradsum.sync.allreduce import AllReduceAggregator
    from gradsum.sync.ddp_hook import GradsumHookState, gradsum_hook
    from gradsum.sync.gradient_sync import GradientSync
    from gradsum.sync.session import Session

    torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = GradsumHookState(Session(make_codec("thc", workers=world), AllReduceAggregator()))
    ddp.register_comm_hook(state, gradsum_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch(step):
        generator = torch.Generator(device="cuda").manual_seed(10 * step + rank)
        return torch.randn(64, 256, device="cuda", generator=generator)

    for step in range(3):
        ddp(batch(step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    state.close()
    sync = GradientSync(model, Session(make_codec("thc", workers=world), AllReduceAggregator()))
    for step in range(3, 6):
        model(batch(step)).square().mean().backward()
        sync.wait()
        optimizer.step()
        optimizer.zero_grad()
    sync.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def test_ddp_hook_and_gradient_sync_keep_two_gpu_ranks_identical():
    first, second = run_distributed(_ddp_and_sync, 2, timeout=300)
    assert torch.equal(first, second)
