"""``keras.distribution`` on the TensorFlow backend: each Keras distribution runs as a tfdist
strategy.

``import tfdist`` installs this (`tfdist._hooks.keras_distribution` patches Keras when it
loads its distribution module); backend-agnostic Keras 3 code then needs no tfdist line:

- ``list_devices()``: every device of every worker (TF_CONFIG, ``tfdist launch``),
  worker by worker: ``cpu:0`` .. ``cpu:N-1``;
- ``initialize()``: the job from TF_CONFIG, or from ``job_addresses`` (every worker's);
- ``DataParallel()``: `tfdist.MirroredStrategy` over the mesh's devices on one process,
  `tfdist.MultiWorkerMirroredStrategy` on several (the mesh holds every device);
- ``ModelParallel(layout_map=...)`` with layouts on the batch axis: the same strategy
  with ``shard_parameters=True`` and a `ShardFilter` over the layout map;
- ``ModelParallel`` on a mesh ``(1, m)`` whose other axis ("model") has m > 1:
  `tfdist.ModelParallelStrategy` (tensor parallelism, docs/tensor_parallel.md) with the
  layout map's axes renamed "batch" and "model" (`model_layouts`), or
  `tfdist.MultiWorkerModelParallelStrategy` on several processes; on a ``(d, m)`` mesh
  the same with ``model_parallel=m`` (engine "tf" across processes), where a kernel
  laid out ``("batch", "model")`` or ``("model", "batch")`` is also fully sharded over
  the batch axis (`tfdist.strategies.tensor_parallel.batch_axis`).

``set_distribution(d)`` and ``with d.scope():`` make the strategy TF's default
(``tf.distribute.experimental_set_strategy``): build the model after it. A layout on a
mesh axis that is neither the batch axis nor the model axis of a ``(d, m)`` mesh is
refused when its variable is created. In a multi-worker job each worker reads the shard of every global batch that
Keras' ``Distribution.distribute_dataset`` gives it (``auto_shard_dataset``).
"""

from __future__ import annotations

import os

from tfdist import env
from tfdist._hooks.keras_distribution import layout_map_of
from tfdist.cluster import TRAINING_TASK_TYPES, ClusterSpec, TaskSpec
from tfdist.keras.model_strategy import model_call_context  # noqa: F401 (the hooks' API)

_DEVICE_TYPES = ("cpu", "gpu", "tpu")


class _Job:
    """This process's view of the job and the strategies made for Keras distributions."""

    def __init__(self):
        self.cluster: ClusterSpec | None = None
        self.resolved = False
        self.strategies: dict = {}  # plan key -> (strategy, what keeps the key's ids alive)


_job = _Job()


def _cluster() -> ClusterSpec | None:
    """The job (None: this process alone): from `initialize`, else TF_CONFIG."""
    if not _job.resolved:
        _job.cluster = ClusterSpec.from_env() if os.environ.get(env.TF_CONFIG) else None
        _job.resolved = True
    return _job.cluster


def _training_tasks(cluster: ClusterSpec) -> list[TaskSpec]:
    return [t for t in cluster.tasks() if t.type in TRAINING_TASK_TYPES]


def num_processes() -> int:
    """The processes that train (chief and workers); 1 without a cluster."""
    cluster = _cluster()
    return cluster.num_workers if cluster is not None else 1


def process_id() -> int:
    """This process's index among them: the chief first, then the workers (TF's order)."""
    cluster = _cluster()
    if cluster is None or cluster.task is None:
        return 0
    return _training_tasks(cluster).index(cluster.task)


def _check_device_type(device_type):
    if device_type is not None and str(device_type).lower() not in _DEVICE_TYPES:
        raise ValueError(f"device_type must be one of {list(_DEVICE_TYPES)} or None. "
                         f"Received: device_type={device_type!r}")
    return None if device_type is None else str(device_type).lower()


def list_devices(device_type=None) -> list[str]:
    """Every device of every worker, as Keras names them (``"cpu:0"``, ``"gpu:3"``).

    One process: its logical devices (GPUs, else CPUs), as Keras lists them. Several:
    each worker's replicas as `tfdist.MultiWorkerMirroredStrategy` makes them (every
    GPU, else one CPU), numbered worker by worker in `process_id` order, the same list
    on every worker. TF's runtime is not started (the multi-worker strategy must be
    created first).
    """
    import tensorflow as tf

    device_type = _check_device_type(device_type)
    if num_processes() == 1:
        found = tf.config.list_logical_devices(
            device_type.upper() if device_type else None)
        others = [d for d in found if d.device_type.lower() != "cpu"]
        if device_type is None:
            found = others or [d for d in found if d.device_type.lower() == "cpu"]
        return [f"{d.device_type.lower()}:{d.name.split(':')[-1]}" for d in found]
    gpus = len(tf.config.list_physical_devices("GPU"))
    kind = device_type or ("gpu" if gpus else "cpu")
    per_worker = {"gpu": gpus, "cpu": 1 if not gpus or device_type == "cpu" else 0,
                  "tpu": 0}[kind]
    return [f"{kind}:{i}" for i in range(num_processes() * per_worker)]


