"""Local steps with an outer sync (sync/local_steps.py): the bookkeeping against hand-computed
references, and whole runs against plain data parallel training and against themselves resumed."""

from __future__ import annotations

import re

import pytest
import torch

from gradsum.cli import UsageError
from gradsum.sync.local_steps import LocalSteps, OuterState, parse_local_steps
from gradsum.train.config import TrainConfig
from gradsum.train.methods import method_fields, method_name


def _state(weights, spec, lr=0.125, optimizer=torch.optim.SGD, **kwargs):
    return OuterState(weights, spec, lambda acc: optimizer(acc, lr=lr), **kwargs)


def _grads(generator, shapes):
    return [torch.randn(shape, generator=generator) for shape in shapes]


SHAPES = [(3, 4), (5,)]


def test_one_local_step_with_a_plain_outer_step_is_a_data_parallel_step_bit_for_bit():
    """h=1, outer SGD lr 1 without momentum, inner SGD lr 1/8: the averaged pseudo-gradient is
    1/8 of the averaged gradient exactly, so the new weights are SGD's on the average."""
    generator = torch.Generator().manual_seed(0)
    weights = _grads(generator, SHAPES)
    reference = [w.clone() for w in weights]
    workers = [_state([w.clone() for w in weights], LocalSteps(h=1, lr=1.0, momentum=0.0))
               for _ in range(2)]  # fmt: skip
    dp = torch.optim.SGD(reference, lr=0.125)
    for _ in range(3):
        grads = [_grads(generator, SHAPES) for _ in workers]
        pseudo = []
        for state, g in zip(workers, grads, strict=True):
            state.inner_step([x.clone() for x in g])
            assert state.due
            pseudo.append(state.launch([torch.empty_like(w) for w in weights]))
        average = [(a + b) / 2 for a, b in zip(*pseudo, strict=True)]
        for state in workers:
            state.land(average)
        for r, a, b in zip(reference, *grads, strict=True):
            r.grad = (a + b) / 2
        dp.step()
        for state in workers:
            for w, r in zip(state.weights, reference, strict=True):
                assert torch.equal(w, r)


def test_the_outer_step_is_nesterov_sgd_on_the_averaged_sum_of_inner_updates():
    """Two rounds of h=3 with AdamW inside: the pseudo-gradient is start - local (the sum of
    the inner updates), the local weights start + acc, and the outer step Nesterov's
    (buf = m buf + d; start -= lr (d + m buf))."""
    generator = torch.Generator().manual_seed(1)
    weights = _grads(generator, SHAPES)
    spec = LocalSteps(h=3, lr=0.7, momentum=0.9)
    state = _state([w.clone() for w in weights], spec, lr=1e-2, optimizer=torch.optim.AdamW)
    start = [w.clone() for w in weights]
    buffers = None
    for _ in range(2):
        for step in range(spec.h):
            assert not state.due and state.taken == step
            state.inner_step(_grads(generator, SHAPES))
            if not state.due:  # the weights a forward pass sees: start + acc
                for w, s, a in zip(state.weights, state.start, state.acc, strict=True):
                    assert torch.equal(w, s + a)
        local = [s + a for s, a in zip(state.start, state.acc, strict=True)]
        pseudo = state.launch([torch.empty_like(w) for w in weights])
        for d, s, w in zip(pseudo, start, local, strict=True):
            torch.testing.assert_close(d, s - w)
        if buffers is None:
            buffers = pseudo
        else:
            buffers = [0.9 * b + d for b, d in zip(buffers, pseudo, strict=True)]
        start = [s - 0.7 * (d + 0.9 * b) for s, d, b in zip(start, pseudo, buffers, strict=True)]
        state.land(pseudo)
        for w, s in zip(state.weights, start, strict=True):
            torch.testing.assert_close(w, s)
        assert state.taken == 0
        assert all(not a.any() for a in state.acc)
    assert state.rounds == 2


