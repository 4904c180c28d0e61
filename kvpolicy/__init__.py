"""kvpolicy: declarative per-cache-group TP replication policies for vLLM's Mooncake store connector.

Data flows one way: YAML → :mod:`kvpolicy.models` (via :mod:`kvpolicy.loader`) → :func:`kvpolicy.engine.make_plan`
→ :class:`kvpolicy.plan.Plan` → the connector in :mod:`kvpolicy.vllm`. The core imports neither vLLM nor Mooncake.
"""

from kvpolicy.diagnostics import Diagnostic, DocumentError, PlanError
from kvpolicy.engine import make_plan
from kvpolicy.keys import KeyContext
from kvpolicy.loader import load_layout, load_policy
from kvpolicy.models import Layout, Policy, Topology
from kvpolicy.plan import GroupPlan, Plan

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
