"""The benchmarks' goals, read from docs/benchmarks.md.

The goals live in docs/benchmarks.md, section "Goals": a table of targets (``| `id` |
what | <= 1.03 |``) and, under headings ``### `id` ...``, the analysis that RESULTS.md
quotes when a goal is missed. This module reads them; `benchmarks.goal_table` compares
them with the ratios in the sections' JSON.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


@dataclasses.dataclass(frozen=True)
class Goal:
    """A target for one ratio, e.g. ``Goal("overhead", "...", "<=", 1.03)``."""

    id: str
    what: str
    op: str  # "<=" or ">="
    bound: float

    @property
    def target(self) -> str:
        return f"{self.op} {self.bound:g}"

    def is_met(self, value: float) -> bool:
        return value <= self.bound if self.op == "<=" else value >= self.bound

    def status(self, value: float, digits: int = 2) -> str:
        """``"met"``, or ``"missed by 1.03x"``: how far the value is from the bound."""
        if self.is_met(value):
            return "met"
        factor = value / self.bound if self.op == "<=" else self.bound / value
        return f"missed by {factor:.{digits}f}x"


def _goals_section(path: Path = DOC) -> str:
    text = path.read_text()
    match = re.search(r"^## Goals\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if not match:
        raise ValueError(f"{path} has no '## Goals' section")
    return match.group(1)


def read_goals(path: Path = DOC) -> dict[str, Goal]:
    """The goals table of docs/benchmarks.md, by id."""
    goals = {}
    for row in re.finditer(r"^\| `([\w-]+)` \| (.+?) \| (<=|>=) ([\d.]+)x? \|$",
                           _goals_section(path), flags=re.M):
        goals[row[1]] = Goal(row[1], row[2].strip(), row[3], float(row[4]))
    return goals


def read_analysis(path: Path = DOC) -> dict[str, str]:
    """The analysis paragraphs under ``### `id` ...`` headings, by id, each on one line."""
    parts = re.split(r"^### `([\w-]+)`[^\n]*\n", _goals_section(path), flags=re.M)
    return {key: " ".join(body.split()) for key, body in zip(parts[1::2], parts[2::2])}


def goal(goal_id: str) -> Goal:
    """One goal of docs/benchmarks.md (sections use it for their own tables)."""
    return read_goals()[goal_id]
