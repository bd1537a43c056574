"""Local steps with an outer sync (train/outer.py): the bookkeeping against hand-computed
references, and whole runs against plain data parallel training and against themselves resumed."""

from __future__ import annotations

import re

import pytest
import torch

from gradsum.cli import UsageError
from gradsum.train.config import TrainConfig
from gradsum.train.methods import method_fields, method_name
from gradsum.train.outer import LocalSteps, OuterState, parse_local_steps


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
            into = [torch.empty_like(w) for w in weights]
            state.pseudo_gradient(into)
            pseudo.append(into)
        average = [(a + b) / 2 for a, b in zip(*pseudo, strict=True)]
        for state in workers:
            state.outer_step(average)
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
        pseudo = [torch.empty_like(w) for w in weights]
        state.pseudo_gradient(pseudo)
        for d, s, w in zip(pseudo, start, local, strict=True):
            torch.testing.assert_close(d, s - w)
        if buffers is None:
            buffers = pseudo
        else:
            buffers = [0.9 * b + d for b, d in zip(buffers, pseudo, strict=True)]
        start = [s - 0.7 * (d + 0.9 * b) for s, d, b in zip(start, pseudo, buffers, strict=True)]
        state.outer_step(pseudo)
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
                       lambda acc: torch.optim.AdamW(acc, lr=0.1, weight_decay=0.0),
                       weight_decay=0.5, decoupled_lr=0.1)  # fmt: skip
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
                pseudo = [torch.empty_like(w) for w in weights]
                state.pseudo_gradient(pseudo)
                state.outer_step(pseudo)

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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("diloco(h=0)", "h=0 must be an integer >= 1"),
        ("diloco(momentum=1)", "momentum=1.0 must be in [0, 1)"),
        ("diloco(lr=-1)", "lr=-1.0 must be a positive number"),
        ("diloco(bogus=1)", "has no option bogus; its options are h, lr, momentum"),
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
def test_local_steps_resume_bit_identically_mid_round(tmp_path):
    """h=5 against 44 steps an epoch: the checkpoint falls mid-round, so each worker's own
    weights, accumulator, inner and outer optimizers and the codec's feedback must all carry."""
    # the divergence guard's running mean starts afresh on resume (as without local steps):
    # a generous factor keeps it out of a test of the state that does carry
    fields = dict(codec="thc", local_steps="diloco(h=5,lr=0.5,momentum=0.5)", momentum=0.9,
                  divergence_factor=100.0)  # fmt: skip
    whole = _digest(epochs=2, **fields)
    checkpoint = tmp_path / "ckpt.pt"
    _digest(epochs=1, checkpoint=str(checkpoint), **fields)
    own = torch.load(f"{checkpoint}.rank1", weights_only=False)
    assert own["local_steps"]["taken"] == 44 % 5
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
