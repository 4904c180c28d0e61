"""Serve a tiny copy through ``KVPolicyConnector`` with discovery on, at each TP size, and check warm
against cold.

Each engine is a fresh process (:func:`kvpolicy.harness.e2e.serve_once`) against a Mooncake master
and segment holder of its own (:class:`ZooStore`), with no tokenizer (token-id prompts) and the
copy's seeded checkpoint (:mod:`~kvpolicy.harness.zoo.weights`). The prompts are made by the engine
child once vLLM has sized its blocks (a hybrid's block can be hundreds of tokens): four prompts of two
full blocks and one token each, in one batch, so the saving step compares 8 blocks per layer.

Evidence that means something: a group whose blocks were all zero on some rank proves nothing (an
unwritten cache is identical everywhere); :attr:`Observation.degenerate` names such groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from kvpolicy.harness.e2e import (
    AutoPrompts,
    EngineFailed,
    EngineResult,
    SegmentHolder,
    engine_store_config,
    serve_once,
)
from kvpolicy.harness.zoo.shrink import VOCAB, TinyCopy

PLUGINS = Path(__file__).resolve().parent / "plugins"
"""The vLLM general plugins of the copies that need a CPU workaround."""
DISCOVER_STEPS = 4
MAX_TOKENS = 4
MAX_MODEL_LEN = 4096
DEFAULT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class WarmCheck:
    """A second engine against the first one's objects, same prompts."""

    cached_tokens: int
    """Prompt tokens the warm engine loaded through the connector."""
    prompt_tokens: int
    same_tokens: bool
    max_logprob_diff: float
    wall_s: float

    @property
    def exact(self) -> bool:
        return self.cached_tokens > 0 and self.same_tokens and self.max_logprob_diff == 0.0


@dataclass(frozen=True)
class Observation:
    """One TP size of one copy: the report rank 0 wrote, or why there is none."""

    tp_size: int
    report: Path | None
    wall_s: float
    block_size: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    """The first line that names the failure (an exception's message), when the engine failed."""
    stderr_tail: str = field(default="", repr=False)
    warm: WarmCheck | None = None
    objects_written: int | None = None
    """Objects the cold engine put, as the master counted them (None without its metrics)."""


GENERIC = re.compile(
    r"WorkerProc initialization failed|Engine core initialization failed|resource_tracker|"
    r"see (?:the )?(?:stack trace|root cause)|^Exception: Call to \w+ method failed|"
    r"CalledProcessError|Error raised in subprocess", re.IGNORECASE)
"""Failure lines that only say another process failed: the root cause is an earlier line."""
_EXCEPTION = re.compile(r"(?:^|[\s\]])((?:[\w.]+\.)?[A-Z]?\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*|$))")


_VALIDATION = re.compile(r"ValidationError: \d+ validation errors? for \w+$")
"""pydantic's header line; what failed is on the lines below it (``  Value error, ... [type=...]``)."""


def _validation_detail(lines: list[str], start: int) -> str:
    for line in lines[start + 1 : start + 8]:
        if "[type=" in line:
            return line.split("] ", 1)[-1].split("[type=", 1)[0].strip().removeprefix("Value error, ")
    return ""


def _exception_lines(text: str) -> list[str]:
    found = []
    frame = code = ""
    lines = text.splitlines()
    for index, raw in enumerate(lines):
        line = raw.strip()
        at = line.find('File "')
        if at >= 0:
            frame, code = line[at:], ""
            continue
        if frame and not code and line and not set(line.split("]")[-1].strip()) <= {"^", "~"}:
            code = line.split("] ", 1)[-1].strip() if "] " in line else line
            if not code.startswith(("raise", "assert")) and not _EXCEPTION.search(line):
                continue
        if not line or line.startswith(("raise ", "warnings.warn", "^")) or "Traceback" in line:
            continue
        match = _EXCEPTION.search(line)
        if match and "raise " not in line[: match.start(1)] and not GENERIC.search(match.group(1)):
            text_ = match.group(1)
            if ":" not in text_ and frame:  # a bare AssertionError: say where, and what it asserted
                where = re.search(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+)', frame)
                text_ = f"{text_} at {where.group(1)}:{where.group(2)}" if where else text_
                if code.startswith("assert"):
                    text_ += f" ({code})"
            if _VALIDATION.search(text_):
                detail = _validation_detail(lines, index)
                text_ = f"{text_}: {detail}" if detail else text_
            found.append(text_)
    return found


