#!/usr/bin/env bash
# A side environment in which tests/test_sglang_backend.py also runs the
# backend against SGLang's real HiCacheStorage base class and backend factory
# (sglang 0.5.23, CPU machine). scripts/test.sh builds it for the full suite
# (CI), where the real-class test must pass (KVTIERTEST_REQUIRE_SGLANG=1).
#
# The side venv sees the main venv's packages (torch, kvtier, ...) through a
# .pth file and adds only sglang (without its GPU dependency tree) plus the
# modules `sglang.srt.mem_cache.hicache_storage` imports. Kept out of the main
# venv on purpose: sglang needs triton, whose presence changes what vLLM does.
#
#   integrations/sglang/setup_sglang_venv.sh            # -> .venv-sglang
#   SGLANG_PYTHON=.venv-sglang/bin/python pytest tests/test_sglang_backend.py
set -euo pipefail
cd "$(dirname "$0")/../.."
MAIN=${KVTIER_VENV:-.venv}
SIDE=${SGLANG_SIDE_VENV:-.venv-sglang}
[ -x "$MAIN/bin/python" ] || { echo "no main venv at $MAIN: run scripts/test.sh first" >&2; exit 1; }
[ -x "$SIDE/bin/python" ] || python3 -m venv "$SIDE"
main_site=$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
side_site=$("$SIDE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# an "import" line, so the main venv's own .pth files (kvtier's editable install) are processed too
echo "import site; site.addsitedir('$main_site')" > "$side_site/kvtier-main-venv.pth"
bash scripts/pip_retry.sh "$SIDE/bin/python" -q --upgrade pip
# triton (286 MB) is what a flaky link cuts: pip_retry.sh resumes it and, failing that, starts it afresh
bash scripts/pip_retry.sh "$SIDE/bin/python" -q --no-deps "sglang==0.5.23" triton \
  orjson psutil pybase64 requests urllib3 idna certifi packaging pillow starlette anyio msgspec \
  pydantic pydantic-core typing-inspection annotated-types pyzmq tqdm ipython traitlets pygments \
  aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist
"$SIDE/bin/python" -c 'from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory' 2>/dev/null
echo "sglang side venv ready: $SIDE/bin/python"
