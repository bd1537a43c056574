"""A failed worker is reported by the type and message of what it raised, also when that came
through a torch future or a chain of exceptions."""

import pickle

import pytest
import torch

from gradsum.failures import (
    FAILURE_FILE_ENV,
    TRACEBACK_ENV,
    Failure,
    WorkerFailed,
    describe_failure,
    read_failure_file,
    report,
    write_failure_file,
)


class GradientExploded(ValueError):
    pass


def _raised(error: BaseException) -> BaseException:
    """``error`` after being raised, so that it has a traceback."""
    try:
        raise error
    except BaseException as caught:
        return caught


def _through_future(error: BaseException, callbacks: int) -> BaseException:
    """What waiting on a torch future raises when ``error`` was set on it and passed through
    ``callbacks`` chained then() callbacks (as a communication thread's result is)."""
    future = first = torch.futures.Future()
    for _ in range(callbacks):
        future = future.then(lambda done: done.value())
    first.set_exception(error)
    with pytest.raises(BaseException) as caught:
        future.wait()
    return caught.value


def test_a_plain_exception_is_its_type_and_message():
    assert describe_failure(GradientExploded("NaN in 4096 coordinates")) == (
        "GradientExploded",
        "NaN in 4096 coordinates",
    )


def test_a_future_given_the_exception_raises_it_as_it_was():
    error = _through_future(GradientExploded("NaN in 4096 coordinates"), callbacks=0)
    assert describe_failure(error) == ("GradientExploded", "NaN in 4096 coordinates")


@pytest.mark.parametrize("callbacks", [1, 2])
def test_a_callback_wrapped_error_shows_the_original_without_torchs_stack(callbacks):
    error = _through_future(GradientExploded("NaN in 4096\ncoordinates"), callbacks)
    assert type(error) is RuntimeError  # torch kept only the words
    assert "At:" in str(error)
    assert describe_failure(error) == ("GradientExploded", "NaN in 4096\ncoordinates")


def test_an_error_raised_by_a_callback_itself_and_one_without_message():
    future = torch.futures.Future()
    divided = future.then(lambda done: done.value() / 0)
    future.set_result(1)
    with pytest.raises(RuntimeError) as caught:
        divided.wait()
    assert describe_failure(caught.value) == ("ZeroDivisionError", "division by zero")
    assert describe_failure(_through_future(GradientExploded(), 1)) == ("GradientExploded", "")


def test_a_runtime_error_that_only_looks_wrapped_keeps_its_words():
    text = "Got the following error when running the callback: 42 is not a type"
    assert describe_failure(RuntimeError(text)) == ("RuntimeError", text)


def test_an_exception_without_words_of_its_own_gives_way_to_its_cause_or_context():
    def raised_from():
        raise RuntimeError from GradientExploded("NaN")

    def raised_while_handling():
        try:
            {}["lr"]
        except KeyError:
            raise RuntimeError  # noqa: B904 (the implicit context is the point)

    def suppressed():
        try:
            {}["lr"]
        except KeyError:
            raise RuntimeError from None

    for fn, expected in [
        (raised_from, ("GradientExploded", "NaN")),
        (raised_while_handling, ("KeyError", "'lr'")),
        (suppressed, ("RuntimeError", "")),
    ]:
        with pytest.raises(Exception) as caught:
            fn()
        assert describe_failure(caught.value) == expected


def test_a_chain_that_loops_ends():
    first, second = RuntimeError(), RuntimeError()
    first.__cause__, second.__cause__ = second, first
    assert describe_failure(first) == ("RuntimeError", "")


def test_an_exception_with_words_of_its_own_is_reported_as_raised():
    with pytest.raises(RuntimeError) as caught:
        try:
            raise OSError("no route to host")
        except OSError as error:
            raise RuntimeError("cannot reach the switch at 10.0.0.1:48864") from error
    assert describe_failure(caught.value) == (
        "RuntimeError",
        "cannot reach the switch at 10.0.0.1:48864",
    )


def test_a_failure_names_the_rank_keeps_the_traceback_and_survives_pickling():
    failure = Failure.of(_raised(GradientExploded("NaN")), rank=1)
    assert str(failure) == "worker 1 failed: GradientExploded: NaN"
    assert "_raised" in failure.traceback and "GradientExploded: NaN" in failure.traceback
    assert str(Failure("TimeoutError", "")) == "TimeoutError"
    wrapped = pickle.loads(pickle.dumps(WorkerFailed(failure)))
    assert str(wrapped) == str(failure)
    assert Failure.of(wrapped) == failure  # the worker's failure, not one about the wrapper
    assert wrapped.details == failure.traceback


def test_report_prints_one_line_and_the_traceback_only_when_asked(capsys, monkeypatch):
    failure = Failure.of(_raised(GradientExploded("NaN")), rank=1)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    report("gradsum train", failure)
    assert capsys.readouterr().err == (
        f"gradsum train: worker 1 failed: GradientExploded: NaN ({TRACEBACK_ENV}=1 shows where)\n"
    )
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    report("gradsum train", failure)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)")
    assert err.endswith("\ngradsum train: worker 1 failed: GradientExploded: NaN\n")


def test_a_failure_file_round_trips_and_a_torn_one_reads_as_none(tmp_path, monkeypatch):
    path = tmp_path / "w1.failure.json"
    failure = Failure.of(_raised(GradientExploded("NaN")), rank=1)
    monkeypatch.delenv(FAILURE_FILE_ENV, raising=False)
    write_failure_file(failure)  # not asked for: nothing written
    assert read_failure_file(path) is None
    monkeypatch.setenv(FAILURE_FILE_ENV, str(path))
    write_failure_file(failure)
    assert read_failure_file(path) == failure
    path.write_text(path.read_text()[:20])
    assert read_failure_file(path) is None
