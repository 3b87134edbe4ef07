"""Which strategy options and launch modes compose, and which are refused: data.

For each entry of `tfdist.strategies.registry`, every pair of its options and every
(option, launch mode) pair is decided here: `Composes`, naming the tests that show the
pair working (pytest node ids), or `Refused`, with the reason. A refusal happens before
anything runs: an (option, option) refusal in the strategy's argument check
(`tfdist.strategies.options.arguments`); an (option, launch mode) refusal in `check_modes`,
which ``tfdist train`` calls with the config's modes before any process starts, and
which the strategy's argument check calls at construction with the modes its
environment shows (`environment_modes`: ``tfdist launch script.py`` cannot see the
script's options). Either is one line: ``... Received: option=value``.

``tests/test_option_pairs.py`` walks every pair of every entry: a `Composes` must name
tests that exist, a `Refused` must be refused; an option of the registry that is in
no table here fails it.

Rules that decide many pairs at once (each said once, here):

- A *setting* (`SETTINGS`: timeouts, devices, the engine, ...) changes neither the
  step's arithmetic nor any state a feature keeps: it composes with every option and
  launch mode, with the setting's own test as the reference, unless a pair in `PAIRS`
  says otherwise (e.g. ``engine`` in an elastic job).
- An alias (`ALIASES`: ``communication_options``) is decided by the options it holds.
- A launch mode that only hands the tasks TF_CONFIG and the ``TFDIST_*`` environment
  (multi-node, Spark, Ray) composes with an option when there is (1) a test of the
  option in a job of TF_CONFIG tasks (``tfdist launch`` or the tests' cluster runner)
  and (2) a test that the mode runs such a job as ``tfdist launch`` does; the pair
  cites both.
- ``--max-restarts`` restarts the whole job, which resumes from its
  ``BackupAndRestore`` backup: an option composes with it when a test resumes the
  option's state from a save to the uninterrupted result, cited with a launched
  restart test.

This module is data plus two small functions; it imports nothing from TensorFlow.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from tfdist import env
from tfdist.strategies.options.pair_tables import ALIAS_TEST, ALIASES, ALONE, PAIRS, SETTINGS
from tfdist.strategies.options.pair_types import (ELASTIC, ELASTIC_STRATEGIES, MAX_RESTARTS,  # noqa: F401
                                          MODE_WORDS, MODES, MULTI_NODE, RAY, SPARK,
                                          Composes, Refused)

def launch_modes(entry) -> tuple[str, ...]:
    """The launch modes that can run a registry entry."""
    modes = []
    if entry.name in ELASTIC_STRATEGIES:
        modes.append(ELASTIC)
    if entry.runs_on_nodes:
        modes += [MULTI_NODE, MAX_RESTARTS]
    if entry.runs_on_engines:
        modes += [SPARK, RAY]
    return tuple(m for m in MODES if m in modes)


def environment_modes(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The launch modes a task's environment shows (what a launcher of a script set)."""
    environ = os.environ if environ is None else environ
    modes = []
    if environ.get(env.ELASTIC_ADDR):
        modes.append(ELASTIC)
    if environ.get(env.NNODES, "1").strip() not in ("", "1"):
        modes.append(MULTI_NODE)
    return tuple(modes)


def check_modes(name: str, given: Mapping[str, Any], modes) -> None:
    """Raises if an option given to strategy ``name`` is refused in one of ``modes``.

    Args:
        name: The registry entry.
        given: The options set to other than their defaults.
        modes: Launch modes of the job (`MODES`).

    Raises:
        ValueError: one line, ``In <mode>, <reason>. Received: option=value, ...``,
            naming every refused option of the first mode that refuses one.
    """
    table = PAIRS.get(name, {})
    for mode in modes:
        refused = [(option, value, table[(option, mode)]) for option, value in given.items()
                   if isinstance(table.get((option, mode)), Refused)
                   and value not in table[(option, mode)].allowed]
        if refused:
            reasons = dict.fromkeys(d.reason.format(value=v) for _, v, d in refused)
            received = ", ".join(f"{option}={value!r}" for option, value, _ in refused)
            raise ValueError(f"In {MODE_WORDS[mode]}, {'; '.join(reasons)}. "
                             f"Received: {received}")


def decisions(entry) -> tuple[dict, list[str]]:
    """Every pair of a registry entry's options and launch modes, decided.

    Returns:
        ``({pair: decision}, undecided)``: a pair is ``frozenset({a, b})`` or
        ``(option, mode)``; ``undecided`` names each pair no table nor rule decides.
    """
    from tfdist.strategies import registry

    options = sorted(registry.option_names(entry.name))
    table = PAIRS.get(entry.name, {})
    decided, undecided = {}, []

    alone = ALONE.get(entry.name, {})

    def decide(key, names):
        refused = [alone[n] for n in names if n in alone]
        if refused:
            return refused[0]
        if key in table:
            return table[key]
        settings = [n for n in names if n in SETTINGS]
        if settings:
            return Composes(tuple(SETTINGS[n] for n in settings), note="a setting")
        undecided.append(" x ".join(names))
        return None

    def fields(option):
        return ALIASES.get(option, (option,))

    for i, a in enumerate(options):
        for b in options[i + 1:]:
            if b in fields(a) or a in fields(b):
                decided[frozenset({a, b})] = Composes((ALIAS_TEST,), note="an alias")
                continue
            for x in fields(a):
                for y in fields(b):
                    if x != y:
                        decided[frozenset({x, y})] = decide(frozenset({x, y}), (x, y))
        for mode in launch_modes(entry):
            for x in fields(a):
                decided[(x, mode)] = decide((x, mode), (x, mode))
    known = set(options) | set(MODES)
    for key in table:
        stale = set(key) - known
        if stale:
            undecided.append(f"{' x '.join(sorted(map(str, key)))}: not an option of "
                             f"{entry.name!r} ({sorted(stale)})")
    return {k: v for k, v in decided.items() if v is not None}, sorted(set(undecided))
