#!/usr/bin/env bash
# The project's checks, as CI runs them (README "Tests"): format and lint (ruff, a second), then the type check
# (mypy on the package, configured in pyproject.toml; half a minute with a cold cache) alongside the test suite,
# whose multi-process tests leave a core idle part of the time. Fails when any of them fails; mypy's report is
# printed after the suite's. Arguments go to pytest (e.g. `bash scripts/check.sh -m "not cli"`). With `--dist loadfile`
# the longest test files start first, one on each worker (tests/scheduling.py), so that none is left for the end.
set -euo pipefail
cd "$(dirname "$0")/.."

ruff format --check .
ruff check .
types_report=$(mktemp)
mypy > "$types_report" 2>&1 &
types=$!
status=0
python -m pytest -q -n auto --dist loadfile "$@" || status=$?
wait "$types" || status=$?
cat "$types_report"
rm -f "$types_report"
exit "$status"
