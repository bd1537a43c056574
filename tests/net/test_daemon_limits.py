"""Daemon flags past the documented limits are refused at start-up, not served."""

import pytest

from gradsum.cli import main


@pytest.mark.parametrize("kind", ["switch", "server"])
def test_max_jobs_past_the_total_of_1024_is_refused(kind, capsys):
    with pytest.raises(SystemExit) as exited:
        main([kind, "--bind", "127.0.0.1:0", "--max-jobs", "2000"])
    assert exited.value.code == 2
    assert "--max-jobs must be at most 1024" in capsys.readouterr().err


def test_without_secrets_everyone_together_holds_at_most_max_jobs():
    from gradsum.dataplane import DataPlane, switch_profile
    from gradsum.dataplane.plane import RequestRefused
    from gradsum.net.daemon_cli import MAX_JOBS

    from ..dataplane.helpers import int32_job

    plane = DataPlane(switch_profile(max_jobs=MAX_JOBS, tenant_jobs=MAX_JOBS))
    for job in range(MAX_JOBS):
        plane.register(int32_job(workers=1, slots=1, job=job))
    with pytest.raises(RequestRefused) as refused:
        plane.register(int32_job(workers=1, slots=1, job=MAX_JOBS))
    assert refused.value.code == "too_many_jobs" and len(plane.jobs) == MAX_JOBS
