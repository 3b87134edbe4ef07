"""Local devices: discovery, and splitting one CPU into logical devices.

Logical CPUs let one host run several replicas for tests and notebooks. They must be
configured before TensorFlow initializes its runtime.
"""

from __future__ import annotations

import warnings

from tfdist.checks import check_device_list, check_int


def use_logical_cpus(n: int) -> list[str]:
    """Splits the first physical CPU into ``n`` logical devices.

    Call it before any TensorFlow op runs. Calling it again with the same ``n`` is a
    no-op.

    Args:
        n: Number of logical CPU devices, >= 1.

    Returns:
        The logical CPU device names, e.g. ``["/device:CPU:0", "/device:CPU:1"]``.

    Raises:
        ValueError: ``n`` < 1.
        RuntimeError: TensorFlow already initialized with a different split.
    """
    import tensorflow as tf

    check_int("n", n, 1)
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return cpu_device_names()
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return cpu_device_names()
        raise RuntimeError(
            f"cannot split the CPU into {n} logical devices: TensorFlow has already "
            f"initialized with {have}. Call tfdist.devices.use_logical_cpus({n}) before "
            "any TensorFlow op runs (for a notebook, restart the kernel).") from None
    return cpu_device_names()


def cpu_device_names() -> list[str]:
    """Names of the local logical CPU devices."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("CPU")]


def gpu_device_names() -> list[str]:
    """Names of the local logical GPU devices."""
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("GPU")]


def default_devices() -> list[str]:
    """All local GPUs, or else every logical CPU."""
    return gpu_device_names() or cpu_device_names()


def multi_worker_devices() -> list[str]:
    """One worker's replicas as TF's ``MultiWorkerMirroredStrategy`` makes them: every
    local GPU, else one CPU (logical CPUs split one physical CPU: not replicas)."""
    return gpu_device_names() or cpu_device_names()[:1]


def validate_devices(devices) -> list[str]:
    """Checks that every requested device exists on this host.

    GPUs named on a host without GPUs are kept, with a warning: as in TF, their ops
    run on the CPU (soft placement).

    Raises:
        ValueError: a device is unknown, duplicated, or the list is empty.
    """
    import tensorflow as tf

    devices = check_device_list(devices)

    def key(spec):
        return (spec.device_type or "").upper(), spec.device_index or 0

    known = {key(tf.DeviceSpec.from_string(d.name)) for d in tf.config.list_logical_devices()}
    soft_placed = []
    for device in devices:
        try:
            spec = tf.DeviceSpec.from_string(device)
        except (ValueError, TypeError):
            raise ValueError(f"not a device name: {device!r}. Expected e.g. '/gpu:0' or "
                             "'/cpu:0'.") from None
        if spec.job in (None, "localhost") and is_gpu_on_a_cpu_host(spec, known):
            soft_placed.append(device)
        elif spec.job not in (None, "localhost") or key(spec) not in known:
            raise ValueError(f"device {device!r} does not exist on this host. Available: "
                             f"{sorted(d.name for d in tf.config.list_logical_devices())}")
    if soft_placed:
        warnings.warn(
            f"this host has no GPU: the replicas on {soft_placed} run on the CPU (TF's soft "
            "device placement, as tf.distribute.MirroredStrategy does)", stacklevel=3)
    return devices


def is_gpu_on_a_cpu_host(spec, known) -> bool:
    """Whether ``spec`` (a `tf.DeviceSpec`) names a GPU and the host has none: TF places
    its ops on the CPU (soft placement)."""
    return (spec.device_type or "").upper() == "GPU" and not any(
        kind == "GPU" for kind, _ in known)


def are_soft_placed_on_the_cpu(devices) -> bool:
    """Whether every one of ``devices`` is a CPU, or a GPU of a host without GPUs."""
    import tensorflow as tf

    has_gpus = bool(gpu_device_names())
    return all((tf.DeviceSpec.from_string(d).device_type or "").upper() == "CPU"
               or not has_gpus for d in devices)
