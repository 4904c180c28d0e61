"""kvpolicy: declarative per-cache-group TP replication policies for vLLM's Mooncake store connector.

Data flows one way: YAML → :mod:`kvpolicy.language.models` (via :mod:`kvpolicy.documents.loader`)
→ :func:`kvpolicy.planning.engine.make_plan` → :class:`kvpolicy.planning.plan.Plan` → the connector in
:mod:`kvpolicy.vllm`. The core is four layer packages, lowest first: :mod:`kvpolicy.language`,
:mod:`kvpolicy.planning`, :mod:`kvpolicy.evidence`, :mod:`kvpolicy.documents`; it imports neither vLLM,
torch nor Mooncake. This module is its front door: the names below, re-exported.
"""

from kvpolicy.documents.loader import load_layout, load_policy
from kvpolicy.language.diagnostics import Diagnostic, DocumentError, PlanError
from kvpolicy.language.keys import KeyContext
from kvpolicy.language.models import Layout, Policy, Topology
from kvpolicy.planning.engine import make_plan
from kvpolicy.planning.plan import GroupPlan, Plan

__all__ = [
    "Diagnostic",
    "DocumentError",
    "GroupPlan",
    "KeyContext",
    "Layout",
    "Plan",
    "PlanError",
    "Policy",
    "Topology",
    "load_layout",
    "load_policy",
    "make_plan",
]
__version__ = "0.1.0"