def test_decoupled_weight_decay_applies_to_the_weights_not_the_accumulator():
    """AdamW's decay on the inner accumulators would shrink the round's updates instead of the
    weights: h=2 against torch's AdamW on the weights themselves."""
    generator = torch.Generator().manual_seed(2)
    weights = _grads(generator, SHAPES)
    reference = [w.clone() for w in weights]
    adamw = torch.optim.AdamW(reference, lr=0.1, weight_decay=0.5)
    state = OuterState([w.clone() for w in weights], LocalSteps(h=2),
                       lambda acc: torch.optim.AdamW(acc, lr=0.1, weight_decay=0.5))
    for _ in range(2):
        grads = _grads(generator, SHAPES)
        state.inner_step([g.clone() for g in grads])
        for r, g in zip(reference, grads, strict=True):
            r.grad = g
        adamw.step()
    local = [s + a for s, a in zip(state.start, state.acc, strict=True)]
    for w, r in zip(local, reference, strict=True):
        torch.testing.assert_close(w, r)


def test_the_state_resumes_mid_round_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    weights = _grads(generator, SHAPES)
    spec = LocalSteps(h=3)
    grads = [_grads(generator, SHAPES) for _ in range(8)]

    def run(state, steps):
        for g in steps:
            state.inner_step([x.clone() for x in g])
            if state.due:
                state.land(state.launch([torch.empty_like(w) for w in weights]))

    adamw = torch.optim.AdamW
    whole = _state([w.clone() for w in weights], spec, lr=1e-2, optimizer=adamw)
    run(whole, grads)
    first = _state([w.clone() for w in weights], spec, lr=1e-2, optimizer=adamw)
    run(first, grads[:4])  # one round and one step into the next
    saved = first.state_dict()
    resumed = _state([torch.zeros_like(w) for w in weights], spec, lr=1e-2, optimizer=adamw)
    resumed.load_state_dict(saved)
    run(resumed, grads[4:])
    for mine, theirs in ((resumed.weights, whole.weights), (resumed.start, whole.start)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)
    assert resumed.rounds == whole.rounds == 2


def _drive(states, steps):
    """Workers in lockstep as ``LocalStepsSync.step`` drives each: the inner step, the round in
    flight landing when due, a launch when due (its ``wait`` averages every worker's
    pseudo-gradient in place, as the round does), and without overlap its landing at once."""
    sent = [None] * len(states)

    def arrive():
        average = [torch.stack(ds).mean(0) for ds in zip(*sent, strict=True)]
        for buffers in sent:
            for d, a in zip(buffers, average, strict=True):
                d.copy_(a)

    def land_when_due():
        for state, buffers in zip(states, sent, strict=True):
            if state.landing:
                state.land(None if state.sent is not None else buffers)

    for grads in steps:
        for state, g in zip(states, grads, strict=True):
            state.inner_step([x.clone() for x in g])
        land_when_due()
        if states[0].due:
            for i, state in enumerate(states):
                into = [torch.empty_like(w) for w in state.weights]
                sent[i] = state.launch(into, wait=arrive if i == 0 else None)
        land_when_due()


def _eager_reference(weights, steps, h, tau, lr, outer_lr, momentum):
    """Overlapped DiLoCo written out on plain tensors: SGD inner steps at ``lr``; every h steps
    the average of what each worker's steps since its last launch added is launched and lands
    tau steps later with Nesterov's outer step, each worker's steps since that launch carried
    onto the new start."""
    n = len(steps[0])
    start = [w.clone() for w in weights]
    local = [[w.clone() for w in weights] for _ in range(n)]
    since = [[torch.zeros_like(w) for w in weights] for _ in range(n)]
    pending, buffers, taken = None, None, 0

    def land(average):
        nonlocal buffers
        buffers = average if buffers is None else [
            momentum * b + d for b, d in zip(buffers, average, strict=True)]  # fmt: skip
        for s, d, b in zip(start, average, buffers, strict=True):
            s -= outer_lr * (d + momentum * b) if momentum else outer_lr * d
        for i in range(n):
            local[i] = [s + u for s, u in zip(start, since[i], strict=True)]

    for grads in steps:
        for i in range(n):
            for w, u, g in zip(local[i], since[i], grads[i], strict=True):
                w -= lr * g
                u -= lr * g
        taken += 1
        if pending is not None and taken == tau:
            land(pending)
            pending = None
        if taken == h:
            pending = [-torch.stack(us).mean(0) for us in zip(*since, strict=True)]
            since = [[torch.zeros_like(w) for w in weights] for _ in range(n)]
            taken = 0
            if tau == 0:
                land(pending)
                pending = None
    return start, local


