#!/usr/bin/env bash
# The developer's loop: the pure and contract test tiers (tests/tiers.py), one pytest per core, each
# importing only its own tier's modules. Extra arguments go to both (e.g. -x, -k name).
# Prints each tier's output when it ends; exits non-zero when either tier fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${KVPOLICY_VENV:-.venv}/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$PYTHON" -m pytest --tier pure -q -p no:cacheprovider "$@" >"$out/pure" 2>&1 &
pure=$!
"$PYTHON" -m pytest --tier contract -q -p no:cacheprovider "$@" >"$out/contract" 2>&1
contract=$?
wait "$pure"
pure_status=$?
for tier in pure contract; do
  echo "=== tier $tier ==="
  cat "$out/$tier"
done
if [ "$pure_status" -ne 0 ] || [ "$contract" -ne 0 ]; then
  echo "dev tests failed (pure: exit $pure_status, contract: exit $contract)" >&2
  exit 1
fi