def get_device_count(device_type=None) -> int:
    """``len(list_devices(device_type))``."""
    return len(list_devices(device_type))


def initialize(job_addresses=None, num_processes=None, process_id=None) -> None:
    """The job Keras' distributions run on; call it before creating a distribution.

    With no argument: TF_CONFIG (``tfdist launch`` sets it), or this process alone.
    Otherwise ``job_addresses`` lists every worker's ``host:port`` (TensorFlow needs them
    all; JAX needs only the first), comma-separated, and ``process_id`` is this
    process's index in it. The job forms (every worker waits for the others) when the
    first distribution is set.

    Raises:
        ValueError: inconsistent arguments, or a distribution is already running.
    """
    if _job.strategies:
        raise ValueError("keras.distribution.initialize() must run before a distribution "
                         "is set: the job is already running. Received: initialize("
                         f"job_addresses={job_addresses!r}, num_processes={num_processes!r}, "
                         f"process_id={process_id!r})")
    received = (f"Received: job_addresses={job_addresses!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r}")
    if job_addresses is None:
        _job.resolved = False
        cluster = _cluster()
        have = (cluster.num_workers if cluster else 1,
                _training_tasks(cluster).index(cluster.task) if cluster and cluster.task else 0)
        if (num_processes, process_id) != (None, None) and (
                num_processes not in (None, have[0]) or process_id not in (None, have[1])):
            raise ValueError(f"num_processes and process_id disagree with TF_CONFIG (which "
                             f"says num_processes={have[0]}, process_id={have[1]}). {received}")
        return
    addresses = [a.strip() for a in str(job_addresses).split(",") if a.strip()]
    if num_processes is not None and num_processes != len(addresses):
        raise ValueError("on TensorFlow, job_addresses must list every process's "
                         f"host:port ({num_processes} processes, {len(addresses)} "
                         f"address(es)). {received}")
    if process_id is None or not 0 <= int(process_id) < len(addresses):
        raise ValueError(f"process_id must be this process's index in job_addresses. {received}")
    _job.cluster = ClusterSpec(worker=tuple(addresses), task=TaskSpec("worker", int(process_id)))
    _job.resolved = True


# ---- distributions -> strategies --------------------------------------------------------


def _batch_axis(distribution) -> str:
    return distribution.batch_dim_name or distribution.device_mesh.axis_names[0]


def _axes(layout):
    return tuple(layout.axes) if hasattr(layout, "axes") else layout


def refuse_layout(field: str, value, layout, batch: str, why: str) -> ValueError:
    """The one error for a layout tfdist cannot run (``field=value`` names what has it)."""
    return ValueError(
        f"tfdist cannot run the layout {_axes(layout)!r} of {field.split('.')[0]} {value!r} "
        "on TensorFlow: "
        f"{why}. tfdist lays variables out over the batch axis {batch!r} (fully sharded "
        f"parameters), over the other axis of a (d, m) mesh, m > 1 (tensor "
        f"parallelism), or over both. Received: {field}={value!r}, "
        f"layout={_axes(layout)!r}")


def check_variable_layout(distribution, path: str, layout) -> None:
    """Raises when tfdist cannot honour ``layout`` for the variable at ``path``; called
    when the variable is created under ``distribution``."""
    from keras.distribution import DataParallel, ModelParallel, TensorLayout

    if layout is None or not isinstance(distribution, (DataParallel, ModelParallel)):
        return
    batch = _batch_axis(distribution)
    what = ("variable.path", path)
    if not isinstance(layout, TensorLayout):
        raise refuse_layout(*what, layout, batch, "it is not a keras.distribution.TensorLayout")
    used = [axis for axis in layout.axes if axis is not None]
    model_axis = tensor_parallel_axis(distribution)
    others = [axis for axis in used if axis not in (batch, model_axis)]
    if others:
        raise refuse_layout(*what, layout, batch, f"it uses mesh axis {others[0]!r}")
    if used and isinstance(distribution, DataParallel):
        raise refuse_layout(*what, layout, batch, "DataParallel replicates variables (use "
                            "ModelParallel with a LayoutMap to shard them)")


def _check_tensor_layout(layout):
    """Layer outputs and values: only the batch axis on the first dimension (data
    parallelism already splits every batch that way)."""
    import keras

    distribution = keras.distribution.distribution()
    if layout is None or distribution is None:
        return
    batch = _batch_axis(distribution)
    axes = _axes(layout)
    if not isinstance(axes, tuple) or any(a is not None and (a != batch or i != 0)
                                          for i, a in enumerate(axes)):
        raise refuse_layout("tensor", "a layer output or value", layout, batch,
                            "only its first dimension may be laid out, on the batch axis")


