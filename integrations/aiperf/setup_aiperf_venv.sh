#!/usr/bin/env bash
# A side environment with NVIDIA aiperf, the client InferenceX / AgentX use to
# replay agent traces against a server. tests/test_interop_aiperf.py runs
# check_traces.py and `aiperf analyze-trace` in it, so CI proves that the
# traces kvtier writes (generator, hints recorder) are ones aiperf accepts.
# Kept apart from the main venv: aiperf pins its own pydantic, numpy and more.
#
#   integrations/aiperf/setup_aiperf_venv.sh        # -> .venv-aiperf (about 1.5 minutes)
#   AIPERF_PYTHON=.venv-aiperf/bin/python pytest tests/test_interop_aiperf.py
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SIDE=${AIPERF_SIDE_VENV:-.venv-aiperf}
VERSION=0.13.0
if [ ! -x "$SIDE/bin/python" ]; then
  "$PY" -m venv "$SIDE"
  echo "*" > "$SIDE/.gitignore"  # keep the venv out of git status
fi
if ! "$SIDE/bin/python" -m pip show aiperf 2>/dev/null | grep -qx "Version: $VERSION"; then
  bash scripts/pip_retry.sh "$SIDE/bin/python" -q --upgrade pip
  bash scripts/pip_retry.sh "$SIDE/bin/python" -q "aiperf==$VERSION"
fi
"$SIDE/bin/python" -c 'from aiperf.dataset.loader.weka_trace_models import WekaTrace'
echo "aiperf side venv ready: $SIDE/bin/python"