@pytest.mark.parametrize(("h", "tau"), [(3, 0), (3, 1), (3, 3), (1, 1)])
def test_an_overlapped_round_lands_tau_steps_late_and_the_steps_meanwhile_carry_over(h, tau):
    """Two workers, 11 steps: the start and each worker's weights against the eager reference
    above (the round's average lands ``overlap`` steps into the next round, and what the worker
    did since its launch stays on top of the new start)."""
    generator = torch.Generator().manual_seed(5)
    weights = _grads(generator, SHAPES)
    steps = [[_grads(generator, SHAPES) for _ in range(2)] for _ in range(11)]
    spec = LocalSteps(h=h, lr=0.7, momentum=0.5, overlap=tau)
    states = [_state([w.clone() for w in weights], spec) for _ in range(2)]
    _drive(states, steps)
    start, local = _eager_reference(weights, steps, h, tau, 0.125, 0.7, 0.5)
    for state, mine in zip(states, local, strict=True):
        for a, b in zip(state.start, start, strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(state.weights, mine, strict=True):
            torch.testing.assert_close(a, b)
    assert states[0].rounds == (11 - tau) // h


def _resumes_bit_for_bit(shapes, spec, *, steps: int, cut: int, seed: int):
    """One worker (AdamW inside) driven through ``steps`` steps whole, and again saved after
    ``cut`` steps and resumed into a fresh state: its weights and start weights must match the
    whole run's bit for bit. Returns the first weights, the state saved and what it saved."""
    generator = torch.Generator().manual_seed(seed)
    weights = _grads(generator, shapes)
    grads = [[_grads(generator, shapes)] for _ in range(steps)]
    adamw = torch.optim.AdamW
    whole = _state([w.clone() for w in weights], spec, lr=1e-2, optimizer=adamw)
    _drive([whole], grads)
    first = _state([w.clone() for w in weights], spec, lr=1e-2, optimizer=adamw)
    _drive([first], grads[:cut])
    saved = first.state_dict()
    resumed = _state([torch.zeros_like(w) for w in weights], spec, lr=1e-2, optimizer=adamw)
    resumed.load_state_dict(saved)
    _drive([resumed], grads[cut:])
    for mine, theirs in ((resumed.weights, whole.weights), (resumed.start, whole.start)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)
    return weights, first, saved


def test_an_overlapped_round_in_flight_resumes_bit_for_bit():
    """Saved with a round launched and not landed (h=3, overlap 2, after 4 steps): its average,
    the weights it was launched from and the steps since must all carry."""
    spec = LocalSteps(h=3, lr=0.7, momentum=0.5, overlap=2)
    weights, first, saved = _resumes_bit_for_bit(SHAPES, spec, steps=10, cut=4, seed=6)
    assert first.in_flight
    plain = _state([w.clone() for w in weights], LocalSteps(h=3, lr=0.7, momentum=0.5),
                   lr=1e-2, optimizer=torch.optim.AdamW)  # fmt: skip
    with pytest.raises(ValueError, match="same --local-steps overlap"):
        plain.load_state_dict(saved)


class _NonFiniteRounds:
    """A sync whose every round brings back inf for the groups it sends (a codec or a peer
    gone wrong); one group per tensor."""

    def __init__(self, parameters):
        self.parameters, self.groups, self.step = parameters, [[0], [1], [2]], 0

    def release(self, tensors=None, groups=None):
        out = [p.grad for p in self.parameters] if tensors is None else tensors
        for g in range(len(self.groups)) if groups is None else groups:
            for i in self.groups[g]:
                out[i].fill_(float("inf"))

    def wait(self):
        pass

    def uncompressed(self):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_non_finite_average_of_the_landing_fragment_stops_the_run(overlap):
    """The bug it fears: an outer round whose average is not finite lands, and every worker's
    start weights become inf; or the check reads another fragment's tensors than the landing
    one's (here only the landing fragment's are inf: the other fragments' are finite)."""
    from gradsum.sync.local_steps import LocalStepsSync
    from gradsum.train.guard import DivergenceError

    generator = torch.Generator().manual_seed(8)
    weights = [w.requires_grad_() for w in _grads(generator, SHAPES3)]
    sync = _NonFiniteRounds(weights)
    spec = LocalSteps(h=3, lr=1.0, momentum=0.0, overlap=overlap, fragments=3)
    local = LocalStepsSync(sync, spec, lambda acc: torch.optim.SGD(acc, lr=0.125))
    assert local.state.fragments == [[0], [1], [2]]
    with pytest.raises(DivergenceError, match="outer round 1: the averaged pseudo-gradient"):
        for _ in range(1 + overlap):
            for w, g in zip(weights, _grads(generator, SHAPES3), strict=True):
                w.grad = g
            local.step()
    assert all(torch.isfinite(s).all() for s in local.state.start)


SHAPES3 = [(3, 4), (5,), (2, 2)]


def _streaming_reference(weights, steps, h, tau, fragments, outer_lr, momentum, lr=0.125):
    """Streaming DiLoCo written out on plain tensors: SGD inner steps at ``lr``; fragment f's
    tensors launch the average of what each worker's steps since their last launch added after
    (f + 1) h/F steps and every h after, and it lands tau steps later with Nesterov's outer step
    on those tensors only, each worker's steps since that launch carried onto the new start."""
    n, every = len(steps[0]), h // len(fragments)
    start = [w.clone() for w in weights]
    local = [[w.clone() for w in weights] for _ in range(n)]
    since = [[torch.zeros_like(w) for w in weights] for _ in range(n)]
    buffers = [None] * len(weights)
    pending = None  # (fragment, average, landing step)
    rounds = 0

    def land(f, average):
        nonlocal rounds
        for i in fragments[f]:
            d = average[i]
            buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + d
            start[i] -= outer_lr * (d + momentum * buffers[i]) if momentum else outer_lr * d
            for k in range(n):
                local[k][i] = start[i] + since[k][i]
        rounds += 1

    for t, grads in enumerate(steps, start=1):
        for k in range(n):
            for w, u, g in zip(local[k], since[k], grads[k], strict=True):
                w -= lr * g
                u -= lr * g
        if pending is not None and t == pending[2]:
            land(pending[0], pending[1])
            pending = None
        if t % every == 0:
            f = (t // every - 1) % len(fragments)
            average = [-torch.stack([since[k][i] for k in range(n)]).mean(0) for i in
                       range(len(weights))]  # fmt: skip
            for k in range(n):
                for i in fragments[f]:
                    since[k][i] = torch.zeros_like(weights[i])
            pending = (f, average, t + tau)
            if tau == 0:
                land(f, average)
                pending = None
    return start, local, rounds


@pytest.mark.parametrize(("h", "tau", "count"), [(4, 0, 2), (4, 2, 2), (6, 1, 3), (6, 2, 3)])
def test_fragments_sync_in_turn_every_h_over_f_steps(h, tau, count):
    """Two workers, 13 steps, the model's tensors in ``count`` fragments: the start and each
    worker's weights against the reference above. The bugs it fears: every tensor synced at
    each fragment's round, every accumulator zeroed at a fragment's launch, the fragments'
    turns restarted at each launch, or a fragment landing onto another's start."""
    generator = torch.Generator().manual_seed(7)
    weights = _grads(generator, SHAPES3)
    steps = [[_grads(generator, SHAPES3) for _ in range(2)] for _ in range(13)]
    spec = LocalSteps(h=h, lr=0.7, momentum=0.5, overlap=tau, fragments=count)
    states = [_state([w.clone() for w in weights], spec) for _ in range(2)]
    assert states[0].fragments == [[0], [1], [2]][:count] or count == 2
    _drive(states, steps)
    start, local, rounds = _streaming_reference(weights, steps, h, tau, states[0].fragments,
                                                0.7, 0.5)  # fmt: skip
    for state, mine in zip(states, local, strict=True):
        for a, b in zip(state.start, start, strict=True):
            torch.testing.assert_close(a, b)
        for a, b in zip(state.weights, mine, strict=True):
            torch.testing.assert_close(a, b)
    assert states[0].rounds == rounds


def test_one_fragment_is_the_whole_model_round_bit_for_bit():
    generator = torch.Generator().manual_seed(8)
    weights = _grads(generator, SHAPES3)
    steps = [[_grads(generator, SHAPES3) for _ in range(2)] for _ in range(9)]
    runs = []
    for spec in (LocalSteps(h=3, lr=0.7, momentum=0.5, overlap=1),
                 LocalSteps(h=3, lr=0.7, momentum=0.5, overlap=1, fragments=1)):  # fmt: skip
        states = [_state([w.clone() for w in weights], spec) for _ in range(2)]
        _drive(states, steps)
        runs.append(states[0].weights + states[0].start)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_fragment_in_flight_resumes_bit_for_bit():
    spec = LocalSteps(h=4, lr=0.7, momentum=0.5, overlap=1, fragments=2)
    # cut after fragment 0's second round: launched at step 6, it lands at 7
    weights, first, saved = _resumes_bit_for_bit(SHAPES3, spec, steps=11, cut=6, seed=9)
    assert first.in_flight and first.flight == 0
    other = _state([w.clone() for w in weights], LocalSteps(h=3, overlap=1, fragments=3))
    with pytest.raises(ValueError, match="same --local-steps fragments"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    ("groups", "sizes", "count", "expected"),
    [
        ([[0], [1], [2], [3]], [10, 10, 10, 10], 2, [[0, 1], [2, 3]]),
        ([[0], [1], [2], [3]], [30, 1, 1, 1], 2, [[0], [1, 2, 3]]),
        ([[0], [1, 2], [3]], [1, 1, 1, 1], 2, [[0], [1, 2, 3]]),  # a group is never cut
        ([[0, 2], [1], [3]], [1, 1, 1, 1], 2, [[0, 1, 2], [3]]),  # interleaved: one run
        ([[0], [1], [2]], [1, 1, 1], 3, [[0], [1], [2]]),
        ([[0], [1], [2]], [5, 1, 1], 1, [[0, 1, 2]]),
    ],
)
def test_fragments_are_contiguous_runs_of_whole_groups_of_about_equal_size(groups, sizes, count,
                                                                          expected):  # fmt: skip
    from gradsum.sync.local_steps import split_fragments

    assert split_fragments(groups, sizes, count) == expected


def test_more_fragments_than_the_groups_allow_are_refused_naming_both():
    from gradsum.sync.local_steps import split_fragments

    with pytest.raises(ValueError, match=r"fragments=3, but the sync's 2 gradient groups split"):
        split_fragments([[0, 1], [2]], [4, 4, 4], 3)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("diloco(h=4,fragments=3)", "fragments=3 must divide h=4"),
        ("diloco(h=4,fragments=0)", "fragments=0 must be an integer >= 1"),
        ("diloco(h=4,fragments=2,overlap=3)", "overlap=3 must be an integer from 0 to "
                                              "h/fragments=2"),
        ("diloco(h=0)", "h=0 must be an integer >= 1"),
        ("diloco(momentum=1)", "momentum=1.0 must be in [0, 1)"),
        ("diloco(lr=-1)", "lr=-1.0 must be a positive number"),
        ("diloco(bogus=1)",
         "has no option bogus; its options are h, lr, momentum, overlap, fragments"),
        ("diloco(h=4,overlap=5)", "overlap=5 must be an integer from 0"),
        ("diloco(overlap=-1)", "overlap=-1 must be an integer from 0"),
        ("local(h=2)", "unknown local steps 'local'"),
        ("diloco(h=2.5)", "h=2.5 is not an integer"),
    ],
)
def test_a_bad_local_steps_spec_is_refused_naming_it(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_local_steps(text)


def test_defaults_are_dilocos():
    assert parse_local_steps("diloco") == LocalSteps(h=32, lr=0.7, momentum=0.9)
    assert parse_local_steps("diloco(h=8)") == LocalSteps(h=8, lr=0.7, momentum=0.9)


@pytest.mark.parametrize("name", ["allreduce:thc+diloco(h=8,lr=0.7)",
                                  "switch:thc(bits=4)+diloco(h=16)", "ps:none+diloco"])  # fmt: skip
def test_a_local_steps_method_name_round_trips(name):
    fields = method_fields(name)
    assert fields["local_steps"] == name.partition("+")[2]
    assert method_name(TrainConfig(**fields)) == name


@pytest.mark.parametrize(("name", "message"), [("ddp+diloco(h=2)", "gradsum's methods only"),
                                               ("allreduce:thc+diloco(h=0)", "h=0")])  # fmt: skip
def test_a_bad_local_steps_method_is_a_usage_error(name, message):
    with pytest.raises(UsageError, match=message):
        method_fields(name)


def test_local_steps_do_not_apply_to_ddp(capsys):
    from gradsum.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--aggregator", "ddp", "--local-steps", "diloco(h=2)"])
    error = capsys.readouterr().err
    assert "--local-steps diloco(h=2): does not apply to --aggregator ddp" in error


# whole runs: 2 workers, the digits MLP, SGD at a power-of-two learning rate without momentum
COMMON = dict(model="digits-mlp", workers=2, optimizer="sgd", lr=0.125, momentum=0.0,
              progress=False, scheduler="fusion", aggregator="allreduce")  # fmt: skip
PLAIN = "diloco(h=1,lr=1,momentum=0)"


def _digest(**fields) -> str:
    from gradsum.train.launch import run_local

    return run_local(TrainConfig(**{**COMMON, **fields}))["parameter_digest"]


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "thc"])
def test_one_local_step_per_round_is_data_parallel_training_bit_for_bit(codec):
    """The outer round is the data-parallel step's round (plan, keys, steps, tensor shapes,
    the codec's error feedback): with h=1 and a plain outer step the parameters match bit for
    bit; with h=2 they do not (the check bites)."""
    plain = _digest(codec=codec, max_steps=4)
    assert _digest(codec=codec, max_steps=4, local_steps=PLAIN) == plain
    assert _digest(codec=codec, max_steps=4, local_steps="diloco(h=2,lr=1,momentum=0)") != plain