def distribute_tensor(tensor, layout):
    """Keras' relayout of a layer output: checked, and otherwise the tensor itself."""
    _check_tensor_layout(layout)
    return tensor


def distribute_value(value, tensor_layout):
    """As `distribute_tensor`."""
    _check_tensor_layout(tensor_layout)
    return value


class ShardFilter:
    """``shard_filter`` for a strategy with ``shard_parameters=True`` from a ``LayoutMap``:
    True for a variable path whose layout uses the batch axis, else False (Keras
    replicates a variable no layout matches). Lookup is Keras' own ``layout_map[path]``:
    the exact key first, then the one key that ``re.fullmatch``-es."""

    def __init__(self, layout_map, batch: str):
        self.layout_map, self.batch = layout_map, batch

    def __call__(self, path: str) -> bool:
        layout = self.layout_map[path]
        return layout is not None and self.batch in _axes(layout)


def strategy_plan(distribution) -> tuple[str, dict]:
    """``(strategy class name, keyword arguments)`` that run ``distribution``.

    Raises:
        ValueError: a distribution, mesh or device list tfdist cannot run.
    """
    from keras.distribution import DataParallel, ModelParallel

    if not isinstance(distribution, (DataParallel, ModelParallel)):
        raise ValueError("tfdist runs keras.distribution.DataParallel and ModelParallel. "
                         f"Received: distribution={distribution!r}")
    mesh, batch = distribution.device_mesh, _batch_axis(distribution)
    devices = [str(d) for d in mesh.devices.flatten()]
    model_axis = tensor_parallel_axis(distribution)
    if model_axis is not None:
        layouts = model_layouts(layout_map_of(distribution), batch, model_axis)
        shape = dict(zip(mesh.axis_names, mesh.shape))
        if shape.get(batch, 1) > 1:  # a (d, m) mesh: replica r = data r // m, model r % m
            layouts = {"layout_map": layouts, "model_parallel": shape[model_axis]}
        else:
            layouts = {"layout_map": layouts}
        if num_processes() == 1:
            return "ModelParallelStrategy", {"devices": [_tf_device(d) for d in devices],
                                             **layouts}
        _check_every_device(devices)
        return "MultiWorkerModelParallelStrategy", {"cluster_resolver": _cluster(),
                                                    **layouts}
    kwargs = {}
    if isinstance(distribution, ModelParallel):
        layout_map = layout_map_of(distribution)
        if any(batch in _axes(layout) for layout in layout_map.values()):
            kwargs = {"shard_parameters": True, "shard_filter": ShardFilter(layout_map, batch)}
    if num_processes() == 1:
        return "MirroredStrategy", {"devices": [_tf_device(d) for d in devices], **kwargs}
    _check_every_device(devices)
    return "MultiWorkerMirroredStrategy", {"cluster_resolver": _cluster(), **kwargs}


def _check_every_device(devices) -> None:
    everything = list_devices(devices[0].split(":")[0])
    if sorted(devices) != sorted(everything):
        raise ValueError("a multi-worker mesh must hold every device of every worker "
                         f"(keras.distribution.list_devices()). Received: devices={devices}, "
                         f"list_devices()={everything}")


def tensor_parallel_axis(distribution):
    """The mesh axis of size > 1 other than the batch axis (tensor parallelism over
    `tfdist.ModelParallelStrategy`), or None.

    Raises:
        ValueError: a mesh tfdist cannot run that way: the batch axis of size > 1 too
            laid out second (a data x model mesh is ``(batch, model)``), more than one
            such axis, or a ``DataParallel``.
    """
    from keras.distribution import ModelParallel

    mesh, batch = distribution.device_mesh, _batch_axis(distribution)
    wide = [(a, n) for a, n in zip(mesh.axis_names, mesh.shape) if a != batch and n > 1]
    if not wide:
        return None
    data = dict(zip(mesh.axis_names, mesh.shape)).get(batch, 1)
    if len(wide) > 1 or not isinstance(distribution, ModelParallel):
        raise ValueError(
            "tfdist runs one mesh axis other than the batch axis (tensor parallelism) as "
            f"ModelParallel; axis {wide[0][0]!r} has size {wide[0][1]}, the batch axis "
            f"{batch!r} {data}. Received: device_mesh={mesh}")
    if data > 1 and list(mesh.axis_names).index(batch) != 0:
        raise ValueError(
            "tfdist lays a data x model mesh out as DeviceMesh((d, m), [batch, model]): "
            f"the batch axis first. Received: device_mesh={mesh}")
    return wide[0][0]


