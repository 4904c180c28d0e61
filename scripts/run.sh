#!/usr/bin/env bash
# The entry points the README gives: `bash scripts/run.sh demo`, `bash scripts/run.sh test` (everything, what CI
# runs), `bash scripts/run.sh dev` (the developer's loop: the pure and contract tiers, scripts/dev_tests.sh) and
# `bash scripts/run.sh docs` (the documentation site, built into site/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${KVPOLICY_VENV:-.venv}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
  demo) shift; exec "$VENV/bin/kvpolicy" demo "$@" ;;
  test) shift; exec "$VENV/bin/python" -m pytest "$@" ;;
  dev) shift; exec bash scripts/dev_tests.sh "$@" ;;
  # The documentation site, built strictly into site/; `docs serve` serves it on 127.0.0.1:8000 while editing.
  docs) shift
    if [ "${1:-}" = serve ]; then shift; exec "$VENV/bin/mkdocs" serve --strict "$@"; fi
    exec "$VENV/bin/mkdocs" build --strict "$@" ;;
  *) echo "usage: bash scripts/run.sh demo|test|dev|docs [args...]" >&2; exit 2 ;;
esac
