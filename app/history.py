"""Undo/redo of plan edits: a list of (label, plan) snapshots and a cursor. No streamlit here.

Plans are frozen, so a snapshot is just a reference; the list is capped so a
long session does not grow without bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from stagewise.planner.plan import Plan

MAX_ENTRIES = 200


@dataclass
class History:
    """Edit history of one model's plan. `present` is entries[cursor]; entries after it are redo-able."""

    entries: list[tuple[str, Plan]] = field(default_factory=list)
    cursor: int = -1

    @staticmethod
    def start(plan: Plan, label: str = "proposed") -> "History":
        return History([(label, plan)], 0)

    @property
    def present(self) -> Plan:
        if self.cursor < 0:
            raise IndexError("empty history; start it with History.start(plan)")
        return self.entries[self.cursor][1]

    @property
    def base(self) -> Plan:
        """The plan the history started from (what reset goes back to)."""
        return self.entries[0][1]

    @property
    def can_undo(self) -> bool:
        return self.cursor > 0

    @property
    def can_redo(self) -> bool:
        return self.cursor < len(self.entries) - 1

    def push(self, label: str, plan: Plan) -> Plan:
        """Record an edit; drops whatever could have been redone."""
        del self.entries[self.cursor + 1:]
        self.entries.append((label, plan))
        if len(self.entries) > MAX_ENTRIES:
            # keep the base (reset target) and the newest MAX_ENTRIES - 1 edits
            del self.entries[1 : len(self.entries) - MAX_ENTRIES + 1]
        self.cursor = len(self.entries) - 1
        return plan

    def undo(self) -> Plan:
        if self.can_undo:
            self.cursor -= 1
        return self.present

    def redo(self) -> Plan:
        if self.can_redo:
            self.cursor += 1
        return self.present

    def reset(self) -> Plan:
        """Go back to the base plan as a new, undoable step."""
        return self.push("reset", self.base)

    def replace_present(self, label: str, plan: Plan) -> Plan:
        """Swap the present plan without a new step (attaching a profile report, say)."""
        self.entries[self.cursor] = (label, plan)
        return plan

    def labels(self) -> list[str]:
        return [label for label, _ in self.entries]
