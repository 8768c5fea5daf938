"""The data plane's mover as the vLLM connector's worker drives it: ordered lanes and
tasks that post their own results (``TransferEngine.submit_task``). Checked: a lane runs
its jobs in submission order; the fault hook sees every task (by link) and a fault,
an I/O error or a bug calls the task's ``fail`` instead of losing it, counted in the
link's stats; ``drain`` waits for what was queued; CPU time is accounted."""

from __future__ import annotations

import threading

import pytest

from kvtier.transfer.mover import TransferEngine


@pytest.fixture
def mover():
    m = TransferEngine(1, lanes=("copy", "ssd"))
    yield m
    m.close()


def test_a_lane_runs_its_tasks_in_submission_order(mover) -> None:
    gate, order = threading.Event(), []
    mover.submit_task("ssd", "gate", 0, 0, gate.wait, lambda: None)
    for i in range(20):
        mover.submit_task("ssd", "hbm->ssd", 1, 8, lambda i=i: order.append(i), lambda: None)
    mover.submit_task("copy", "hbm->dram", 1, 8, lambda: order.append("other lane"), lambda: None)
    mover.drain(["copy"])
    assert order == ["other lane"]  # the copy lane is not held up by the SSD lane
    gate.set()
    mover.drain()
    assert order == ["other lane", *range(20)]
    assert mover.links["hbm->ssd"].jobs == 20 and mover.links["hbm->ssd"].failed_blocks == 0


@pytest.mark.parametrize("fault", ["hook", "io", "bug"])
def test_a_failing_task_calls_fail_and_is_counted(mover, fault: str) -> None:
    ran, failed = [], []

    def hook(job) -> None:
        if fault == "hook" and job.link == "ssd->hbm":
            raise OSError(5, "injected")

    def run() -> None:
        if fault == "io":
            raise OSError(5, "disk")
        if fault == "bug":
            raise KeyError("a bug")
        ran.append(1)

    mover.fault_hook = hook
    mover.submit_task("ssd", "ssd->hbm", 4, 32, run, lambda: failed.append(1)).result()
    mover.submit_task("ssd", "hbm->ssd", 2, 16, lambda: ran.append(2), lambda: failed.append(2)).result()
    assert failed == [1] and ran == [2]  # the other link is untouched, the lane goes on
    st = mover.links["ssd->hbm"]
    assert (st.jobs, st.blocks, st.failed_blocks) == (1, 4, 4)
    assert mover.failed_jobs == 1 and mover.links["hbm->ssd"].failed_blocks == 0
    assert mover.cpu_s > 0.0


@pytest.mark.parametrize("error", [OSError(5, "disk"), TypeError("a bug")])
def test_a_failing_submitted_job_still_calls_on_done_with_every_block_failed(mover, error: Exception) -> None:
    """``submit`` (TieredStore's path) as ``submit_task`` does: any exception in a job, a bug
    included, completes it as failed, so the plan waiting on ``on_done`` is never left pending."""
    from kvtier.transfer.mover import TransferJob

    def run():
        raise error

    done: list = []
    oks = mover.submit(TransferJob("dram->hbm", 3, 24, run, done.append)).result(timeout=10)
    assert list(oks) == [False] * 3 and [list(d) for d in done] == [[False] * 3]
    assert mover.failed_jobs == 1 and mover.links["dram->hbm"].failed_blocks == 3
