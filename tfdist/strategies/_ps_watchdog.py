"""The parameter-server chief's watchdog: names frozen or hung workers and frozen ps tasks.

`tfdist.ParameterServerStrategy` starts one on the chief (unless ``step_timeout`` is
None); ``fit`` asks it for its error while it waits for steps.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

from tfdist import env
from tfdist._hooks import coordinator as coordinator_hooks
from tfdist.comm.liveness import is_responsive



class StepTimeoutError(TimeoutError):
    """Steps did not finish within ``step_timeout`` and nothing can take them over: no
    worker is left, or a ps task (which holds variables) is frozen.

    Attributes:
        tasks: The names of the tasks at fault, e.g. ``["worker-1"]`` or ``["ps-0"]``.
    """

    def __init__(self, message, tasks):
        super().__init__(message)
        self.tasks = list(tasks)


class _StepWatchdog:
    """Finds frozen or hung workers and frozen ps tasks, and names them.

    A step sent to a frozen worker never returns, and TF cannot take it back while the
    worker lives; worse, while any worker or ps is frozen every TF call of the chief that
    touches the cluster blocks (measured on TF 2.21: even reading a ps variable). So
    each worker's and each ps's server is probed (`is_responsive`), and each running step
    is timed. A task is silent when its server has not answered for ``step_timeout / 2``
    (at most 30 s, so 30 s with the default ``step_timeout``).

    A silent worker is overdue; so is one whose step runs longer than ``step_timeout``
    while every server answers (every ps too, probed after the step went overdue: a
    frozen ps hangs every worker's step, and they are not to blame). Under `tfdist
    launch` (``TFDIST_CONTROL_DIR`` set) the launcher is asked to SIGKILL and restart an
    overdue worker: its death lets TF's coordinator run the step on another worker and
    take the restarted one back. Otherwise nothing can, and `error` names it; it also
    does when every worker has been overdue for longer than ``step_timeout +
    startup_timeout``, or when no worker's server has been running (nothing listens:
    killed, and not restarted) for ``startup_timeout``.

    A silent ps ends the job: its variables cannot be moved, and nothing runs without
    them. `error` names it, and under `tfdist launch` the launcher is asked to SIGKILL it,
    which ends the job naming it. If ``fit`` does not raise `error` within
    `EXIT_GRACE_SECONDS` (the chief is blocked inside TF), the process exits with 1.
    """

    EXIT_GRACE_SECONDS = 10.0
    STOP_WAIT_SECONDS = 10.0  # for `tfdist launch` to kill a frozen ps before failing

    def __init__(self, coordinator, addresses, step_timeout, startup_timeout,
                 control_dir=None, ps_addresses=()):
        self.error = None
        self._raised = self._stopped = False
        self._running = coordinator_hooks.track_running_closures(coordinator)
        self._step_timeout = step_timeout
        self._probe_timeout = min(step_timeout / 2, 30.0)
        self._interval = min(step_timeout / 4, 2.0)
        self._grace = step_timeout + startup_timeout
        self._control_dir = control_dir
        self._workers = len(addresses)
        self._ps = len(ps_addresses)
        self._silent = {}  # worker index -> when its server stopped answering
        self._dead = {}  # worker index -> since when nothing listens at its address
        self._ps_silent = {}  # ps index -> when its server stopped answering
        self._ps_answered = {}  # ps index -> when its last answered probe began
        self._ps_probing = set()  # ps indices whose probe is in flight
        self._startup_timeout = startup_timeout
        self._flagged = {}  # overdue key (a step's token, or a silence) -> (index, when)
        for kind, tasks in (("worker", addresses), ("ps", ps_addresses)):
            for index, address in enumerate(tasks):
                threading.Thread(target=self._probe, args=(kind, index, address), daemon=True,
                                 name=f"tfdist-probe-{kind}-{index}").start()
        threading.Thread(target=self._watch, name="tfdist-step-watchdog", daemon=True).start()

    def _probe(self, kind, index, address):
        silent, dead = (self._silent, self._dead) if kind == "worker" else \
            (self._ps_silent, {})
        while self.error is None and not self._stopped:
            began = time.monotonic()
            if kind == "ps":
                self._ps_probing.add(index)
            answer = is_responsive(address, self._probe_timeout)
            if answer and kind == "ps":
                self._ps_answered[index] = began
            for state, since in ((False, silent), (None, dead)):
                if answer is state:
                    since.setdefault(index, time.monotonic())
                else:
                    since.pop(index, None)
            if kind == "ps":  # after its silence is recorded: `settle` sees one or the other
                self._ps_probing.discard(index)
            time.sleep(self._interval)

    def _watch(self):
        while self.error is None and not self._stopped:
            time.sleep(self._interval)
            self.check()

    def check(self):
        """Flags the overdue workers and a silent ps (see the class); sets `error` if
        nothing can help."""
        now = time.monotonic()
        ps_silent = dict(self._ps_silent)
        if ps_silent:  # nothing runs without it; the workers' steps wait for it
            if self.error is None:
                self._on_frozen_ps([f"ps-{i}" for i in sorted(ps_silent)])
            return
        running, silent = dict(self._running), dict(self._silent)
        ps_answered = min((self._ps_answered.get(i, -1.0) for i in range(self._ps)),
                          default=now)
        overdue = {("silent", i, since): (i, "its server has not answered for "
                                          f"{self._probe_timeout:g}s: it is frozen")
                   for i, since in silent.items()}
        if not silent:  # a frozen worker blocks every step: blame only it
            overdue.update({token: (i, f"it has not finished a step within step_timeout="
                                       f"{self._step_timeout:g}s: it is hung or too slow")
                            for i, (token, started) in running.items()
                            if now - started > self._step_timeout
                            and ps_answered > started + self._step_timeout})
        alive = {token for token, _ in running.values()} | set(overdue)
        self._flagged = {k: v for k, v in self._flagged.items() if k in alive}
        for key, (index, why) in overdue.items():
            if key not in self._flagged:
                self._flagged[key] = (index, now)
                self._on_overdue(f"worker-{index}", why)
        stuck = sorted({index for index, _ in self._flagged.values()})
        if self.error is None and len(stuck) == self._workers and \
                now - max(when for _, when in self._flagged.values()) > self._grace:
            names = [f"worker-{i}" for i in stuck]
            self._fail(StepTimeoutError(
                f"no worker is left: {', '.join(names)} froze or hung, and none was "
                f"restarted within {self._grace - self._step_timeout:g}s "
                f"(step_timeout + startup_timeout). Received: "
                f"step_timeout={self._step_timeout:g}", names))
        dead = dict(self._dead)
        if self.error is None and len(dead) == self._workers and \
                now - max(dead.values()) > self._startup_timeout:
            names = [f"worker-{i}" for i in sorted(dead)]
            self._fail(StepTimeoutError(
                f"no worker is left: nothing has listened at the address of "
                f"{', '.join(names)} for startup_timeout={self._startup_timeout:g}s "
                "(killed, and not restarted); nothing can run the chief's steps", names))

    def _on_frozen_ps(self, names):
        which = ", ".join(names)
        why = (f"its server has not answered for {self._probe_timeout:g}s: it is frozen "
               "(e.g. SIGSTOP) or cut off")
        error = StepTimeoutError(
            f"{which} is not responding: {why}. A ps holds the model's variables, so "
            "training cannot go on without it, and the workers' steps wait for it (they "
            "are not at fault). Restart the job (e.g. `tfdist launch --max-restarts 1 "
            "...`) and resume from the chief's checkpoint (keras.callbacks.BackupAndRestore). "
            f"Received: step_timeout={self._step_timeout:g}", names)
        if self._control_dir is not None:
            print(f"tfdist: {which} is not responding: {why}; asking tfdist launch to stop "
                  "it, which ends the job (a ps cannot be restarted alone)",
                  file=sys.stderr, flush=True)
            paths = [self._request(env.STOP_REQUEST, name, why) for name in names]
            # The launcher removes a request once its ps has exited: the ps, not this
            # chief (which exits on `error`), is then the task it names.
            deadline = time.monotonic() + self.STOP_WAIT_SECONDS
            while any(map(os.path.exists, paths)) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._fail(error)

    def _on_overdue(self, name, why):
        if self._control_dir is None:
            self._fail(StepTimeoutError(
                f"{name} is overdue: {why}. Its step cannot be taken back from it while "
                "its process lives, and nothing here can restart it (the job was not "
                f"started by `tfdist launch`). Restart {name} or the job (and resume from "
                "the chief's checkpoint), or raise step_timeout. Received: "
                f"step_timeout={self._step_timeout:g}", [name]))
            return
        print(f"tfdist: {name} is overdue: {why}; asking tfdist launch to kill and restart "
              "it (its step runs again on another worker)", file=sys.stderr, flush=True)
        self._request(env.RESTART_REQUEST, name, why)

    def _request(self, request, name, why):
        """Asks `tfdist launch` to SIGKILL task ``name`` (see `tfdist.env.CONTROL_DIR`);
        returns the request's path."""
        path = os.path.join(self._control_dir, f"{request}-{name}")
        try:
            with open(path + ".tmp", "w") as f:
                f.write(why)
            os.replace(path + ".tmp", path)
            return path
        except OSError as error:
            self._fail(StepTimeoutError(f"{name} is overdue: {why}; asking tfdist launch "
                                        f"to {request} it failed: {error}", [name]))
            return path

    def settle(self, error) -> None:
        """Raises this watchdog's `StepTimeoutError` instead of TF's ``error`` when
        ``error`` names a ps that is not answering, once the probes have decided.

        A frozen ps usually hangs the chief, and the probes name it after
        ``step_timeout / 2`` (at most 30 s). But a connection TF opens to it after it
        froze fails on its own after 20 s ("timed out before receiving SETTINGS frame"),
        which would end the chief with TF's words. Returns at once if no named ps is
        silent or being probed (a healthy server answers a probe in milliseconds;
        ``error`` is then the chief's to raise)."""
        named = {int(i) for i in re.findall(r"/job:ps/replica:\d+/task:(\d+)", str(error))}
        deadline = time.monotonic() + self._probe_timeout + 2 * self._interval
        while self.error is None and time.monotonic() < deadline and \
                any(self._is_unanswered(i) for i in named):
            time.sleep(0.05)
        self.raise_if_failed()

    def _is_unanswered(self, index) -> bool:
        return index in self._ps_silent or index in self._ps_probing

    def _fail(self, error):
        if self.error is not None:
            return
        self.error = error
        threading.Thread(target=self._exit_unless_raised, daemon=True).start()

    def _exit_unless_raised(self):
        time.sleep(self.EXIT_GRACE_SECONDS)
        if not self._raised:
            print(f"tfdist: {type(self.error).__name__}: {self.error}\ntfdist: the chief is "
                  "blocked in TensorFlow by the frozen task; exiting with code 1",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)

    def stop(self):
        """Ends the probes and checks (within one interval)."""
        self._stopped = True

    def raise_if_failed(self):
        if self.error is not None:
            self._raised = True
            raise self.error
