"""The run-time policy of one rank of an instance, without vLLM or torch.

:class:`RankPolicy` holds what kvpolicy decides while an instance runs, for one TP rank, and is the one
owner of that state: the plan it starts with (demoted already where another instance of the same plan
published a demotion, agreed on by every TP rank), each audited step's conclusion and what follows
from it (the re-plan and its new :class:`~kvpolicy.runtime.binding.RankBinding`, the demotion and
agreement markers, the status documents), the lookup gate, the memory of failed reads and the tally.
It is written against :mod:`kvpolicy.runtime.ports` — the store's marker calls, a gather over the TP
ranks, a clock — so its behaviour runs in pure tests with an in-memory store and a list collective.
The vLLM worker (:class:`kvpolicy.vllm.worker.KVPolicyStoreWorker`) keeps upstream's override points
and delegates here; what it still does itself is what touches vLLM: the layout from the
``KVCacheConfig``, the blocks of a step, digests on KV tensors, the token databases, writing a
binding into upstream's attributes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpolicy.documents.loader import file_kind, schemas_dir
from kvpolicy.documents.report import format_plan_table, plan_to_json
from kvpolicy.documents.settings import DEFAULT_READ_FAILURE_TTL_S, KVPolicySettings
from kvpolicy.evidence.audit import AuditState, AuditStatus, ReplicationAuditError, StepOutcome, ValueComparison
from kvpolicy.evidence.routers import (
    DynamoDeployment,
    RouterExportError,
    check_dynamo_descriptor,
    dynamo_descriptor,
    dynamo_refusals,
)
from kvpolicy.language.diagnostics import printable_path
from kvpolicy.language.dumper import dump_layout
from kvpolicy.language.keys import KeyContext
from kvpolicy.language.models import Layout, Policy, Topology
from kvpolicy.planning.contract import KeyContract, key_contract
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import Plan
from kvpolicy.planning.store_layout import StoreSharding
from kvpolicy.runtime.audit_step import Report, Samples, conclude_step
from kvpolicy.runtime.binding import RankBinding, RankPlace
from kvpolicy.runtime.markers import (
    LookupGate,
    agree_on_demotions,
    read_demotions,
    revoke_agreements,
    write_agreements,
    write_demotions,
)
from kvpolicy.runtime.ports import Clock, Gather, KVStore
from kvpolicy.runtime.read_failures import ReadFailures
from kvpolicy.runtime.tally import Tally
from kvpolicy.runtime.trust import Keyring, ProtectedStore, SealFailures

# Under "vllm." so records reach vLLM's own handler when it runs in vLLM (it configures that tree only).
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = [
    "RankPolicy",
    "capture_layout",
    "plan_and_replan",
    "status_document",
    "write_side_file",
    "write_text_atomically",
]


ONLY_RANK = RankPlace()
"""The place of an instance's one rank (TP 1, no pipeline or context parallelism)."""


