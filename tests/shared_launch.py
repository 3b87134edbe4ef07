"""Many small two-worker checks in one launched cluster per engine.

A test module registers its cases when it is imported (``case(group, key, fn, *args)``);
the first test that reads a result (``results(group, key)``) launches one cluster that
runs every case of that group in turn, and the other tests read what it returned.
Pytest imports every module before it runs a test, so one launch serves all the cases
registered in the files one pytest worker holds. A case that raises fails its own test
only, with the task's traceback.

Groups are engines: ``"tf"``, ``"horovod"``, and ``"auto"`` for the default engine.
Horovod's rendezvous and TF's servers both bind the task's port, so one process cannot
run cases of both engines; each engine gets its own launch. The ``"tf"`` group still
launches once per case: a third `ModelAverageStrategy(engine="tf")` in one process
hung in its first collective (seen with TF 2.21; two in a row worked).
"""

import traceback

from helpers import require_horovod, run_cluster

GROUPS = ("tf", "horovod", "auto")
ONE_LAUNCH_PER_CASE = ("tf",)
TIMEOUT = 540  # seconds for a whole group: about 10 small fits
# For the tests that read results: the launch plus pytest's own margin.
TEST_TIMEOUT = TIMEOUT + 60

_cases: dict[str, dict[str, tuple]] = {group: {} for group in GROUPS}
_launched: dict[object, object] = {}


def case(group: str, key: str, fn, *args) -> None:
    """Registers ``fn(*args)`` to run in every task of ``group``'s launch, as ``key``."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}. Received: group={group!r}")
    if key in _cases[group]:
        raise ValueError(f"case {key!r} is registered twice in group {group!r}")
    _cases[group][key] = (fn, args)


def results(group: str, key: str) -> list:
    """The value ``key``'s function returned in each task, launching ``group`` once.

    Raises:
        AssertionError: the case raised in a task (with that task's traceback), or the
            launch failed.
    """
    if group in ("horovod", "auto"):
        require_horovod()
    launch = (group, key) if group in ONE_LAUNCH_PER_CASE else group
    if launch not in _launched:
        cases = [(name, fn, args) for name, (fn, args) in _cases[group].items()
                 if launch == group or name == key]
        try:
            _launched[launch] = run_cluster(_run_each, cases, workers=2, timeout=TIMEOUT)
        except Exception as error:  # every test of the launch fails with this cause
            _launched[launch] = error
    launched = _launched[launch]
    if isinstance(launched, Exception):
        raise AssertionError(f"the shared {group!r} launch failed: {launched}")
    values = []
    for task, per_case in enumerate(launched):
        status, value = per_case[key]
        if status == "error":
            raise AssertionError(f"case {key!r} raised in task {task} of the shared "
                                 f"{group!r} launch:\n{value}")
        values.append(value)
    return values


def _run_each(cases):
    """Runs in each task: every case in turn, an exception kept as its traceback."""
    out = {}
    for name, fn, args in cases:
        try:
            out[name] = ("ok", fn(*args))
        except Exception:  # noqa: BLE001 - reported by the case's own test
            out[name] = ("error", traceback.format_exc())
    return out
