"""Model averaging (local SGD): each replica trains its own copy; weights are averaged.

Every replica applies its own optimizer update to its own copy of the model (no gradient
all-reduce). Every ``period`` steps (every step during ``warmup_steps``) the weights are
all-reduced to their mean; with an ``outer_optimizer`` the averaged change since the
last average is applied as an outer gradient (SlowMo / DiLoCo). See docs/model_average.md.

How it works with plain Keras code (private hooks in `tfdist._hooks`):

- The strategy is a `tfdist.MultiWorkerMirroredStrategy` whose engine moves the
  averages (`tfdist.engines`); on one host its replicas are the local devices, as in
  `tfdist.MirroredStrategy`. Variables are mirrored, but since every replica applies a
  different update, their per-replica copies differ between averages, which is the
  point.
- Keras scales the loss by ``1/num_replicas_in_sync`` and SUM-all-reduces gradients. The
  optimizer step is routed through `ModelAverageStrategy.keras_local_update`, which
  multiplies the local gradients by the number of replicas (so the learning rate is
  the user's), skips the all-reduce, applies the local update, then, in cross-replica
  context and under a ``tf.cond`` on the optimizer's step counter, averages.
- All-reduced payloads are weight *deltas* against an anchor copy (the weights at the
  last average): ``w = anchor - mean(anchor - w_i)``. That is the mean of the replicas,
  the outer gradient of SlowMo/DiLoCo, and what ``compression`` casts to fp16/bf16.
- Under ``fit``, the model's non-trainable floats (BatchNorm's moving statistics) are
  averaged with the weights, as plain means.
- Between averages a step sends nothing and waits for no peer: the train step's loss and
  metrics stay on this worker (`keras_local_step_outputs`), so per-step logs are this
  worker's; Keras' on-read metric variables give the epoch's logs over every worker.
- ``fit`` ends, and ``evaluate``/``predict``/``save`` start, with an average of every
  per-replica variable (weights, optimizer slots, non-trainable state) if the replicas
  may differ, so the model the user holds is one model.

The parts are objects, each in its module of `tfdist.strategies.averaging`: the state of
each trained optimizer and of each of its fragments (anchors, outer optimizer,
residuals, buffers) in ``fragment``, the runner (one schedule for every ``sync_delay``)
in ``runner``, its stages (deltas, exchange, apply, forced average) in ``exchange``, the
outer optimizer in ``outer``, the Keras hand-off in ``keras``, elastic jobs in
``elastic``.
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfdist import env
from tfdist.comm.averaging import PeriodicAverager
from tfdist.engines.registry import engine_class, select_engine
from tfdist.keras import handoff
from tfdist.keras.optimizer import inner_optimizer
from tfdist.strategies.options.arguments import check_model_average
from tfdist.strategies.averaging import elastic, exchange, outer
from tfdist.strategies.averaging.fragment import (is_replicated_float, make_state,
                                                  wants_multi_worker)
from tfdist.strategies.averaging.keras import AverageHandoffMixin
from tfdist.strategies.averaging.runner import Runner
from tfdist.strategies.mirrored import make_local_extended
from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy


class ModelAverageStrategy(AverageHandoffMixin, MultiWorkerMirroredStrategy):
    """Local SGD / model averaging for Keras ``fit``, on one host or many workers.

    Each replica (local device, logical CPU, or worker) takes its own sub-batch and
    applies its own optimizer update with the learning rate as given (it is not
    divided by the number of replicas). Every ``period`` steps the weights are
    all-reduced to their mean. ``period=1`` with plain SGD is synchronous training.

    A `tfdist.MultiWorkerMirroredStrategy`: its replicas are every device of every
    worker when ``cluster_resolver`` is given, TF_CONFIG names several workers or the
    engine is not TF's; otherwise the local devices (as `tfdist.MirroredStrategy`),
    and Keras treats it as a one-host strategy.

    Args:
        period: Average the weights every ``period`` optimizer steps (>= 1).
        warmup_steps: Average after each of the first ``warmup_steps`` steps
            (post-local SGD); ``period`` counts from the end of the warm-up.
        outer_optimizer: A Keras optimizer (e.g.
            ``keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)``), a function
            returning one, or its config (dict or name). At each average,
            ``anchor - mean(w_i)`` is applied to the anchor (the weights at the last
            average) as its gradient (SlowMo / DiLoCo). The strategy uses its own copy,
            made in its scope; read it as ``strategy.outer_optimizers``. On several
            workers pass a function: making an optimizer starts TensorFlow, and the
            multi-worker strategy must come first.
        average_optimizer_state: Also average the optimizer's slots (momentum, Adam
            moments) at each scheduled average (with ``fragments=1`` only).
        devices: Local devices, one replica each (single host only). Default: every
            GPU, or every logical CPU (`tfdist.devices.use_logical_cpus`).
        cluster_resolver: Anything `tfdist.MultiWorkerMirroredStrategy` takes; given
            (or TF_CONFIG with several workers), replicas are every device of every
            worker.
        engine: A registered engine name or ``"auto"``, as for
            `tfdist.MultiWorkerMirroredStrategy`: the engine of the weight average
            (and of the epoch's loss/metric reduction) across workers, with the same
            global batch and sharding with every engine. Under Horovod the strategy
            sets ``HOROVOD_CYCLE_TIME=10`` (ms) unless it is set, so that Horovod's
            negotiation between averages is a tenth of its default.
        compression: None, ``"fp16"`` or ``"bf16"``: weight deltas are cast for the
            all-reduce (`bytes_communicated` shows the saving).
        fragments: Streaming DiLoCo: the trainable variables are split, in layer order,
            into ``fragments`` parts of about equal bytes; fragment ``f`` averages
            ``f * period / fragments`` steps into each period (after the warm-up), with
            its own outer optimizer, so the largest exchange is about ``1/fragments``
            of the model. ``period`` must be a multiple of ``fragments``, which may not
            exceed the number of trainable variables. ``fit`` ends with a full average.
        sync_delay: Overlapped syncs: a fragment's exchange starts at its step and is
            applied ``sync_delay`` inner steps later (0 <= it < ``period/fragments``),
            while the worker trains on (`tfdist.strategies.averaging.runner`).
        mix: The applied fragment is ``mix * global + (1 - mix) * local`` (0..1).
        outer_compression: None, ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"int4"``: each
            replica's outer gradient plus its error-feedback residual is quantised and
            all-gathered (`tfdist.comm.quantize`); not with ``compression``.
        communication_options: A `tfdist.CommunicationOptions`: its ``compression``
            (as above) and ``timeout_seconds`` (collective timeout on several
            workers) apply; ``accumulate_steps`` > 1 is refused (no gradient all-reduce).
        **base_kwargs: Passed to `tfdist.MultiWorkerMirroredStrategy` (e.g.
            ``collective_timeout``, ``startup_timeout``).

    Attributes:
        communication: The `tfdist.CommunicationOptions` in use.
        compression: ``communication.compression`` as a policy (its ``name``).
        averager: The `tfdist.comm.averaging.PeriodicAverager`.
        runner: The `tfdist.strategies.averaging.runner.Runner` (the same class for
            every ``sync_delay``).
        exchanges_rarely: True: engines may trade a collective's latency for quiet
            between averages.

    Raises:
        ValueError: an argument is invalid (the message names it and its value).
    """

    exchanges_rarely = True

    def __init__(self, period=1, warmup_steps=0, outer_optimizer=None,
                 average_optimizer_state=False, devices=None, cluster_resolver=None, *,
                 compression=None, engine="auto", fragments=1, sync_delay=0, mix=1.0,
                 outer_compression=None,
                 **base_kwargs):
        checked = check_model_average(
            period, warmup_steps, outer_optimizer, average_optimizer_state, devices,
            compression=compression, engine=engine, fragments=fragments,
            sync_delay=sync_delay, mix=mix, outer_compression=outer_compression,
            **base_kwargs)
        self.period, self.warmup_steps = checked["period"], checked["warmup_steps"]
        self.fragments = checked["fragments"]
        self.sync_delay, self.mix = checked["sync_delay"], checked["mix"]
        base_kwargs, options = checked["base_kwargs"], checked["options"]
        self.runner = Runner(self, self.sync_delay, self.mix)
        self._outer_template = outer_optimizer
        self.average_optimizer_state = checked["average_optimizer_state"]
        self._options = options
        self.outer_compression = checked["outer_compression"]
        if os.environ.get(env.ELASTIC_ADDR):
            elastic.check_elastic(self, base_kwargs.get("commit_every_steps", 1))
        if options.timeout_seconds is not None:
            base_kwargs.setdefault("collective_timeout", options.timeout_seconds)
        # One host: the local devices are the replicas, when the engine serves them
        # through TF's own MirroredExtended.
        self._one_host = not wants_multi_worker(cluster_resolver) and engine_class(
            select_engine(engine, 1, on_gpus=False)).serves_one_host
        if devices is not None and not self._one_host:
            raise ValueError("devices is for one host; with several workers every local "
                             f"device is a replica. Received: devices={devices!r}")
        self._devices = devices
        self._states = {}  # id(optimizer) -> its AveragingState
        self._model_state = {}  # id(optimizer) -> the fit model's non-trainable floats
        try:
            super().__init__(cluster_resolver=cluster_resolver, engine=engine,
                             **base_kwargs)
        except RuntimeError as error:
            if "at program startup" not in str(error):
                raise
            raise RuntimeError(
                "ModelAverageStrategy on several workers must be created before any "
                "TensorFlow op runs (creating a Keras optimizer runs some). Create the "
                "strategy first, and pass outer_optimizer as a function, e.g. "
                "outer_optimizer=lambda: keras.optimizers.SGD(0.7, momentum=0.9, "
                f"nesterov=True). TensorFlow said: {error}") from error
        handoff.install_keras_hooks()

    def _create_extended(self, cluster_resolver, communication_options):
        """One host: TF's ``MirroredExtended`` over the local devices."""
        if self._one_host:
            return make_local_extended(self, self._devices)
        return super()._create_extended(cluster_resolver, communication_options)

    def _init_communication(self, options):
        """The averager, through the engine's communicators (no gradient all-reduce).

        Called after the engine made the extended: a multi-worker strategy must
        exist before any TF variable."""
        del options  # the base got none: this strategy keeps its own (with compression)
        self.communication = self._options
        self.averager = PeriodicAverager(self.period, self.warmup_steps,
                                         compression=self.communication.compression_policy,
                                         make_communicator=self._engine.make_communicator,
                                         fragments=self.fragments,
                                         outer_compression=self.outer_compression)

    def state_components(self, model) -> list:
        """The state of ``model``'s training (`tfdist.strategies.state`): the model and
        its optimizer, each worker's metric sums, and one
        `tfdist.strategies.averaging.elastic.AveragedModel` (the weights and slots each
        member keeps apart between averages, its fragments' anchors and outer
        optimizers); members meet only at averages."""
        from tfdist.strategies._components import KerasState, MetricsState

        return [KerasState(model), MetricsState(self, model),
                elastic.AveragedModel(self, model)]

    # ---- the averaging state, by optimizer -----------------------------------------------

    @property
    def has_outer_optimizer(self) -> bool:
        """Whether an ``outer_optimizer`` was given."""
        return self._outer_template is not None

    def averaging_state(self, optimizer):
        """The `tfdist.strategies.averaging.fragment.AveragingState` of ``optimizer``
        (the inner one), or None before its first step."""
        return self._states.get(id(optimizer))

    def averaging_state_for(self, optimizer, variables):
        """The `AveragingState` of ``optimizer``, made once (outside any traced step,
        in this strategy's scope) over its trainable ``variables``."""
        if id(optimizer) not in self._states:
            with tf.init_scope(), self.scope():
                self._states[id(optimizer)] = make_state(
                    optimizer, variables, self.fragments, self._make_outer,
                    with_residuals=bool(self.outer_compression),
                    slots=exchange.optimizer_slots(optimizer))
        return self._states[id(optimizer)]

    def _make_outer(self, anchors):
        """A built copy of the outer optimizer over ``anchors``, or None."""
        if self._outer_template is None:
            return None
        made = outer.make_outer(self._outer_template)
        made.build(anchors)
        return made

    def set_model_state(self, optimizer, variables) -> None:
        """The model's non-trainable floats (BatchNorm statistics), averaged with the
        weights of ``optimizer`` as plain means (set at each ``fit``'s start)."""
        self._model_state[id(optimizer)] = list(variables)

    def plain_variables(self, state) -> list:
        """What goes with the weights of ``state`` as plain means: the optimizer slots
        when ``average_optimizer_state``, and the model's non-trainable floats."""
        return ((state.slots if self.average_optimizer_state else [])
                + self._model_state.get(id(state.optimizer), []))

    @property
    def cluster_resolver(self):
        """TF's cluster resolver; None on one host."""
        return None if self._one_host else super().cluster_resolver

    @property
    def compression(self):
        """``communication.compression`` as a policy (``.name``: None, fp16 or bf16)."""
        return self.communication.compression_policy

    # ---- public --------------------------------------------------------------------------

    @property
    def bytes_communicated(self) -> int:
        """Bytes this strategy all-reduced to average models (one replica's payload
        per average, after compression)."""
        return self.averager.bytes_communicated

    @property
    def outer_optimizers(self) -> list:
        """The outer optimizers in use (per trained optimizer, one per fragment)."""
        return [made for state in self._states.values() for made in state.outers]

    def is_average_step(self, step: int, fragment=None) -> bool:
        """Whether every fragment (or ``fragment``) is averaged after optimizer step
        ``step`` (1-based)."""
        return bool(self.averager.should_average(int(step), fragment))

    def average(self, model, full: bool = True) -> bool:
        """Averages the per-replica variables of ``model`` (and its optimizer) now.

        Called automatically when ``fit`` returns and before ``evaluate``, ``predict``
        and ``save``; call it yourself in custom training loops. The step counter is
        not changed (the schedule stays a function of the optimizer's step).

        Args:
            model: The Keras model trained under this strategy.
            full: Every per-replica variable (weights, optimizer slots, non-trainable
                state), exactly: with ``outer_compression``, ``delta + residual`` goes
                in float32 and the error-feedback residuals become zero (``fit``'s end
                and saves, so a backup holds all state). False: the model's variables
                only, as the scheduled averages send them (compressed, with error
                feedback): what ``evaluate`` and ``predict`` need.

        Returns:
            True if the replicas could differ and were averaged, False if there was
            nothing to do.
        """
        optimizer = inner_optimizer(getattr(model, "optimizer", None))
        state = self.averaging_state(optimizer)
        if state is None:
            return False
        self.runner.finish(state)  # an exchange in flight is applied first
        step = int(optimizer.iterations.numpy())
        done = state.full_at == step or (not full and state.averaged_at == step)
        if step == 0 or done or (
                self.runner.in_step and self.is_average_step(step)
                and not (full and state.residuals is not None)
                and not self._differs_after_average(model, optimizer, full)):
            return False  # every variable asked for is already one value
        exchange.force_average(self, model, state, full)
        state.averaged_at = step
        if full:
            state.full_at = step
        return True

    def _differs_after_average(self, model, optimizer, full=True) -> bool:
        """Whether a scheduled average leaves per-replica floats different: the optimizer
        slots (unless ``average_optimizer_state``) and non-trainable state (BatchNorm
        statistics). Saving then needs a forced average too, or a backup would keep
        only replica 0's copy and a resumed run would differ. ``full=False``: the
        model's variables only."""
        slots = ([] if self.average_optimizer_state or not full
                 else exchange.optimizer_slots(optimizer))
        return bool(slots) or any(is_replicated_float(v) for v in model.non_trainable_weights)