def error_line(stdout: str, stderr: str = "") -> str:
    """The line of an engine's output that names its failure: an exception a vLLM process logged at
    ``ERROR`` (a worker's root cause), else the last exception of the child's own traceback (stderr),
    else the last non-empty line (stderr's, else stdout's); wrappers that only say another process
    failed (:data:`GENERIC`) are passed over, and so are exceptions vLLM logs as warnings."""
    logged = _exception_lines("\n".join(line for line in stdout.splitlines() if " ERROR " in line))
    if logged:
        return logged[0][:400]
    own = _exception_lines(stderr)
    if own:
        return own[-1][:400]
    lines = [line.strip() for line in stderr.splitlines() if line.strip()] or [
        line.strip() for line in stdout.splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[:400]


def _failure_line(failure: EngineFailed) -> str:
    # vLLM logs (its workers' tracebacks included) to stdout; the child's own traceback is on stderr.
    if failure.returncode is None:
        return str(failure).splitlines()[0]
    if failure.returncode < 0:
        return f"the engine was killed by signal {-failure.returncode}"
    return error_line(failure.stdout, failure.stderr)


class ZooStore:
    """A loopback Mooncake master and a segment holder for the copies' engines; a context manager."""

    def __init__(self, directory: str | os.PathLike[str], *, segment_mib: int = 512) -> None:
        self._directory = Path(directory)
        self._segment_mib = segment_mib
        self._stack = contextlib.ExitStack()
        self.config_path: Path | None = None
        self.metrics_url: str | None = None

    def __enter__(self) -> Self:
        from kvpolicy.mooncake.master import MooncakeMaster

        self._directory.mkdir(parents=True, exist_ok=True)
        master = self._stack.enter_context(MooncakeMaster(object_lease_ms=120_000, client_ttl_s=120))
        self.config_path = engine_store_config(master.client_config(), self._directory / "mooncake-engine.json")
        self._stack.enter_context(SegmentHolder(master.rpc_address, segment_mib=self._segment_mib))
        self.metrics_url = getattr(master, "metrics_url", None)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()


class BuildError(RuntimeError):
    """transformers cannot build (or save) the copy's model: its first line says why."""


def build(copy: TinyCopy, directory: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the copy's ``config.json`` and seeded checkpoint into *directory*; :class:`BuildError`
    when transformers cannot build or save the model."""
    from kvpolicy.harness.zoo.weights import write_checkpoint

    target = copy.write(directory)
    try:
        write_checkpoint(target, dtype=copy.dtype, seed=seed)
    except Exception as error:
        text = " ".join(str(error).split())  # a message continued on later lines, as one line
        raise BuildError(f"{type(error).__name__}: {text}"[:400]) from error
    return target


def prompt_blocks_unlike(cold: EngineResult, warm: EngineResult, *, full_blocks: int) -> tuple[list[str], int]:
    """The first prompt's full blocks, warm vs cold (``serve_once(digest_blocks=True)`` on both): those
    whose bytes differ (``rank R LAYER.PART block B``), and how many were compared (a block null in either
    engine, such as a recurrent state vLLM keeps only at the last boundary, is not compared)."""
    differing = []
    compared = 0
    for rank, (computed, loaded) in enumerate(zip(cold.block_digests, warm.block_digests, strict=True)):
        for name, digests in computed.items():
            for block in range(min(full_blocks, len(digests), len(loaded[name]))):
                if digests[block] and loaded[name][block]:
                    compared += 1
                    if digests[block] != loaded[name][block]:
                        differing.append(f"rank {rank} {name} block {block}")
    return differing, compared


def _max_model_len(copy: TinyCopy) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = copy.config.get(key)
        if isinstance(value, int) and value > 0:
            return min(MAX_MODEL_LEN, value)
    return MAX_MODEL_LEN


def engine_options(
    copy: TinyCopy, store: ZooStore, *, tp_size: int, prompts: int = 4, timeout: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """:func:`~kvpolicy.harness.e2e.serve_once`'s options for the copy at *tp_size* against *store*:
    *prompts* prompts of two full blocks and one token, made once the engine knows its block size."""
    assert store.config_path is not None
    vocab = int(copy.config.get("vocab_size") or VOCAB)
    return {
        "tp_size": tp_size, "mooncake_config_path": store.config_path, "max_tokens": MAX_TOKENS,
        "dtype": copy.dtype, "hybrid": copy.recurrent, "python_path": [PLUGINS] if copy.plugins else [],
        "skip_tokenizer_init": True, "max_model_len": _max_model_len(copy), "timeout": timeout,
        "auto_prompts": AutoPrompts(blocks=2, count=prompts, vocab_size=min(vocab, VOCAB), seed=0),
    }


def observe(
    copy: TinyCopy,
    model_dir: str | os.PathLike[str],
    tp_sizes: Sequence[int],
    out_dir: str | os.PathLike[str],
    *,
    store: ZooStore,
    check_warm: bool = False,
    policy: str = "default",
    timeout: float = DEFAULT_TIMEOUT_S,
    stem: str | None = None,
) -> Iterator[Observation]:
    """Serve the copy in *model_dir* at each TP size with discovery on; yield each TP size's
    observation as it completes (reports go to ``out_dir/<stem>-tp<N>.yaml``)."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or copy.model_type.replace("_", "-")
    for tp_size in tp_sizes:
        from kvpolicy.documents.settings import KVPolicySettings

        report = out / f"{stem}-tp{tp_size}.yaml"
        report.unlink(missing_ok=True)
        prefix = f"zoo-{stem}-tp{tp_size}-{uuid.uuid4().hex[:8]}"
        common = {**engine_options(copy, store, tp_size=tp_size, timeout=timeout), "master_metrics_url": store.metrics_url}
        settings = KVPolicySettings(kvpolicy=policy, kvpolicy_discover=report, kvpolicy_discover_steps=DISCOVER_STEPS)
        started = time.monotonic()
        try:
            cold = serve_once(model_dir, [], kv_transfer_config=settings.kv_transfer_config(
                upstream_extra={"cache_prefix": prefix}), **common)
        except EngineFailed as failure:
            yield Observation(tp_size, None, time.monotonic() - started, error=_failure_line(failure),
                              stderr_tail=failure.stderr[-6000:])
            continue
        wall = time.monotonic() - started
        if not report.is_file():
            yield Observation(tp_size, None, wall, cold.block_size, cold.prompt_len,
                              error="the engine served, but rank 0 wrote no discovery report",
                              stderr_tail=cold.stderr[-6000:])
            continue
        written = None if cold.traffic is None else int(cold.traffic.batch_put_end_items)
        warm_check = None
        if check_warm:
            plain = KVPolicySettings(kvpolicy=policy)
            started = time.monotonic()
            try:
                warm = serve_once(model_dir, [], kv_transfer_config=plain.kv_transfer_config(
                    upstream_extra={"cache_prefix": prefix}), **common)
            except EngineFailed as failure:
                yield Observation(tp_size, report, wall, cold.block_size, cold.prompt_len,
                                  error=f"warm engine: {_failure_line(failure)}",
                                  stderr_tail=failure.stderr[-6000:])
                continue
            warm_check = WarmCheck(
                cached_tokens=warm.num_cached_tokens, prompt_tokens=warm.prompt_len,
                same_tokens=warm.tokens == cold.tokens, max_logprob_diff=warm.max_logprob_diff(cold),
                wall_s=time.monotonic() - started,
            )
        yield Observation(tp_size, report, wall, cold.block_size, cold.prompt_len, warm=warm_check,
                          objects_written=written)


BFLOAT16 = re.compile(r"bfloat16|\bbf16\b", re.IGNORECASE)
"""An engine error that asks for bfloat16 (a CPU kernel without a float32 path)."""


def in_bfloat16(copy: TinyCopy, why: str) -> TinyCopy:
    """The copy served in bfloat16 instead (a CPU kernel of vLLM takes no float32), its notes saying *why*."""
    return dataclasses.replace(copy, dtype="bfloat16", config={**copy.config, "dtype": "bfloat16"},
                               notes=(*copy.notes, f"served in bfloat16: {why}"))


def observe_copy(
    copy: TinyCopy,
    directory: str | os.PathLike[str],
    tp_sizes: Sequence[int],
    out_dir: str | os.PathLike[str],
    *,
    store: ZooStore,
    check_warm: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    stem: str | None = None,
) -> Iterator[tuple[TinyCopy, Observation]]:
    """Build the copy into *directory* and :func:`observe` it; a TP size whose engine refused float32
    for bfloat16 is served again in bfloat16 (the copy yielded with it says so in its notes)."""
    model = build(copy, Path(directory) / "model")
    refused: list[tuple[int, str]] = []
    for seen in observe(copy, model, tp_sizes, out_dir, store=store, check_warm=check_warm, timeout=timeout, stem=stem):
        if seen.report is None and copy.dtype == "float32" and BFLOAT16.search(seen.error or ""):
            refused.append((seen.tp_size, seen.error or ""))
        else:
            yield copy, seen
    if refused:
        again = in_bfloat16(copy, f"float32 refused ({refused[0][1]})")
        model = build(again, Path(directory) / "model-bfloat16")
        for seen in observe(again, model, [tp for tp, _ in refused], out_dir, store=store, check_warm=check_warm,
                            timeout=timeout, stem=stem):
            yield again, seen


# --- reading a report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSummary:
    index: int
    name: str
    spec_types: tuple[str, ...]
    layers: int
    partition: list[list[int]]
    blocks: int
    zero_blocks: int


def summarize(report_path: str | os.PathLike[str]) -> tuple[Any, list[GroupSummary]]:
    """``(report, its groups)``: spec classes, observed partition, evidence."""
    from kvpolicy.documents.loader import load
    from kvpolicy.evidence.discovery import DiscoveryReport

    report = load(os.fspath(report_path))
    assert isinstance(report, DiscoveryReport)
    groups = []
    for group, observed in zip(report.layout.groups, report.groups, strict=True):
        types = tuple(dict.fromkeys(member.spec.type for member in group.members))
        layers = sum(len(member.layers) for member in group.members)
        groups.append(GroupSummary(observed.index, observed.name or "-", types, layers,
                                   [list(members) for members in observed.partition],
                                   observed.evidence.blocks, observed.evidence.zero_blocks))
    return report, groups


def degenerate(groups: Sequence[GroupSummary]) -> list[str]:
    """Groups whose evidence proves nothing: no block compared (all zero on some rank, or none saved)."""
    return [f"group {group.index} ({', '.join(group.spec_types)}): {group.zero_blocks} all-zero blocks, none compared"
            for group in groups if group.blocks == 0]


def check_policy(policy_name: str, report: Any) -> list[str]:
    """Where *policy_name*'s plan departs from *report* (``kvpolicy discover --check``)."""
    from kvpolicy.documents.loader import load_policy
    from kvpolicy.documents.propose import disagreements

    return disagreements(load_policy(policy_name), report)
