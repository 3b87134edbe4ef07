"""Elastic ``fit``: commit in memory, and on a lost member roll back, re-form, re-trace.

In an elastic job (``tfdist launch --min-workers``, engine ``"horovod"``) Keras' train
function is wrapped (`ElasticFit`). After every ``commit_every_steps`` train steps (and
at each epoch's start) the wrapper copies the training state into host memory: the
variables of the strategy's state components (``strategy.state_components(model)``,
`tfdist.strategies.state`: the model's, optimizer's and metrics' variables, gradient
accumulation's, sharded optimizer state's, model averaging's) and the data position
(epoch, batch: `tfdist.strategies.elastic.data.DataPosition`, a component too). A commit lands only where every component lets it (gradient
accumulation: at an accumulation boundary). The
copy of a step that commits is read inside that step's own traced function
(`tfdist._hooks.keras_steps.committing_train_function`), as one flat buffer per dtype,
so a commit costs no function call of its own.
When Horovod fails because a member was lost, or the launcher publishes a newer
membership (a joiner), every member:

1. puts the committed values back and rewinds its data to the committed batch;
2. re-forms Horovod with the next membership (`tfdist.engines.horovod.elastic`);
3. agrees on the newest commit (members may be one step apart when the loss came in
   the middle of an all-reduce) and takes its values from the member holding it, by
   broadcast: a joiner gets the whole state this way;
4. re-traces Keras' train function (the replica count is baked into it) and replays
   the rolled-back steps from the data buffer, so no batch is skipped or taken twice.

The data is an `ElasticDataset` (`tfdist.strategies.elastic.data`): every worker reads every global batch of the user's
dataset and keeps its replicas' rows, so the global batch (and the trajectory of
synchronous SGD) does not depend on how many workers compute it, and a position is
just (epoch, batch). The global batch must divide by every replica count the job can
have (checked before ``fit`` starts).
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist.strategies import state
from tfdist.strategies.elastic.data import DataPosition
from tfdist.strategies.elastic.snapshot import Snapshot

DEFAULT_COMMIT_EVERY_STEPS = 1


class ElasticFit:
    """Keras' train function of one ``fit``, made elastic (see the module's words).

    Args:
        strategy: The strategy (Horovod engine, in an elastic job).
        model: The Keras model being fit.
        commit_every_steps: Train-function calls between commits.
    """

    def __init__(self, strategy, model, commit_every_steps: int):
        self.strategy = strategy
        self.model = model
        self.member = strategy.membership()
        self.commit_every_steps = commit_every_steps
        self.position = DataPosition()
        self.calls_since_commit = 0
        self._committed_flat = None  # (Snapshot, its flat values), unpacked when needed
        self._committed_lists = ([], [])  # (state values, metric values) once unpacked
        self.last_logs = None
        self.recoveries = 0
        self.commits = 0  # commits taken, and of them those read inside a train step
        self.fused_commits = 0
        self._snapshot: Snapshot | None = None  # the variables a commit reads
        self._inner = None
        self._committing = None  # the train function whose last step commits
        self.components = [*strategy.state_components(model), self.position]
        self.backups: list[str] = []  # fit's BackupAndRestore directories
        self._read_elsewhere = False  # the others read this epoch's metrics already
        self._joined = False  # joined a running job: its first commit is the one it took

    # ---- the wrapped train function ------------------------------------------------
    def install(self) -> None:
        """Makes Keras' train function (as ``fit`` would) and puts this one in its place;
        the epoch's read of the metrics goes through `epoch_results` until `uninstall`."""
        from tfdist._hooks.keras_steps import remake_train_function, wrap_epoch_metrics

        self._inner = remake_train_function(self.model)
        self._committing = None
        self.model.train_function = self
        self.uninstall = wrap_epoch_metrics(self.model, self.epoch_results)

    @property
    def epoch(self) -> int:
        """The epoch being trained (`DataPosition.epoch`)."""
        return self.position.epoch

    @property
    def steps_lost(self) -> int:
        """Steps rolled back so far (`DataPosition.steps_lost`)."""
        return self.position.steps_lost

    def __call__(self, iterator):
        position = self.position
        if iterator is not position.iterator:  # a new epoch
            if position.iterator is None:
                self._prepare()
                self._snapshot_now(renew=True)
            position.start_epoch(iterator)  # a joiner's first epoch: the job's position
            self._check_epoch_start()
            if self._joined:  # the commit it took: no read (it may gather, alone)
                self._joined = False
                self._committed()
            else:
                self.commit()
        if position.fast_forward > 0:  # Keras' steps the job trained before it joined
            position.fast_forward -= self.model.steps_per_execution
            return {}
        start = iterator.position
        while True:
            self.member.training = True  # again after a re-forming with a joiner
            try:
                if self.calls_since_commit == 0 and self.member.changed() and \
                        state.may_reform(self.components):
                    raise _MembershipChanged()
                while iterator.position < start:  # replay what the rollback undid
                    self._inner(iterator)
                if self.calls_since_commit + 1 >= self.commit_every_steps and \
                        state.commit_point(self.components, self.model.steps_per_execution):
                    snapshot, committing = self._committing_function()
                    logs, values = committing(iterator)
                else:
                    logs, values = self._inner(iterator), None
            except (tf.errors.OpError, _MembershipChanged) as error:
                if isinstance(error, tf.errors.OpError) and not self.member.is_lost_peer(error):
                    raise
                if self._recover(start):
                    return self.last_logs  # the newest commit is past this call
                continue
            self.last_logs = logs
            self.calls_since_commit += 1
            if self.calls_since_commit >= self.commit_every_steps:
                if values is None:  # the data ran out, or no commit point was ahead
                    if state.commit_point(self.components, 0):
                        self.commit()
                else:
                    self.fused_commits += 1
                    self._keep(snapshot, values)
            return logs

    def _committing_function(self) -> tuple:
        """``(snapshot, Keras' train function whose last step also reads the snapshot's
        variables)``; made again when they changed (`_snapshot_now`) and after a
        re-trace."""
        snapshot = self._snapshot_now()
        if self._committing is None or self._committing[0] is not snapshot:
            from tfdist._hooks.keras_steps import committing_train_function

            self._committing = (snapshot, committing_train_function(
                self.model, self._inner, snapshot.pack))
        return self._committing

    # ---- commit, rollback, re-form -------------------------------------------------
    def state_variables(self) -> list:
        """The components' shared variables, each once, in a fixed order: what every
        member holds equal (the state a joiner receives)."""
        return state.shared_variables(self.components)

    def metric_variables(self) -> list:
        """The components' own variables (the metrics' local copies, the accumulated
        gradients): committed and restored on this worker, never sent."""
        return state.own_variables(self.components)

    def _prepare(self) -> None:
        """Each component makes its state variables (before the first commit)."""
        for component in self.components:
            component.prepare()

    def _check_epoch_start(self) -> None:
        """An epoch starts with a commit: every component must allow one there."""
        refusing = [c.feature for c in self.components if not c.commit_point(0)]
        if refusing:
            raise ValueError(
                f"In an elastic job an epoch starts with a commit, which "
                f"{', '.join(refusing)} allows only at its boundaries (accumulate_steps "
                f"must divide the train steps of an epoch). Received: epoch {self.epoch} "
                f"starting inside an accumulation of {', '.join(refusing)}")

    def commit(self) -> None:
        """Copies the training state and the data position into host memory, by a
        traced function of its own (a commit after a train step is read inside it)."""
        snapshot = self._snapshot_now()
        self._keep(snapshot, snapshot.read())

    def _keep(self, snapshot, values) -> None:
        """Keeps ``values`` (``snapshot``'s flat buffers) as the commit at this position."""
        self._committed_flat, self._committed_lists = (snapshot, values), None
        self.commits += 1
        self._committed()

    def _committed(self) -> None:
        """Every component is told: the state is committed at this position."""
        state.committed(self.components)
        self.calls_since_commit = 0

    def _snapshot_now(self, renew: bool = False) -> "Snapshot":
        """The variables a commit reads, listed once: again when ``renew`` (before the
        first commit, after a re-forming or a join) or when the optimizer's variables
        changed (an optimizer builds its own lazily); the model's, the metrics' and the
        rules' extra variables are made before the first commit."""
        count = (len(self.model.optimizer.variables), len(self.state_variables()),
                 len(self.metric_variables()))
        if renew or self._snapshot is None or self._snapshot.optimizer_count != count:
            self._snapshot = Snapshot(self.state_variables(), self.metric_variables(),
                                       count)
        return self._snapshot

    @property
    def committed(self) -> list:
        """The state variables' committed values (tensors, in `state_variables`' order)."""
        return self._committed_values()[0]

    @property
    def committed_metrics(self) -> list:
        """The metric variables' committed values (`metric_variables`' order)."""
        return self._committed_values()[1]

    def _committed_values(self) -> tuple[list, list]:
        if self._committed_lists is None:  # unpacked when first needed (a restore)
            snapshot, values = self._committed_flat
            every = snapshot.unpack(values)
            self._committed_lists = (every[:snapshot.state_count],
                                     every[snapshot.state_count:])
        return self._committed_lists

    def join(self) -> int:
        """On a worker that joined a running job, before fit's loop: takes the job's
        state from the member with the newest commit. Returns the epoch to start at."""
        optimizer = self.model.optimizer
        if not optimizer.built:
            with self.strategy.scope():
                optimizer.build(self.model.trainable_variables)
        self._prepare()
        # Placeholders of the broadcast's shapes: a joiner never holds the newest commit.
        self._committed_lists = ([tf.zeros(v.shape, v.dtype)
                                  for v in self.state_variables()], [])
        self.position.committed_at = (-1, -1)
        found = self._newest_commit()
        if found[1] == (-1, -1):
            raise NoStateLeftError(self._no_state_left())
        epoch, position = self._sync(found)
        for component in self.components:
            component.after_join()
        self.member.synced = True
        self._joined = True
        self.position.joined(epoch, position)
        return epoch

    def _no_state_left(self) -> str:
        """Why a joiner whose members all joined too cannot go on (`NoStateLeftError`)."""
        backups = [b for b in self.backups if os.path.isdir(b) and os.listdir(b)]
        then = (f"{self.member.HAS_BACKUP_WORDS} {backups[0]}: the launcher starts the whole "
                "job again while --max-restarts allow, which resumes from it" if backups else
                "fit has no backup to resume from (keras.callbacks.BackupAndRestore, "
                "tfdist launch --backup-dir): the job fails rather than train from scratch")
        return (f"{self.member.name}: {self.member.NO_STATE_WORDS} (membership "
                f"{self.member.version}: {', '.join(self.member.members)}, each started "
                f"after every member that trained was lost); {then}")

    def _sync(self, found: tuple | None = None) -> tuple[int, int]:
        """Every member takes the newest commit's values (a member holding the newest
        commit keeps its own values of the rules' ``own_variables``); returns its
        position. ``found``: `_newest_commit`'s answer, when asked already."""
        root, newest = found or self._newest_commit()
        keep = (state.kept_when_newest(self.components)
                if self.position.committed_at == newest
                else set())
        self.member.say(f"{self.member.name}: takes the state of rank {root} (epoch "
                        f"{newest[0]}, batch {newest[1]})")
        committed = self.committed
        for i, variable in enumerate(self.state_variables()):
            value = self.member.broadcast(committed[i], root_rank=root)
            if id(variable) not in keep:
                committed[i] = value
            variable.assign(committed[i])
        return newest

    def _recover(self, start: int) -> bool:
        """Rolls back, re-forms, syncs the newest commit, re-traces.

        Returns:
            True when the newest commit already covers the call that began at ``start``.
        """
        self.recoveries += 1
        state.rolled_back(self.components)
        for variable, value in zip(self.metric_variables(), self.committed_metrics):
            variable.assign(value)
        epoch, position = self._reform_and_sync()
        if epoch > self.epoch:
            self._read_elsewhere = True  # and read its metrics: not again (`epoch_results`)
            return True  # the others ended this epoch: its batches are done
        self.position.take(epoch, position)  # the others' newer steps
        self.calls_since_commit = 0
        return position > start

    def _reform_and_sync(self) -> tuple[int, int]:
        """Re-forms Horovod (again while members are lost meanwhile), takes the newest
        commit, re-traces the train function; returns the commit's position. The
        components' state is re-cut for the new replica count (`state.resize`) before
        it takes the newest commit's values."""
        replicas = self.strategy.num_replicas_in_sync
        while True:
            self.member.reform()
            self.strategy.extended.refresh_membership()
            state.resize(self.components, replicas, self.strategy.num_replicas_in_sync)
            replicas = self.strategy.num_replicas_in_sync
            try:
                newest = self._sync()
                break
            except tf.errors.OpError as error:  # another member was lost meanwhile
                if not self.member.is_lost_peer(error):
                    raise
        from tfdist._hooks.keras_steps import remake_train_function

        self._inner = remake_train_function(self.model)
        self._committing = None
        self._snapshot_now(renew=True)
        self.model.train_function = self
        return newest

    # ---- the epoch's end -----------------------------------------------------------
    def epoch_results(self, read):
        """Keras' read of the epoch's metrics (``read``: ``model.get_metrics_result``),
        which sums them over the members: a collective outside the train function.

        A member lost there (or in the epoch's last step, which the others finished) is
        recovered as in a step: each survivor commits the state after the epoch's last
        step, re-forms, takes the newest commit, and reads again over the survivors.
        When the others had read already and moved on (their newest commit is in the
        next epoch), this member returns its last step's logs instead; with a joiner
        that has not trained yet, every member reads its own sums (`_newest_commit`).
        The epoch's logs may then miss the lost member's sums (docs/elastic.md, Limits).
        """
        if tf.inside_function():  # a train step's own read (Keras' compute_metrics)
            return read()
        while True:
            if self._read_elsewhere:
                self._read_elsewhere = False
                return dict(self.last_logs or {})
            try:
                return read()
            except tf.errors.OpError as error:
                if not self.member.is_lost_peer(error):
                    raise
            self.recoveries += 1
            if self.calls_since_commit:
                self.commit()  # every step of the epoch is done: a newer commit
            epoch, _ = self._reform_and_sync()
            self._read_elsewhere = epoch > self.epoch

    def _newest_commit(self) -> tuple[int, tuple[int, int]]:
        """``(rank holding it, (epoch, batch))`` of the newest commit among the members."""
        epoch, batch = self.position.committed_at
        mine = tf.constant([[epoch, batch, self.member.rank()]], tf.int64)
        every = self.member.allgather(mine).numpy()
        if any(int(e) == -1 for e, _, _ in every):
            # A joiner that has not trained keeps its reads of on-read variables (the
            # metrics' read and reset) local (`tfdist.engines.horovod.extended`): so do
            # the members until the next step, which it takes part in.
            self.member.training = False
        newest = max((int(e), int(p)) for e, p, _ in every)
        root = min(int(r) for e, p, r in every if (int(e), int(p)) == newest)
        return root, newest


class NoStateLeftError(RuntimeError):
    """Every member of the membership joined after the last member holding the
    training state was lost: there is no commit to take."""


class _MembershipChanged(Exception):
    """The launcher published a newer membership (a worker joins)."""
