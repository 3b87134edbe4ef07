"""Elastic jobs on a bad day (docs/elastic.md): a worker lost at an epoch's end, every
member lost at once, two workers lost at once. Synchronous training
(``MultiWorkerMirroredStrategy(engine="horovod")``) ends equal to one process, model
averaging (``ModelAverageStrategy``) equal to local SGD in numpy with the same
membership schedule, or the job fails naming what was lost; never exit 0 with another
model.
"""

import os

import numpy as np
import pytest

from helpers import assert_weights_close
from test_elastic import (JOINER_HEARTBEAT, STEPS, _assert_members_agree_at_every_step,
                          _launch, reference, told)  # noqa: F401 (a fixture)
from test_elastic_average import _assert_members_follow, initial_weights  # noqa: F401

ALL = ["worker-0", "worker-1", "worker-2"]
AVERAGE_EVERY = 4  # an epoch (10 steps) ends between averages


def _assert_survivors(done, results, starts, names, expected):
    assert done.returncode == 0, told(done)
    assert sorted(results) == names
    for name, result in results.items():
        assert [pid for task, pid in starts if task == name] == [str(result["pid"])]
        assert result["size"] == len(names) and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], expected)
    _assert_members_agree_at_every_step(results)


# ---- 1. a worker lost at an epoch's end ---------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("event", ["worker-1:0:9", "worker-1:2:9:READ"],
                         ids=["after-an-epochs-last-step", "in-fits-last-metrics-read"])
def test_a_worker_lost_at_an_epochs_end_leaves_survivors_at_the_reference(
        tmp_path, reference, event):
    """Killed after the epoch's last step, the survivors fail in Keras' read of the
    epoch's metrics (a collective outside the train function); killed as that read
    begins at fit's end, likewise. They re-form and read again over two workers."""
    done, results, starts = _launch(tmp_path, kill=event)
    assert "worker-1 exited with code -9 (signal SIGKILL); the elastic job carries on " \
           "with 2 worker(s) (worker-0, worker-2)" in done.stderr
    _assert_survivors(done, results, starts, ["worker-0", "worker-2"], reference)
    for result in results.values():
        assert result["recoveries"] == 1 and result["steps_lost"] == 0, result


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_worker_lost_at_an_epochs_end_is_replaced_and_all_end_at_the_reference(
        tmp_path, reference):
    """With a restart left the replacement joins at the epoch's end: until it trains
    a step, every member reads and resets the metrics on its own (the joiner's rule),
    so the next epoch starts together."""
    done, results, starts = _launch(tmp_path, "--max-restarts", "3", kill="worker-1:0:9",
                                    heartbeat=JOINER_HEARTBEAT)
    assert done.returncode == 0, told(done)
    assert "worker-1: takes the state of rank 0 (epoch 0, batch 10)" in \
        done.stdout + done.stderr
    assert [task for task, _ in starts].count("worker-1") == 2
    assert sorted(results) == ALL
    for result in results.values():
        assert result["size"] == 3 and result["iterations"] == STEPS
        assert_weights_close([np.array(w) for w in result["weights"]], reference)
    _assert_members_agree_at_every_step(results)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_a_worker_lost_at_an_epochs_end_between_averages_is_dropped(
        tmp_path, initial_weights):
    """Averages every 4 steps: worker-1 is killed after step 10, the epoch's last;
    the survivors re-form in the metrics' read and average steps 11-12 between them."""
    done, results, starts = _launch(tmp_path, kill="worker-1:0:9",
                                    JOB_PERIOD=str(AVERAGE_EVERY))
    assert done.returncode == 0, told(done)
    for name in ("worker-0", "worker-2"):
        assert [pid for task, pid in starts if task == name] == [str(results[name]["pid"])]
        assert results[name]["recoveries"] == 1
    _assert_members_follow(results, initial_weights, 11, ALL, ["worker-0", "worker-2"],
                           AVERAGE_EVERY)


