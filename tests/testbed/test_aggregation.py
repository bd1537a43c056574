"""gradsum's switch aggregating across namespaces over lossy links: the result is bit-identical to
the loss-free round (the in-process one, which tests/net shows a loss-free UDP run equals)."""

from __future__ import annotations

import numpy as np
import pytest

from gradsum.codecs import make_codec, run_round
from gradsum.net.loopback import WorkerTask, worker_input
from gradsum.testbed.aggregation import NamespaceDaemon, aggregate


def loss_free(task: WorkerTask) -> np.ndarray:
    codec = make_codec(task.codec, workers=task.workers, **task.codec_options)
    inputs = [worker_input(task, w, 0) for w in range(task.workers)]
    return run_round(codec, inputs, seed=task.seed, step=0).average.numpy()


@pytest.mark.slow
def test_switch_aggregation_over_one_percent_loss_equals_the_loss_free_result(make_testbed):
    task = WorkerTask((), job=1, workers=3, codec="thc", elements=150_000, slot_elements=1024,
                      slots=8, retry_timeout=0.005)  # fmt: skip
    with make_testbed(3, switch=True, rate="1gbit", loss="1%") as tb:
        with NamespaceDaemon(tb, "switch", "switch") as switch:
            results = aggregate(tb, switch, task, timeout=240)
        drops = tb.loss_drops()
    # ~150 packets each way per worker at 1% per link direction: a few dozen lost in all
    assert sum(drops.values()) > 0, drops
    assert sum(s["retransmissions"] for r in results for s in r.stats.values()) > 0
    want = loss_free(task)
    for result in results:
        assert np.array_equal(result.outputs[0], want), f"worker {result.worker}"
    assert "statistics" in switch.stderr  # printed when it stopped
