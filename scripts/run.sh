#!/usr/bin/env bash
# The entry points the README gives: `bash scripts/run.sh demo`, `bash scripts/run.sh test` (everything, what CI
# runs) and `bash scripts/run.sh dev` (the developer's loop: the pure and contract tiers, scripts/dev_tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${KVPOLICY_VENV:-.venv}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  demo) shift; exec "$VENV/bin/kvpolicy" demo "$@" ;;
  test) shift; exec "$VENV/bin/python" -m pytest "$@" ;;
  dev) shift; exec bash scripts/dev_tests.sh "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test|dev [args...]" >&2; exit 2 ;;
esac