# ---- 2. every member lost ------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.parametrize("period", [None, AVERAGE_EVERY], ids=["sync", "average"])
def test_every_member_lost_fails_naming_them_rather_than_start_over(tmp_path, period):
    """All three killed at once with restarts left: their replacements hold no state
    and there is no backup, so the job fails and names the losses (it used to train
    from epoch -1 and exit 0)."""
    done, results, _ = _launch(tmp_path, "--max-restarts", "3",
                               kill=",".join(f"{name}:1:4" for name in ALL),
                               **({"JOB_PERIOD": str(period)} if period else {}))
    assert done.returncode == 1, told(done)
    assert "every member holding the elastic job's training state was lost (" in done.stderr
    for name in ALL:
        assert f"{name} exited with code -9 (signal SIGKILL)" in done.stderr
    assert "there is no backup to resume from, so the job fails rather than train from " \
           "scratch" in done.stderr
    assert "no member of the elastic job holds its training state" in done.stdout + done.stderr
    assert "(epoch -1, batch -1)" not in done.stdout + done.stderr
    assert not results and not (tmp_path / "model.keras").exists()


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_every_member_lost_with_a_backup_resumes_from_it(tmp_path, reference):
    """The same losses with ``BackupAndRestore``: the launcher starts the whole job
    again (one restart), which resumes at epoch 1 from the backup of epoch 0."""
    done, results, starts = _launch(tmp_path, "--max-restarts", "4",
                                    kill=",".join(f"{name}:1:4" for name in ALL),
                                    JOB_BACKUP="1")
    assert done.returncode == 0, told(done)
    assert "restart 4/4: " in done.stderr and \
        "the job starts again from fit's backup" in done.stderr
    assert sorted(results) == ALL
    for result in results.values():
        assert result["size"] == 3 and result["iterations"] == STEPS
        assert not any(key.startswith("0:") for key in result["steps"])  # resumed
        assert_weights_close([np.array(w) for w in result["weights"]], reference)


# ---- 3. two workers lost at once -----------------------------------------------------

BELOW = "1 worker(s) left (worker-0), below --min-workers 2"


def _assert_no_membership_lists_the_dead(done, formed=True):
    """No re-forming lists worker-1 or worker-2 (and, if ``formed``, worker-0 re-formed:
    the tasks' lines are in the launcher's stdout)."""
    lines = [line for line in (done.stdout + done.stderr).splitlines()
             if "re-forms Horovod: membership" in line]
    assert not formed or any("worker-0: re-forms" in line for line in lines), lines
    for line in lines:
        assert "worker-1" not in line and "worker-2" not in line, line


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_two_workers_lost_at_once_the_survivor_waits_for_a_joiner(tmp_path, reference):
    """worker-1 and worker-2 killed after the same step: no membership lists either,
    the survivor waits below --min-workers, and a worker added by SIGUSR1 takes the
    state from it; both end at the reference."""
    done, results, starts = _launch(
        tmp_path, "--elastic-timeout", "60", kill="worker-1:0:5,worker-2:0:5",
        heartbeat=JOINER_HEARTBEAT, grow_after=BELOW)
    for name in ("worker-1", "worker-2"):
        assert f"{name} exited with code -9 (signal SIGKILL); {BELOW}" in done.stderr
    assert "adding worker-3, which joins the running elastic job (2 workers)" in done.stderr
    assert "worker-3: takes the state of rank 0 (epoch 0, batch 6)" in \
        done.stdout + done.stderr
    _assert_no_membership_lists_the_dead(done)
    _assert_survivors(done, results, starts, ["worker-0", "worker-3"], reference)


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_two_workers_lost_at_once_between_averages_a_joiner_takes_the_last_average(
        tmp_path, initial_weights):
    """Averages every 4 steps; worker-1 and worker-2 killed after step 6. worker-0
    trains step 7 alone, fails in the average of step 8 and waits; worker-3 joins
    with the average of step 4, and the two average from step 8."""
    done, results, _ = _launch(
        tmp_path, "--elastic-timeout", "60", kill="worker-1:0:5,worker-2:0:5",
        heartbeat=JOINER_HEARTBEAT, grow_after=BELOW, JOB_PERIOD=str(AVERAGE_EVERY))
    assert done.returncode == 0, told(done)
    _assert_no_membership_lists_the_dead(done)
    _assert_members_follow(results, initial_weights, 8, ALL, ["worker-0", "worker-3"],
                           AVERAGE_EVERY)


@pytest.mark.multiprocess
@pytest.mark.horovod
def test_two_workers_lost_at_once_below_min_workers_fail_naming_both(tmp_path):
    done, results, _ = _launch(tmp_path, "--elastic-timeout", "3",
                               kill="worker-1:0:5,worker-2:0:5")
    assert done.returncode == 1
    assert "the elastic job stayed below --min-workers 2 for more than --elastic-timeout " \
           "3s: 1 worker(s) left (worker-0); missing: " in done.stderr, done.stderr[-3000:]
    for name in ("worker-1", "worker-2"):
        assert f"{name} exited with code -9 (signal SIGKILL)" in \
            done.stderr.split("missing: ")[-1]
    _assert_no_membership_lists_the_dead(done, formed=False)
    assert not results and os.path.exists(tmp_path / "starts")