@pytest.mark.slow
def test_a_request_to_stop_travels_a_step_late_and_every_worker_stops_at_the_same_step():
    """Worker 0 asks to stop after its first evaluation (any loss meets this target). Data
    parallel takes no step; with local steps the request travels with the first step's loss
    agreement, which no step waits for, so every worker stops at the second step, having
    taken one (the workers' weights are compared bit for bit at the end of a run)."""
    from gradsum.train.launch import run_local

    fields = dict(codec="thc", max_steps=50, eval_every=2, target_loss=1e9)
    assert run_local(TrainConfig(**{**COMMON, **fields}))["steps"] == 0
    local = TrainConfig(**{**COMMON, **fields}, local_steps="diloco(h=2,overlap=1)")
    assert run_local(local)["steps"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "since", "flight"),
    [
        ("diloco(h=5,lr=0.5,momentum=0.5)", [4], None),
        ("diloco(h=5,lr=0.5,momentum=0.5,overlap=5)", [4], 0),
        ("diloco(h=4,lr=0.5,momentum=0.5,overlap=1,fragments=2)", [2, 0], 1),
    ],
    ids=["whole", "overlap", "fragments"],
)
def test_local_steps_resume_bit_identically_mid_round(tmp_path, spec, since, flight):
    """44 steps an epoch: the checkpoint falls mid-round, so each worker's own weights,
    accumulator, inner and outer optimizers and the codec's feedback must all carry; with
    overlap the round launched last (at step 40; with fragments, fragment 1's at step 44) is
    still in flight (its own process group beside the loss agreement's), and must arrive, be
    saved and land after the resume."""
    # the divergence guard's running mean starts afresh on resume (as without local steps):
    # a generous factor keeps it out of a test of the state that does carry. One group per
    # tensor (wfbp): the MLP's four tensors can make two fragments
    fields = dict(codec="thc", local_steps=spec, momentum=0.9, divergence_factor=100.0,
                  scheduler="wfbp")  # fmt: skip
    whole = _digest(epochs=2, **fields)
    checkpoint = tmp_path / "ckpt.pt"
    _digest(epochs=1, checkpoint=str(checkpoint), **fields)
    own = torch.load(f"{checkpoint}.rank1", weights_only=False)["local_steps"]
    assert own["since"] == since
    assert (own["in_flight"]["fragment"] if "in_flight" in own else None) == flight
    # the model a user takes from the checkpoint is the synced one every worker holds (here
    # worker 1's start), not worker 0's own weights mid-round
    model = torch.load(checkpoint, weights_only=False)["model"]
    assert all(torch.equal(saved, start)
               for saved, start in zip(model.values(), own["start"], strict=True))  # fmt: skip
    assert _digest(epochs=2, resume=str(checkpoint), **fields) == whole


