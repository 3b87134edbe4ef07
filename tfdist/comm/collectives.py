"""Counting the cross-worker collectives a traced step issues, from its graph.

A step's graph (a ``FuncGraph``) is read as its ``GraphDef``: every op whose type is a
collective of an engine (TF's ``Collective*`` ops, Horovod's ``Horovod*`` ops, NCCL's)
is counted, following called functions and loop bodies. Ops inside a branch of a
conditional (``If``, ``Case``) run only on the steps that take that branch, such as
model averaging's average; they are counted apart. So a step issues ``every_step``
collectives each time it runs, plus those of the branches it takes.
"""

from __future__ import annotations

import dataclasses

# Op types that send to or wait for other workers.
COLLECTIVE_OP_PREFIXES = ("Collective", "Horovod", "NcclAllReduce", "NcclReduce",
                          "NcclBroadcast")
_BRANCHING_OPS = ("If", "StatelessIf", "Case", "StatelessCase")


@dataclasses.dataclass(frozen=True)
class CollectiveCount:
    """Collective ops of one traced step.

    Attributes:
        every_step: Ops run on every execution of the step (loop bodies counted once).
        in_branches: Ops inside a conditional's branches (run on some steps only).
        op_types: Every collective op type seen, sorted.
    """

    every_step: int
    in_branches: int
    op_types: tuple


def is_collective(op_type: str) -> bool:
    """Whether an op of type ``op_type`` communicates with other workers."""
    return op_type.startswith(COLLECTIVE_OP_PREFIXES)


def count_collectives(graph) -> CollectiveCount:
    """The collectives of ``graph`` (a ``tf.Graph``/``FuncGraph`` or its ``GraphDef``)."""
    graph_def = graph.as_graph_def() if hasattr(graph, "as_graph_def") else graph
    library = {f.signature.name: f for f in graph_def.library.function}
    totals = {"every_step": 0, "in_branches": 0}
    types = set()

    def walk(nodes, branch, seen):
        for node in nodes:
            if is_collective(node.op):
                totals["in_branches" if branch else "every_step"] += 1
                types.add(node.op)
            for called in _called_functions(node):
                if called in library and called not in seen:
                    walk(library[called].node_def, branch or node.op in _BRANCHING_OPS,
                         seen | {called})

    walk(graph_def.node, False, frozenset())
    return CollectiveCount(totals["every_step"], totals["in_branches"], tuple(sorted(types)))


def train_step_collectives(model) -> CollectiveCount | None:
    """The collectives of ``model``'s newest train step traced with local outputs.

    Recorded for strategies whose Keras hand-off keeps step outputs local (model
    averaging); None before the first traced step.
    """
    from tfdist._hooks.keras_steps import traced_train_steps

    graphs = traced_train_steps(model)
    return count_collectives(graphs[-1]) if graphs else None


def _called_functions(node):
    """Names of the functions ``node`` calls (``f``, branches, loop cond/body)."""
    for value in node.attr.values():
        if value.HasField("func"):
            yield value.func.name
        elif value.HasField("list"):
            for func in value.list.func:
                yield func.name
