"""Discovery offline: the connector's ``kvpolicy_discover`` on simulated ranks holding the bytes the model holds.

:func:`run_discovery` starts one instance of an archetype under ``no-dedup`` (every group written per
rank, nothing audited: discovery needs no policy to be right) with ``kvpolicy_discover`` set, and saves
``steps`` requests of different lengths, one per step, so that every observed step compares new
chunks. Each rank's ``wait_for_save`` digests its blocks per layer, the simulated TP collective
gathers the digests and rank 0 writes the report, exactly as on an engine.
"""

from __future__ import annotations

from pathlib import Path

from kvpolicy.documents.loader import load, load_policy, schemas_dir
from kvpolicy.evidence.discovery import DiscoveryReport, dump_report
from kvpolicy.mooncake.master import MooncakeMaster
from kvpolicy.mooncake.pool import ClientPool
from kvpolicy.runtime.policy import write_text_atomically
from kvpolicy.sim.archetypes import BLOCK_SIZE, Archetype
from kvpolicy.sim.fleet import Fleet

__all__ = ["DEFAULT_STEPS", "run_discovery"]

DEFAULT_STEPS = 4
"""Steps observed offline: 2 blocks per layer each (the audit's cap per request), 8 in all."""


def run_discovery(
    archetype: str | Archetype,
    tp_size: int,
    report_path: Path,
    *,
    master: MooncakeMaster,
    clients: ClientPool,
    steps: int = DEFAULT_STEPS,
    num_tokens: int = 256,
    dcp_size: int = 1,
) -> DiscoveryReport:
    """Observe ``archetype`` at ``tp_size`` over ``steps`` save steps; rank 0 writes ``report_path``,
    which is read back (and so validated) and returned."""
    chunk = 2 * BLOCK_SIZE
    if num_tokens < steps * chunk + BLOCK_SIZE:
        raise ValueError(f"{steps} steps need a prompt of at least {steps * chunk + BLOCK_SIZE} tokens, got {num_tokens}")
    with Fleet(archetype, master=master, clients=clients, num_tokens=num_tokens, name="kvpolicy-discover") as fleet:
        instance = fleet.instance(
            load_policy("no-dedup"),
            tp_size,
            name="discover",
            dcp_size=dcp_size,
            extra_config={"kvpolicy_discover": str(report_path), "kvpolicy_discover_steps": steps},
        )
        for step in range(steps):
            # A shorter prefix each step: its last blocks (those a step digests) are chunks not seen before.
            instance.save(num_tokens - step * chunk, request=f"discover-{step}")
    report = load(report_path)
    if not isinstance(report, DiscoveryReport):  # written by this run's rank 0: cannot be another kind
        raise TypeError(f"{report_path} holds a {report.kind}")
    # The instance ran under a model name unique to this run (its keys' namespace); the report names
    # the model observed.
    named = report.model_copy(update={"model": fleet.archetype.name})
    write_text_atomically(report_path, dump_report(named, schema=_schema()))
    return named


def _schema() -> str | None:
    schema = schemas_dir() / "discovery.schema.json"
    return str(schema.resolve()) if schema.is_file() else None
