"""A local worker that finished ends with status 0: nothing it started is left for the
interpreter's exit to destroy (a std::terminate there is SIGABRT in a finished worker)."""

import warnings

import pytest

from gradsum.train import launch
from gradsum.train.launch import run_local
from gradsum.train.loop import TrainConfig


@pytest.mark.slow
def test_local_workers_of_a_thc_allreduce_run_exit_with_status_0_and_no_terminate(
    capfd, monkeypatch
):
    codes = []
    join = launch._join

    def join_and_keep_codes(processes, results, config):
        join(processes, results, config)
        for process in processes:
            process.join(30)
        codes.extend(process.exitcode for process in processes)

    monkeypatch.setattr(launch, "_join", join_and_keep_codes)
    config = TrainConfig(aggregator="allreduce", codec="thc", workers=4, max_steps=30,
                         batch_size=8, progress=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "ended by SIGABRT ... in teardown"
        summary = run_local(config)
    err = capfd.readouterr().err
    assert summary["steps"] == 30
    assert codes == [0, 0, 0, 0], codes
    assert "terminate called" not in err, err[-3000:]
