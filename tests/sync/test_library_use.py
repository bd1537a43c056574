"""gradsum from one's own code: replicas that start alike, a codec sized from the process group,
state that saves with torch.save, and aggregators and Sessions that close as context managers."""

import io

import pytest
import torch
import torch.distributed as dist

from gradsum.codecs import make_codec
from gradsum.sync.allreduce import AllReduceAggregator
from gradsum.sync.ddp_hook import GradsumHookState
from gradsum.sync.gradient_sync import GradientSync
from gradsum.sync.session import Session

from .distributed import run_distributed
from .fakes import Alone, Answering, Reducing


def _seeded_apart(rank, world):
    torch.manual_seed(100 + rank)  # each rank its own initial weights
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3).to(torch.float64))
    mine = [p.detach().clone() for p in model.parameters()]
    codec = make_codec("thc")  # workers from the process group
    with Session(codec, AllReduceAggregator()) as session:
        sync = GradientSync(model, session)
        started = [p.detach().clone() for p in model.parameters()]
        loss = model[1](model[0](torch.randn(4, 6)).to(torch.float64)).square().sum()
        loss.backward()
        sync.wait()
        sync.close()
    return codec.workers, mine, started, [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_gradient_sync_starts_every_replica_from_rank_0s_parameters():
    (w0, mine0, started0, _), (w1, mine1, started1, _) = run_distributed(_seeded_apart, 2)
    assert (w0, w1) == (2, 2)
    assert not torch.equal(mine0[0], mine1[0])  # they did start apart
    for a, b, zero in zip(started0, started1, mine0, strict=True):
        assert torch.equal(a, b) and torch.equal(a, zero) and a.dtype == zero.dtype


def test_a_session_refuses_a_codec_sized_for_fewer_workers_than_the_aggregator_has():
    aggregator = Answering(lambda flat, **_: flat, world=4)
    with pytest.raises(ValueError, match=r"built for 1 worker.*has 4.*workers=4"):
        Session(make_codec("thc", workers=1), aggregator)
    Session(make_codec("thc", workers=4), aggregator)


def test_make_codec_takes_its_workers_from_the_process_group(request):
    assert make_codec("thc").workers == 1  # no process group
    request.getfixturevalue("gloo_world_of_one")
    assert make_codec("bfp").workers == dist.get_world_size()


def test_the_hook_state_round_trips_through_torch_save():
    def session():
        return Session(make_codec("thc", workers=1, error_feedback=True), Reducing(Alone))

    state = GradsumHookState(session(), start_step=2, step=7)
    state.session.synchronize(torch.randn(3000, generator=torch.Generator().manual_seed(0)),
                              key="b", step=7)  # fmt: skip
    saved = io.BytesIO()
    torch.save(state.state_dict(), saved)
    saved.seek(0)
    restored = GradsumHookState(session())
    restored.load_state_dict(torch.load(saved, weights_only=False))
    assert (restored.step, restored.start_step) == (7, 2)
    memory, back = state.session.codec.state_dict(), restored.session.codec.state_dict()
    assert memory and _flat(memory) and all(
        torch.equal(a, b) for a, b in zip(_flat(memory), _flat(back), strict=True)
    )
    assert any(t.abs().sum() > 0 for t in _flat(back))  # a memory, not zeros
    with pytest.raises(TypeError, match="state_dict"):
        torch.save(state, io.BytesIO())


def _flat(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for key in sorted(state, key=str) for t in _flat(state[key])]
    if isinstance(state, list | tuple):
        return [t for item in state for t in _flat(item)]
    return []


def test_aggregators_and_sessions_close_as_context_managers():
    closed = []

    class Closing(Answering):
        def close(self):
            closed.append(self)

    with Closing(lambda flat, **_: flat) as aggregator:
        pass
    assert closed == [aggregator]
    with Session(make_codec("none"), Closing(lambda flat, **_: flat)) as session:
        pass
    assert closed[-1] is session.aggregator and len(closed) == 2


def test_an_error_inside_the_ddp_hook_reaches_backward_with_its_type_and_message(
    gloo_world_of_one,
):
    from gradsum.sync.ddp_hook import gradsum_hook

    def refuse(flat, **_):
        raise TimeoutError("timed out after 3 s waiting for the switch")

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    state = GradsumHookState(Session(make_codec("none"), Answering(refuse)))
    model.register_comm_hook(state, gradsum_hook)
    with pytest.raises(RuntimeError) as raised:
        model(torch.randn(2, 4)).sum().backward()
    state.close()
    assert "TimeoutError: timed out after 3 s waiting for the switch" in str(raised.value)
    assert "Unable to cast" not in str(raised.value)
