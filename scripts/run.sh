#!/usr/bin/env bash
# The two entry points the README gives: `bash scripts/run.sh demo` and `bash scripts/run.sh test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${KVPOLICY_VENV:-.venv}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  demo) shift; exec "$VENV/bin/kvpolicy" demo "$@" ;;
  test) shift; exec "$VENV/bin/python" -m pytest "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test [args...]" >&2; exit 2 ;;
esac