def write_text_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a reader finds the previous file or the whole new one.

    A fresh name opened with ``O_EXCL`` never follows a planted symlink; mode 0o666 leaves the umask
    to decide, as a plain write would (``mkstemp``'s 0600 would hide the file from other users). What
    stands at ``path`` must be a regular file or a link (replaced as a link): a directory, a FIFO or a
    device (``/dev/null``, which a rename as root would replace for every program) is left as it is,
    with an ``OSError`` saying what it is.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OSError(f"it is {file_kind(mode)}, not a regular file; it is left as it is")
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the directory may be gone: the first error is the one to tell
            temporary.unlink(missing_ok=True)
        raise


def write_side_file(path: Path, text: str, *, what: str, setting: str) -> bool:
    """Write one of rank 0's observability side files (:func:`write_text_atomically`); True when it
    is written. One that cannot be (its directory removed or unwritable, a directory or a device
    standing at the path, a NUL in it) is one error line naming the path, the setting and the reason,
    never an exception: a side file never takes a rank down."""
    try:
        write_text_atomically(path, text)
    except (OSError, ValueError) as error:
        logger.error(
            "kvpolicy: cannot write the %s to %s (%s): %s; serving on without it",
            what, printable_path(str(path)), setting, _reason(error, path),
        )
        return False
    return True


def _reason(error: OSError | ValueError, path: Path) -> str:
    """Why a file operation on ``path`` failed, in one line."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    if "\0" in str(path):
        return "the path contains a NUL character"
    return " ".join(str(error).split()) or type(error).__name__


def plan_and_replan(
    policy: Policy,
    layout: Layout,
    topology: Topology,
    *,
    key_context: KeyContext | None = None,
    store_sharding: StoreSharding | None = None,
) -> tuple[Plan, Callable[[frozenset[int]], Plan]]:
    """The plan an instance declares and how to make it again with groups demoted to factor 1, for
    :meth:`RankPolicy.start`."""

    def replan(demoted: frozenset[int]) -> Plan:
        return make_plan(
            policy, layout, topology, key_context=key_context, demoted=demoted, store_sharding=store_sharding
        )

    return replan(frozenset()), replan


def capture_layout(path: Path, layout: Layout, topology: Topology) -> bool:
    """Write ``layout`` (``kvpolicy_layout_out``) as YAML that ``kvpolicy validate`` and ``kvpolicy plan
    --layout`` read, naming the schema and the topology it was captured at. True when written; one
    that cannot be written is one error line naming the key (:func:`write_side_file`)."""
    schema = schemas_dir() / "layout.schema.json"
    text = dump_layout(layout, captured_at=topology, schema=str(schema.resolve()) if schema.is_file() else None)
    if not write_side_file(path, text, what="layout", setting="kvpolicy_layout_out"):
        return False
    logger.info("kvpolicy layout written to %s", printable_path(str(path)))
    return True


def status_document(plan: Plan, audit: AuditState | None) -> dict[str, Any]:
    """The plan file's content (``kvpolicy_plan_json``): the plan with each group's audit status, the
    demotions inherited from another instance, and the audit's steps and errors so far."""
    payload = plan_to_json(plan, audit=None if audit is None else audit.statuses)
    if audit is not None and audit.inherited:
        declared = audit.initial_plan.fingerprint
        payload["audit"]["inherited"] = [
            {"group": group, "plan": declared, "message": message} for group, message in audit.inherited.items()
        ]
    if audit is not None and audit.history:
        payload["audit"]["steps_done"] = audit.steps_done
        payload["audit"]["errors"] = [message for step in audit.history for message in step.messages]
    return payload


class RankPolicy:
    """One rank's run-time policy: plan, binding, audit, markers, lookup gate, read failures, tally,
    status files. Build it from the connector's settings with :meth:`from_settings`.

    Two plans are named apart. The *decided* plan (:attr:`decided_plan`) is the audit's: it changes the
    moment an audited step demotes a group. The *bound* plan (:attr:`bound_plan`, the plan of
    :attr:`binding`) is the one vLLM's worker and transfer threads run: it follows the decided plan only
    once the caller has drained its transfers and written the new binding into vLLM (the
    ``bind`` callback of :meth:`conclude_step`), so between the two no save or load straddles the
    change of namespaces. Outside that moment they are the same plan.

    ``store`` is the rank's store client (markers), ``gather`` the collective over the TP ranks,
    ``clock`` the read-failure memory's time. ``plan_json`` / ``keys_json`` / ``dynamo_json`` are
    where the first rank writes the status documents (None: not written); ``dynamo_deployment`` is
    what Dynamo's descriptor states of the deployment besides the plan (None: hashing as Dynamo needs,
    of an unknown vLLM); ``prefix_cacheable`` which groups vLLM writes at all (None: every group)."""

    def __init__(
        self,
        policy: Policy,
        *,
        store: KVStore,
        gather: Gather,
        place: RankPlace = ONLY_RANK,
        plan_json: Path | None = None,
        keys_json: Path | None = None,
        dynamo_json: Path | None = None,
        dynamo_deployment: DynamoDeployment | None = None,
        read_failure_ttl_s: float = DEFAULT_READ_FAILURE_TTL_S,
        clock: Clock = time.monotonic,
        prefix_cacheable: Sequence[bool] | None = None,
        keyring: Keyring | None = None,
    ) -> None:
        self.policy = policy
        """The policy the plans are made from."""
        self.tally = Tally()
        """kvpolicy's counters since the last stats."""
        self.keyring = keyring
        """The deployment's secrets (keyed namespaces, sealed objects); None: the store sees vLLM's keys and bytes."""
        self.store: KVStore = store if keyring is None else ProtectedStore(
            store, keyring, failures=SealFailures(self.tally.object_refused)
        )
        """The rank's store client (markers, lookups): under a keyring, the client wrapped in it."""
        self.place = place
        """Where this rank sits in the instance."""
        self.read_failures = ReadFailures(read_failure_ttl_s, clock=clock)
        """Keys whose read failed lately; lookups report them missing."""
        self.gate = LookupGate(pcp_rank=place.pcp_rank, pp_rank=place.pp_rank)
        """Keeps lookups off shared namespaces no audit has verified."""
        self.binding: RankBinding | None = None
        """The bound plan as this rank runs it; None before :meth:`start`."""
        self._prefix_cacheable = prefix_cacheable
        self._gather = gather
        self._plan_json = plan_json if place.is_first else None
        self._keys_json = keys_json if place.is_first else None
        self._dynamo_json = dynamo_json if place.is_first else None
        self._dynamo_deployment = dynamo_deployment
        self._audit: AuditState | None = None
        self._layout: Layout | None = None
        self._gate_logged = False

    @classmethod
    def from_settings(
        cls,
        policy: Policy,
        settings: KVPolicySettings,
        *,
        store: KVStore,
        gather: Gather,
        place: RankPlace,
        dynamo_deployment: DynamoDeployment | None = None,
        prefix_cacheable: Sequence[bool] | None = None,
        clock: Clock = time.monotonic,
        keyring: Keyring | None = None,
    ) -> RankPolicy:
        """The run-time policy the connector's ``settings`` configure (status documents, read-failure TTL);
        ``keyring``: the secrets they name, read (:func:`kvpolicy.runtime.trust.keyring_for`)."""
        return cls(
            policy,
            store=store,
            gather=gather,
            place=place,
            plan_json=settings.kvpolicy_plan_json,
            keys_json=settings.keys_json_path(),
            dynamo_json=settings.kvpolicy_dynamo_json,
            dynamo_deployment=dynamo_deployment,
            read_failure_ttl_s=settings.kvpolicy_read_failure_ttl_s,
            clock=clock,
            prefix_cacheable=prefix_cacheable,
            keyring=keyring,
        )

    # --- the plan ---------------------------------------------------------------------------------

    @property
    def audit(self) -> AuditState | None:
        """The replication audit's state; None before :meth:`start`."""
        return self._audit

    @property
    def decided_plan(self) -> Plan | None:
        """The plan the audit has decided on (it changes as a step demotes); None before :meth:`start`."""
        return None if self._audit is None else self._audit.plan

    @property
    def bound_plan(self) -> Plan | None:
        """The plan vLLM runs (:attr:`binding`'s); None before :meth:`start`."""
        return None if self.binding is None else self.binding.plan

    @property
    def layout(self) -> Layout | None:
        """The layout the plan was made from (given to :meth:`start`)."""
        return self._layout

    def group_of_key(self, key: str) -> int | None:
        """The group a store key of this rank belongs to under the bound plan (None: no namespace of it)."""
        return None if self.binding is None else self.binding.group_of_key(key)

    def replica_set_of(self, group: int) -> tuple[int, ...]:
        """This rank's replica set in ``group`` under the bound plan."""
        return self._require_binding().replica_set_of(group)

    def dedup_multiplier(self, group: int) -> int:
        """Copies a policy without dedup writes per object the bound plan writes in ``group``."""
        return self._require_binding().dedup_multipliers[group]

    def _require_binding(self) -> RankBinding:
        if self.binding is None:
            raise RuntimeError("no plan yet: RankPolicy.start was not called")
        return self.binding

    def start(self, declared: Plan, replan: Callable[[frozenset[int]], Plan], *, layout: Layout | None = None) -> Plan:
        """Start running ``declared`` (``replan(demoted)`` makes it again with groups at factor 1):
        demoted already where another instance of ``declared`` published a demotion
        (:func:`kvpolicy.evidence.audit.demotion_key`), so that it loads the fallback's objects from its first
        lookup. Returns the plan to run.

        The plan returned is bound (:attr:`binding`). Every TP rank reads the markers of its (pcp, pp)
        namespace and the ranks take the union
        (:func:`~kvpolicy.runtime.markers.agree_on_demotions`): a rank that alone saw a marker would
        otherwise skip audited steps the others make, and hang them in the collective. Whether the
        ranks gather at all depends on the plan only. ``layout`` is what the key contract is written
        from. Raises :class:`~kvpolicy.evidence.audit.ReplicationAuditError` under ``enforce`` when a demotion
        was inherited."""
        plan = self._start(declared, replan, layout)
        self.binding = RankBinding.of(plan, self.place, self._prefix_cacheable)
        return plan

    def _start(self, declared: Plan, replan: Callable[[frozenset[int]], Plan], layout: Layout | None) -> Plan:
        self._layout = layout
        fresh = AuditState(declared, replan=replan)
        self._audit = fresh
        groups = fresh.groups_to_audit()  # empty under audit: off, which trusts the rule and ignores markers
        if not groups:
            return fresh.plan
        place = self.place
        found = read_demotions(self.store, declared, groups, pcp_rank=place.pcp_rank, pp_rank=place.pp_rank)
        inherited = agree_on_demotions(found, gather=self._gather)
        if not inherited:
            return fresh.plan
        try:
            state = AuditState(declared, replan=replan, inherited=inherited)
        except ReplicationAuditError as error:
            if place.speaks:
                logger.error("%s (audit: enforce stops the engine)", error)
            raise
        self._audit = state
        if place.speaks:
            logger.warning(
                "kvpolicy audit: inherited demotion of group%s %s from another instance of this plan; "
                "starting with factor 1 there (own namespace, plan fingerprint %s -> %s): %s",
                "s" if len(state.inherited) > 1 else "",
                ",".join(map(str, state.inherited)),
                declared.fingerprint,
                state.plan.fingerprint,
                " | ".join(state.inherited.values()),
            )
        return state.plan

    def _require_audit(self) -> AuditState:
        if self._audit is None:
            raise RuntimeError("no plan yet: RankPolicy.start was not called")
        return self._audit

    # --- the status documents ---------------------------------------------------------------------

    def report_plan(self) -> None:
        """The first rank's start-up report: the plan table in the log, the status documents, the
        plan in the tally (its info series)."""
        if not self.place.is_first:
            return
        state = self._require_audit()
        logger.info(
            "kvpolicy plan (policy %s):\n%s", self.policy.name, format_plan_table(state.plan, audit=state.statuses)
        )
        written = self.write_status()
        self.tally.plan(state.plan)
        for what, path in written:
            logger.info("kvpolicy %s written to %s", what, printable_path(str(path)))

    def write_status(self) -> tuple[tuple[str, Path], ...]:
        """Rewrite the plan file, the key contract and Dynamo's descriptor (where configured) for the
        plan now run; (what, path) of each written. One that cannot be written is one error line
        (:func:`write_side_file`), and the rank serves on."""
        state = self._require_audit()
        written: list[tuple[str, Path]] = []
        if self._keys_json is not None or self._dynamo_json is not None:
            if self._layout is None:
                raise RuntimeError("a key contract needs the layout the plan was made from (RankPolicy.start)")
            contract = key_contract(state.plan, self._layout, keyed=self.keyring is not None and self.keyring.current.keyed)
            if self._keys_json is not None:
                text = json.dumps(contract.model_dump(mode="json"), indent=2) + "\n"
                # Unset, kvpolicy_keys_json is beside the plan file (KVPolicySettings.keys_json_path).
                if write_side_file(self._keys_json, text, what="key contract", setting="kvpolicy_keys_json"):
                    written.append(("key contract", self._keys_json))
            if self._dynamo_json is not None and self._write_dynamo_descriptor(self._dynamo_json, contract, self._layout):
                written.append(("Dynamo router descriptor", self._dynamo_json))
        if self._plan_json is not None:
            text = json.dumps(status_document(state.plan, state), indent=2) + "\n"
            if write_side_file(self._plan_json, text, what="plan", setting="kvpolicy_plan_json"):
                written.insert(0, ("plan", self._plan_json))
        return tuple(written)

    def _write_dynamo_descriptor(self, path: Path, contract: KeyContract, layout: Layout) -> bool:
        """Dynamo's descriptor of ``contract`` to ``path``; True when written. Where the plan has none
        (a group Dynamo has no kind for, a limit passed), no file: one left from an earlier plan would
        send the router to prefixes this plan does not write, so it is removed, and the warning says
        so where it cannot be."""
        try:
            descriptor = dynamo_descriptor(contract, layout, self._dynamo_deployment)
        except RouterExportError as error:
            reasons = error.problems
        else:
            reasons = check_dynamo_descriptor(descriptor).problems
            if not reasons:
                text = json.dumps(descriptor.model_dump(mode="json"), indent=2) + "\n"
                if not write_side_file(path, text, what="Dynamo router descriptor", setting="kvpolicy_dynamo_json"):
                    return False
                refused = dynamo_refusals(contract, descriptor)
                if refused:
                    logger.info("kvpolicy: Dynamo's router (PR #14965) does not accept this descriptor yet: %s", "; ".join(refused))
                return True
        left = ""
        try:
            path.unlink(missing_ok=True)
        except (OSError, ValueError) as error:
            left = f"; the one left from before could not be removed ({_reason(error, path)})"
        logger.warning(
            "kvpolicy: no Dynamo router descriptor for this plan (%s not written%s): %s",
            printable_path(str(path)), left, "; ".join(reasons),
        )
        return False

    # --- an audited step --------------------------------------------------------------------------

    def groups_to_audit(self) -> tuple[int, ...]:
        """The groups this step would audit (empty: not an audited step, or before :meth:`start`)."""
        return () if self._audit is None else self._audit.groups_to_audit()

    def conclude_step(
        self,
        collect_reports: Callable[[], Sequence[Report]],
        collect_samples: Callable[[tuple[int, ...]], Sequence[Samples]],
        *,
        comparisons: Mapping[int, ValueComparison] | None = None,
        distance: Callable[[Any, Any], float] | None = None,
        bind: Callable[[RankBinding], None] = lambda binding: None,
        blocks_per_rank: int = 0,
        timings: Mapping[str, float] | None = None,
    ) -> StepOutcome:
        """One audited step: every rank's digests (and, where they differ, samples) concluded alike on
        every rank (:func:`kvpolicy.runtime.audit_step.conclude_step`). When the step re-planned, the
        new plan's binding goes to ``bind(binding)`` before anything else (the worker drains its
        transfers and writes it into vLLM), and becomes :attr:`binding` once that returns. Then, on
        the rank that speaks for its stage: the demotion published first, the log,
        the agreement markers, the tally, the status documents. Raises
        :class:`~kvpolicy.evidence.audit.ReplicationAuditError` under ``enforce``, after logging and counting it."""
        state = self._require_audit()
        started = time.perf_counter()
        kwargs = {} if distance is None else {"distance": distance}
        try:
            outcome = conclude_step(state, collect_reports, collect_samples, comparisons=comparisons, **kwargs)
        except ReplicationAuditError as error:
            if self.place.speaks:
                logger.error("%s (audit: enforce stops the engine)", error)
                if self.place.is_first:
                    self.tally.audit_step(demoted=tuple(audit.group for audit in error.audits))
            raise
        if outcome.plan_changed:
            # No save or load may straddle the change of namespaces.
            binding = self._require_binding().for_plan(outcome.plan)
            bind(binding)
            self.binding = binding
        if self.place.speaks:
            self._after_step(outcome, blocks_per_rank, time.perf_counter() - started, timings or {})
        return outcome

    def _after_step(self, outcome: StepOutcome, blocks_per_rank: int, seconds: float, timings: Mapping[str, float]) -> None:
        """The speaking rank's side effects of an audited step; nothing here feeds back into the audit."""
        state = self._require_audit()
        self.publish_demotions(outcome)
        for message in outcome.messages:
            logger.error(
                "%s; falling back to factor 1 for this instance (own namespace, plan fingerprint %s -> %s)",
                message,
                outcome.previous_plan.fingerprint,
                outcome.plan.fingerprint,
            )
        if outcome.failed_ranks:
            logger.warning(
                "kvpolicy audit step %d: ranks %s could not digest their blocks; this step proves nothing",
                outcome.step,
                ",".join(map(str, outcome.failed_ranks)),
            )
        verdicts = ", ".join(
            f"group {audit.group} {audit.verdict.value}"
            + (f" within rounding (relative distance {audit.distance:.1e})" if audit.distance else "")
            for audit in outcome.audits
        )
        logger.info(
            "kvpolicy audit step %d/%d: %d blocks per rank (%s); digest %.2f ms, gather %.2f ms, total %.2f ms%s",
            outcome.step,
            state.steps,
            blocks_per_rank,
            verdicts or "no verdict",
            timings.get("digest", 0.0) * 1e3,
            timings.get("gather", 0.0) * 1e3,
            seconds * 1e3,
            f" (values compared: {timings['values'] * 1e3:.2f} ms)" if "values" in timings else "",
        )
        for group in outcome.unverified:
            logger.warning(
                "kvpolicy audit: group %d (%s) saved only all-zero blocks in %d audited steps; its rule stays "
                "unverified, and lookups use its shared namespace only where another instance vouched for it",
                group,
                outcome.plan.groups[group].name,
                state.steps,
            )
        self.publish_agreements(outcome)
        if self.place.is_first:
            self.tally.audit_step(demoted=outcome.demoted)
            if outcome.plan_changed:
                self.tally.plan(outcome.plan)
        if outcome.plan_changed:
            logger.info("kvpolicy plan after the audit:\n%s", format_plan_table(outcome.plan, audit=state.statuses))
        if outcome.plan_changed or outcome.agreed or outcome.unverified:
            self.write_status()

    def publish_demotions(self, outcome: StepOutcome) -> None:
        """Tell fresh instances of this instance's initial plan which groups this step demoted, so they
        start demoted (:meth:`start`). First among the speaking rank's side effects: nothing that may
        fail before it keeps the next instance from the fallback's objects. A store error is logged."""
        state = self._audit
        if state is None or not outcome.demoted:
            return
        try:
            write_demotions(
                self.store, state.initial_plan, outcome.demotions, pcp_rank=self.place.pcp_rank, pp_rank=self.place.pp_rank
            )
        except Exception:
            logger.exception("kvpolicy audit: could not publish the demotion; the next instance audits again")

    def publish_agreements(self, outcome: StepOutcome) -> None:
        """Vouch for the groups this instance verified (so fresh instances may load them), and withdraw
        what a demotion disproved. A store error is logged."""
        state = self._require_audit()
        agreed = outcome.agreed
        if outcome.plan_changed:
            # New fingerprint, new marker keys: vouch again for everything still agreed.
            agreed = tuple(group for group, status in state.statuses.items() if status is AuditStatus.AGREED)
        place = self.place
        try:
            if outcome.demoted:
                revoke_agreements(
                    self.store, outcome.previous_plan, outcome.demoted, pcp_rank=place.pcp_rank, pp_rank=place.pp_rank
                )
            if agreed:
                write_agreements(self.store, outcome.plan, agreed, pcp_rank=place.pcp_rank, pp_rank=place.pp_rank)
        except Exception:
            logger.exception("kvpolicy audit: could not update the agreement markers")

    # --- the lookup gate --------------------------------------------------------------------------

    def lookup_allowed(self) -> bool:
        """Whether a lookup may read the store now: the gate is open (every replicated group verified,
        here or by another instance's agreement marker). A closed gate counts in the tally; a store
        that cannot answer closes it (a miss costs a recompute, a wrong hit wrong output)."""
        state = self._audit
        if state is None:
            return True
        try:
            is_open = self.gate.open(state, self.store)
        except Exception:
            logger.exception("kvpolicy audit: could not check the agreement markers; treating as a miss")
            is_open = False
        if is_open:
            return True
        if not self._gate_logged:
            self._gate_logged = True
            logger.info(
                "kvpolicy audit: lookups miss until the replication audit verifies groups %s "
                "(no other instance of plan %s has vouched for them yet)",
                ", ".join(map(str, state.untrusted_groups())) or "(other pp/pcp stages)",
                state.plan.fingerprint,
            )
        self.tally.lookup_gated()
        return False
