#!/usr/bin/env bash
# Fresh machine → installed venv → full test suite. This is the README's test
# command and exactly what CI (.ci/run) runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVTIER_VENV:-.venv}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# CPU torch first (on this machine the wheel is on disk; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu), so the project's torch
# range is already satisfied and no CUDA build is pulled.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test,plot]"
"$VENV/bin/python" -m pytest -q "$@"
