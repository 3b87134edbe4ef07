"""Multi-node rendezvous for `tfdist launch --nnodes N`: node 0 hosts it, every node joins.

Every node runs the same ``tfdist launch`` command. Node 0 listens at ``--master``; each
node (node 0 too) connects, proves it knows the shared token (HMAC of a fresh nonce),
and sends its rank, its task counts, free ports of its own and, optionally, the address
the others should use (default: the address its connection came from). When every node
has joined, node 0 builds the whole cluster and sends it to each node, with the tasks
that node runs. The connections stay open for the job's life: a task that fails on any
node makes node 0 tell every node to stop (fail-fast), and a node that loses node 0
stops its tasks too. With ``max_restarts``, node 0's stop says whether a restart is
left; then every node rejoins with fresh ports (a new round) and gets a new cluster.

The wire format is JSON, one object per line (`wire`). Node 0's server is in `server`,
the checks of a node's hello in `hello`, every node's link to node 0 in `link`;
`tfdist.launch.nodes` runs a node's tasks with them.
"""

from tfdist.launch.rendezvous.link import NodeLink, join
from tfdist.launch.rendezvous.server import RendezvousServer
from tfdist.launch.rendezvous.wire import (TOKEN_ENV, RendezvousError, parse_master,
                                           resolve_token)

__all__ = ["NodeLink", "RendezvousError", "RendezvousServer", "TOKEN_ENV", "join",
           "parse_master", "resolve_token"]
