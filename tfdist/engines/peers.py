"""Naming the peers that stopped answering: every engine's words for a frozen, dead or
cut-off task, from liveness probes of the peers' servers (`tfdist.comm.liveness`)."""

from __future__ import annotations

from tfdist.comm import liveness

# Seconds a peer has to answer a liveness probe after the engine gave up on it.
PROBE_TIMEOUT = 2.0


def name_failed_peers(addresses: dict[str, str], what: str, timeout_text: str,
                      probe_timeout: float) -> str | None:
    """Probes every peer at once and says which ones failed, or None if all answer.

    Silent ones are named as frozen, refused ones as not running, and ones whose host
    cannot be reached (no route, network unreachable, no reply to the connection) as
    cut off, maybe still running.

    Args:
        addresses: ``{task name: "host:port"}`` of the peers' servers.
        what: What the peers did not answer, e.g. ``"Horovod"``.
        timeout_text: The timeout as set, e.g. ``"timeout_seconds=5s"``.
        probe_timeout: Seconds each probe waits (connect, then answer).
    """
    if not addresses:
        return None
    found = probe_all(addresses, probe_timeout)
    silent, gone, cut_off = (found[state] for state in (
        liveness.SILENT, liveness.REFUSED, liveness.UNREACHABLE))
    if not silent and not gone and not cut_off:
        return None
    said = []
    if silent:
        said.append(f"{_tasks(silent)} did not answer {what} within {timeout_text}, nor "
                    f"a liveness probe within {probe_timeout:g}s: "
                    f"{'it is' if len(silent) == 1 else 'they are'} frozen (e.g. "
                    "SIGSTOP), overloaded or unreachable")
    if gone:
        where = ", ".join(addresses[name] for name, _ in gone)
        said.append(f"{_tasks(gone)} {'is' if len(gone) == 1 else 'are'} not running "
                    f"(nothing listens at {where}): killed or exited")
    if cut_off:
        reasons = ", ".join(f"{addresses[name]}: {detail}" for name, detail in cut_off)
        said.append(f"{_tasks(cut_off)} could not be reached ({reasons}): a network "
                    "outage (link down, no route, firewall), not a task known to "
                    f"have exited; {'it' if len(cut_off) == 1 else 'they'} may still run")
    return "; ".join(said)


def probe_all(addresses: dict[str, str], timeout: float) -> dict[str, list[tuple[str, str]]]:
    """``{state: [(task name, detail), ...]}`` for ``addresses`` (``{name: address}``),
    probed at once with `tfdist.comm.liveness.probe` (an HTTP/2 preface: any server that
    runs answers: TF's gRPC servers and the Horovod engine's liveness servers do)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(addresses), 64),
                            thread_name_prefix="tfdist-probe") as pool:
        probes = list(pool.map(lambda address: liveness.probe(address, timeout),
                               addresses.values()))
    found = {state: [] for state in (liveness.ANSWERS, liveness.SILENT, liveness.REFUSED,
                                     liveness.UNREACHABLE)}
    for name, result in zip(addresses, probes):
        found[result.state].append((name, result.detail))
    return found


def _tasks(found: list[tuple[str, str]]) -> str:
    names = [name for name, _ in found]
    return names[0] if len(names) == 1 else "task(s) " + ", ".join(names)