def test_bench_tta_counts_one_outer_round_every_h_steps():
    from gradsum.bench.tta import bytes_per_step

    small = dict(model="gpt", layers=1, width=32, heads=2, context=16, workers=2)
    every = bytes_per_step(TrainConfig(aggregator="allreduce", codec="thc", **small))
    local = TrainConfig(**method_fields("allreduce:thc+diloco(h=8)"), **small)
    assert bytes_per_step(local) == pytest.approx(every / 8, abs=1)


def test_evaluations_see_the_synced_weights_and_training_its_own_after():
    """Mid-round a worker's weights are its own shard's model; an evaluation sees the start
    every worker holds alike, and the next inner step the local weights again."""
    generator = torch.Generator().manual_seed(4)
    weights = _grads(generator, SHAPES)
    state = _state([w.clone() for w in weights], LocalSteps(h=4))
    state.inner_step(_grads(generator, SHAPES))
    local = [w.clone() for w in state.weights]
    assert not all(torch.equal(w, s) for w, s in zip(local, state.start, strict=True))
    with state.synced_weights():
        assert all(torch.equal(w, s) for w, s in zip(state.weights, state.start, strict=True))
    assert all(torch.equal(w, x) for w, x in zip(state.weights, local, strict=True))


def test_local_steps_with_fsdp2_are_refused_before_any_worker_starts(capsys):
    """FSDP2 shards the model; local steps average whole models. Together they crashed every
    worker with an AttributeError after start-up."""
    from gradsum.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["train", "--shard", "fsdp2", "--aggregator", "allreduce", "--codec", "thc",
              "--local-steps", "diloco(h=2)", "--max-steps", "1"])  # fmt: skip
    assert exit_.value.code == 2
    assert "--local-steps diloco(h=2) --shard fsdp2: local steps keep" in capsys.readouterr().err

