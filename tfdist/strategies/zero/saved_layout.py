"""Sharded optimizer state in the unsharded optimizer's layout (for saves).

`tfdist.strategies.zero.optimizer.ShardedOptimizer.save_own_variables` gathers the slot slices into a
*template*: an optimizer of the same class built on the model's variables, outside the
strategy, on this host's CPU. The file then holds what an unsharded run writes
(counters and every slot, whole): it loads in a plain process, and a backup made on N
workers resumes on M. Loading fills the template; each replica then takes its slice of
every slot from it (at once, or when its sharded state is first made).
"""

from __future__ import annotations

import re

import numpy as np

from tfdist._hooks import zero as zero_hooks

_SLOT_NAME = re.compile(r"^tfdist_shard_\d+_bucket_(\d+)_(.+)$")


def make_template(optimizer, variables):
    """An unsharded optimizer like ``optimizer``, built on ``variables``' shapes."""
    import tensorflow as tf

    with zero_hooks.plain_variables(), tf.device("/cpu:0"):
        template = type(optimizer).from_config(optimizer.get_config())
        template.build(variables)
    return template


def _slot_names(state):
    """``{(bucket, slot name): position in the first inner optimizer's variables}``."""
    found = {}
    for position, variable in enumerate(state.optimizers[0].variables):
        match = _SLOT_NAME.match(variable.name.split("/")[-1].split(":")[0])
        if match:
            found[(int(match.group(1)), match.group(2))] = position
    return found


def _template_slot(template, variable, slot):
    """The template's ``slot`` variable of model variable ``variable``."""
    name = variable.path.replace("/", "_") + "_" + slot
    for candidate in template.variables:
        if candidate.name == name:
            return candidate
    raise ValueError(f"the {type(template).__name__} optimizer has no slot {slot!r} for "
                     f"{variable.path} (looked for {name!r})")


def gather_into_template(strategy, state, optimizer, variables):
    """Eager, on every worker: the template with the full state (a collective)."""
    import tensorflow as tf

    from tfdist.comm.communicator import per_replica

    template = make_template(optimizer, variables)
    for (k, slot), position in sorted(_slot_names(state).items()):
        parts = [tf.convert_to_tensor(inner.variables[position]) for inner in state.optimizers]
        full = strategy.gather(per_replica(parts, always_wrap=True), axis=0).numpy()
        bucket = state.buckets[k]
        for p, m in enumerate(bucket.members):
            values = full[bucket.offsets[p]:bucket.offsets[p] + bucket.sizes[p]]
            _template_slot(template, variables[m], slot).assign(
                values.reshape(bucket.shapes[p]))
    copy_counters(optimizer, template)
    return template


def scatter_from_template(state, template, variables) -> None:
    """Each local replica's slot slices from the template's whole slots."""
    for (k, slot), position in _slot_names(state).items():
        bucket = state.buckets[k]
        full = np.zeros(bucket.slice_size * state.replicas, bucket.dtype)
        for p, m in enumerate(bucket.members):
            values = np.asarray(_template_slot(template, variables[m], slot)).reshape(-1)
            full[bucket.offsets[p]:bucket.offsets[p] + bucket.sizes[p]] = values
        for i, replica in enumerate(state.replica_ids):
            lo = replica * bucket.slice_size
            state.optimizers[i].variables[position].assign(full[lo:lo + bucket.slice_size])


def copy_counters(source, target) -> None:
    """``target``'s variables named as ``source``'s (iterations, learning rate) set."""
    named = {v.name: v for v in target.variables}
    for variable in source.variables:
        if variable.name in named:
            named[variable.name].assign(np.asarray(variable))
