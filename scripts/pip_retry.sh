#!/usr/bin/env bash
# pip install over a flaky link: PY -m pip install ARGS, tried up to
# KVTIER_PIP_TRIES times (default 4) with a pause between tries.
#
# pip resumes a cut download within one run (--resume-retries), but when the
# link keeps failing at the same byte (CI, stop 52: triton's 286 MB wheel cut at
# 244.8 MB 21 times in a row) only a fresh run, which starts the file from its
# first byte, gets past it. Wheels already downloaded come from pip's cache.
#
#   bash scripts/pip_retry.sh .venv/bin/python -q "aiperf==0.13.0"
set -uo pipefail
PY=$1; shift
TRIES=${KVTIER_PIP_TRIES:-4}
RESUME=()  # a venv's bundled pip may predate --resume-retries (pip 25.1)
"$PY" -m pip install --help 2>/dev/null | grep -q -- --resume-retries && RESUME=(--resume-retries 5)
for try in $(seq 1 "$TRIES"); do
  "$PY" -m pip install --retries 10 "${RESUME[@]}" "$@" && exit 0
  rc=$?
  if [ "$try" -lt "$TRIES" ]; then
    echo "pip_retry: pip install $* failed (exit $rc), try $try of $TRIES; again in $((try * 20)) s" >&2
    sleep $((try * 20))
  fi
done
echo "pip_retry: pip install $* failed $TRIES times (exit $rc)" >&2
exit "$rc"
