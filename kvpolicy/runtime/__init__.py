"""kvpolicy at run time, without vLLM or torch: what every rank of an instance decides, written against
declared ports (:mod:`kvpolicy.runtime.ports`: the store's marker calls, a gather over the TP ranks, a
clock) that the vLLM adapter and the simulation provide, and that the pure tests (``tests/runtime``)
provide with an in-memory store, a list collective and a hand clock.

- :mod:`~kvpolicy.runtime.policy`: :class:`~kvpolicy.runtime.policy.RankPolicy`, one rank's plan and
  re-plans, audited steps and their consequences, the lookup gate, the status documents;
- :mod:`~kvpolicy.runtime.audit_step`: what ranks send in the audit's collectives and the conclusion;
- :mod:`~kvpolicy.runtime.markers`: agreement and demotion markers, the lookup gate, the agreement on
  published demotions;
- :mod:`~kvpolicy.runtime.read_failures`: keys whose read failed lately, missing to lookups for a TTL;
- :mod:`~kvpolicy.runtime.tally`: kvpolicy's counters for vLLM's stats;
- :mod:`~kvpolicy.runtime.striping` and :mod:`~kvpolicy.runtime.collective`: the striped-load schedule
  and the point-to-point exchange it runs over.

The architecture test keeps this package free of vLLM, torch and Mooncake.
"""
