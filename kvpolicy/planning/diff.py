"""What a policy edit changes: two plans of one layout and topology, compared group by group.

A change that matters to a fleet is one of: a group's factor (who holds identical bytes), its write
schedule (who writes a chunk), its namespaces (which keys a lookup needs), the bytes written per
token, a plan refused where it was accepted (or the reverse), and the fingerprint: when that
changes, every instance of the new policy misses everything the old one stored (the cache goes cold).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpolicy.planning.plan import GroupPlan, Plan

__all__ = ["GroupChange", "PlanChange", "compare_plans"]


@dataclass(frozen=True)
class GroupChange:
    """One group whose plan differs."""

    index: int
    name: str
    changes: tuple[str, ...]
    """``what: old -> new`` for each property that differs."""
    written_bytes_per_token: tuple[float, float]
    """(old, new) bytes written to the store per token, all TP ranks together."""


@dataclass(frozen=True)
class PlanChange:
    """Two plans of one layout and topology (or the reason one was refused)."""

    layout: str
    topology: str
    old: Plan | str
    """The old policy's plan, or why the engine refused it."""
    new: Plan | str
    groups: tuple[GroupChange, ...]

    @property
    def template_changed(self) -> bool:
        return isinstance(self.old, Plan) and isinstance(self.new, Plan) and self.old.key_template != self.new.key_template

    @property
    def fingerprint_changed(self) -> bool:
        return not (isinstance(self.old, Plan) and isinstance(self.new, Plan) and self.old.fingerprint == self.new.fingerprint)

    @property
    def refusal_changed(self) -> bool:
        return isinstance(self.old, str) != isinstance(self.new, str) or (
            isinstance(self.old, str) and self.old != self.new
        )

    @property
    def changed(self) -> bool:
        """Anything an operator must know about: a group, a refusal, or a cold cache."""
        if isinstance(self.old, str) and isinstance(self.new, str):
            return self.old != self.new
        return bool(self.groups) or self.refusal_changed or self.fingerprint_changed or self.template_changed

    @property
    def written_bytes_per_token(self) -> tuple[float | None, float | None]:
        return _written(self.old), _written(self.new)


def _written(plan: Plan | str) -> float | None:
    return None if isinstance(plan, str) else sum(group.written_bytes_per_token for group in plan.groups)


def _namespaces(plan: Plan, group: GroupPlan) -> tuple[str, ...]:
    """A group's lookup namespaces with the fingerprint blanked out: the fingerprint has a line of its own."""
    return tuple(namespace.replace(plan.fingerprint, "<fingerprint>") for namespace in group.lookup_namespaces)


def _group_changes(old_plan: Plan, old: GroupPlan, new_plan: Plan, new: GroupPlan) -> tuple[str, ...]:
    changes = []
    if old.factor != new.factor:
        changes.append(f"factor: {old.factor} -> {new.factor}")
    old_kind, new_kind = old.ranks[0].schedule.kind.value, new.ranks[0].schedule.kind.value
    if old_kind != new_kind:
        changes.append(f"schedule: {old_kind} -> {new_kind}")
    if len(old.lookup_namespaces) != len(new.lookup_namespaces):
        changes.append(f"namespaces: {len(old.lookup_namespaces)} -> {len(new.lookup_namespaces)}")
    elif old_plan.key_template == new_plan.key_template and _namespaces(old_plan, old) != _namespaces(new_plan, new):
        changes.append("namespaces: other keys")  # with another template every key differs; said once
    if old.demoted != new.demoted:
        changes.append(f"demoted: {old.demoted} -> {new.demoted}")
    return tuple(changes)  # renamed rules with the same outcome change nothing a fleet sees


def compare_plans(layout: str, topology: str, old: Plan | str, new: Plan | str) -> PlanChange:
    """The differences between ``old`` and ``new`` (plans, or the engine's reason for refusing)."""
    groups: list[GroupChange] = []
    if isinstance(old, Plan) and isinstance(new, Plan):
        for before, after in zip(old.groups, new.groups, strict=True):
            changes = _group_changes(old, before, new, after)
            if changes:
                groups.append(
                    GroupChange(
                        before.index, before.name, changes, (before.written_bytes_per_token, after.written_bytes_per_token)
                    )
                )
    return PlanChange(layout, topology, old, new, tuple(groups))