def model_layouts(layout_map, batch: str, model_axis: str) -> dict:
    """A ``LayoutMap`` as `tfdist.ModelParallelStrategy` takes it: each key's axes with
    the mesh's model axis named ``"model"`` and the batch axis ``"batch"``."""
    names = {batch: "batch", model_axis: "model", None: None}
    return {key: tuple(names.get(a, a) for a in _axes(layout_map[key]))
            for key in layout_map.keys()}


def _worker_rows(workers: int, index: int):
    """A ``Dataset.map`` function: worker ``index``'s block of rows of each global batch
    (an error for a batch that does not split evenly over the workers)."""
    import tensorflow as tf

    def cut(x):
        size = tf.shape(x)[0]
        tf.debugging.assert_equal(size % workers, 0, message=(
            f"each global batch must split evenly over the {workers} workers"))
        part = size // workers
        return x[index * part:(index + 1) * part]

    def rows(*elements):
        return tf.nest.map_structure(cut, elements if len(elements) > 1 else elements[0])

    return rows


def _tf_device(name: str) -> str:
    kind, _, index = name.partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


def strategy_for(distribution):
    """The tfdist strategy that runs ``distribution`` (made once per plan)."""
    from tfdist.strategies.mirrored import MirroredStrategy
    from tfdist.strategies.model_parallel import (ModelParallelStrategy,
                                                  MultiWorkerModelParallelStrategy)
    from tfdist.strategies.multi_worker import MultiWorkerMirroredStrategy

    name, kwargs = strategy_plan(distribution)
    shard_filter = kwargs.get("shard_filter")
    keep = shard_filter
    if name in ("ModelParallelStrategy", "MultiWorkerModelParallelStrategy"):
        keep = layout_map_of(distribution)
    key = (name, tuple(kwargs.get("devices", ())), id(keep.layout_map) if shard_filter
           else (id(keep) if keep is not None else None))
    if key not in _job.strategies:
        if name.startswith("MultiWorker") and _job.strategies:
            raise ValueError("a multi-worker process runs one tfdist strategy: this "
                             "distribution needs another one than the distribution set "
                             f"before. Received: distribution={distribution!r}")
        strategy = {"MirroredStrategy": MirroredStrategy,
                    "ModelParallelStrategy": ModelParallelStrategy,
                    "MultiWorkerModelParallelStrategy": MultiWorkerModelParallelStrategy,
                    "MultiWorkerMirroredStrategy": MultiWorkerMirroredStrategy}[name](**kwargs)
        _job.strategies[key] = (strategy, keep)
    return _job.strategies[key][0]


def on_set_distribution(distribution, set_keras) -> None:
    """``keras.distribution.set_distribution`` (and ``Distribution.scope``): Keras'
    own, then its strategy becomes TF's default, or none for None. A model built before
    keeps its own (`tfdist.keras.model_strategy`)."""
    import tensorflow as tf

    from tfdist.keras import handoff, model_strategy

    strategy = None if distribution is None else strategy_for(distribution)
    tf.distribute.experimental_set_strategy(strategy)  # raises inside a strategy's scope
    set_keras(distribution)
    if strategy is not None:
        model_strategy.record(strategy, distribution)
        handoff.install_keras_hooks()  # before the model-call patch (which wraps them)


def distribute_dataset(distribution, dataset, keras_shard):
    """``Distribution.distribute_dataset``: Keras' sharding (``keras_shard``); with
    several workers each one's shard goes to its replicas as it is.

    Keras' shard of a dataset of N global batches holds N batches on every worker when
    every batch is full; tfdist says so (``assert_cardinality``), so that ``fit`` knows
    its steps (with an unknown count, every worker would run one more, empty, step at
    the end of each epoch) and a worker left with fewer batches fails with TF's error.
    """
    import tensorflow as tf

    sharded = keras_shard(dataset)
    if num_processes() == 1:
        return sharded
    strategy = strategy_for(distribution)
    if getattr(strategy, "tensor_parallel", None) is not None:
        # Keras gives each process its data row's rows (on a (1, m) mesh the whole
        # global batch); tensor parallelism wants each replica's own rows: this worker's
        # block of each global batch (its model group's rows are then its data row's).
        sharded = dataset.map(_worker_rows(num_processes(), process_id()))
    total = int(dataset.cardinality().numpy())
    if total >= 0 and int(sharded.cardinality().numpy()) < 0:
        sharded = sharded.apply(tf.data.experimental.assert_cardinality(total))
    local = strategy.num_replicas_in_sync // num_processes()
    if local > 1:
        size = tf.nest.flatten(sharded.element_spec)[0].shape[0]
        if size is None or size % local:
            raise ValueError(f"each worker's batch must split evenly over its {local} "
                             f"replicas. Received: batch size={size}")
        sharded = sharded.rebatch(size // local)
    return strategy.distribute_datasets_from_function(lambda context: sharded)
