"""kvtier.config: defaults, files, environment, precedence and every error class."""

from __future__ import annotations

import dataclasses
import doctest
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtier.config
from kvtier.config import (
    DRAMTierConfig,
    HBMTierConfig,
    KVTierConfig,
    LayoutConfig,
    NamespaceConfig,
    SCRIPT_ENV,
    RemoteTierConfig,
    SSDTierConfig,
    auto_map_size_bytes,
    env_var_name,
    load_config,
)
from kvtier.errors import ConfigError, UnknownPolicyError
from kvtier.keys import Namespace
from kvtier.layout import KVLayout

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]


def names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Minimal TOML writer for to_dict() output (scalars first, then tables)."""

    def scalar(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return repr(v)

    lines = [f"{k} = {scalar(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            name = f"{prefix}{k}"
            lines += ["", f"[{name}]", to_toml(v, f"{name}.")]
    return "\n".join(lines)


def test_module_doctests() -> None:
    assert doctest.testmod(kvtier.config).failed == 0


# --- defaults


def test_defaults_load_with_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    cfg = load_config()
    # Llama-3-8B-like layout, vLLM block size: 32 * 2 * 8 * 128 * 2 B * 16 tokens = 2 MiB.
    assert cfg.layout == LayoutConfig(32, 8, 128, "bfloat16", 16, "fused")
    assert cfg.layout.to_layout().bytes_per_block == 2 * MiB
    assert cfg.enabled_tiers == ("hbm", "dram")
    assert cfg.hbm == HBMTierConfig(enabled=True, capacity_blocks=512, policy="lru", device="auto")
    assert cfg.dram == DRAMTierConfig(enabled=True, capacity_blocks=4096, policy="lru", pin_memory="auto")
    assert not cfg.ssd.enabled and cfg.ssd.path == "~/.cache/kvtier/ssd"
    assert cfg.ssd.map_size_bytes == auto_map_size_bytes(16384, 2 * MiB)
    assert (cfg.put_tier, cfg.write_through, cfg.pin_budget_blocks) == ("hbm", False, 256)
    assert (cfg.default_pin_ttl_s, cfg.mover_threads) == (30.0, 2)
    assert cfg == KVTierConfig()


def test_namespace_comes_from_layout() -> None:
    cfg = load_config(env={}, overrides={"namespace": {"model": "m", "tenant": "t", "tp_rank": 1, "tp_size": 2}})
    layout = cfg.layout.to_layout()
    assert isinstance(layout, KVLayout)
    assert cfg.namespace.to_namespace(layout) == Namespace(
        model="m", dtype="bfloat16", layout=layout.describe(), block_size=16, tp_rank=1, tp_size=2, tenant="t"
    )


def test_auto_map_size_covers_capacity() -> None:
    cfg = load_config(env={}, overrides={"layout": {"num_layers": 80}, "tiers": {"ssd": {"capacity_blocks": 100}}})
    bytes_per_block = cfg.layout.to_layout().bytes_per_block
    assert cfg.ssd.map_size_bytes is not None
    assert cfg.ssd.map_size_bytes >= 100 * bytes_per_block
    assert cfg.ssd.map_size_bytes % 4096 == 0


def test_constructing_directly_does_not_mutate_the_given_ssd_config() -> None:
    ssd = SSDTierConfig()
    cfg = KVTierConfig(ssd=ssd)
    assert ssd.map_size_bytes is None  # resolved on a copy
    assert cfg.ssd.map_size_bytes == auto_map_size_bytes(ssd.capacity_blocks, 2 * MiB)


# --- files

EXAMPLE_YAML = """
layout:
  num_layers: 61
  num_kv_heads: 1
  head_dim: 576
  dtype: bfloat16
  block_size: 64
  arrangement: mla
namespace:
  model: deepseek-ai/DeepSeek-V3
  tenant: team-a
  tp_rank: 3
  tp_size: 8
tiers:
  hbm:  {capacity_blocks: 100, device: "cuda:1"}
  dram: {capacity_blocks: 1000, pin_memory: false}
  ssd:
    enabled: true
    capacity_blocks: 5000
    path: {ssd}
    codec: bplane-zstd
    zstd_level: 9
    sync: true
pin_budget_blocks: 64
default_pin_ttl_s: 5
put_tier: dram
write_through: true
"""

EXAMPLE_TOML = """
pin_budget_blocks = 64
default_pin_ttl_s = 5.0
put_tier = "dram"
write_through = true

[layout]
num_layers = 61
num_kv_heads = 1
head_dim = 576
dtype = "bfloat16"
block_size = 64
arrangement = "mla"

[namespace]
model = "deepseek-ai/DeepSeek-V3"
tenant = "team-a"
tp_rank = 3
tp_size = 8

[tiers.hbm]
capacity_blocks = 100
device = "cuda:1"

[tiers.dram]
capacity_blocks = 1000
pin_memory = false

[tiers.ssd]
enabled = true
capacity_blocks = 5000
path = "{ssd}"
codec = "bplane-zstd"
zstd_level = 9
sync = true
"""


def test_yaml_and_toml_files_give_the_same_config(tmp_path: Path) -> None:
    ssd = str(tmp_path / "ssd")
    from_yaml = load_config(write(tmp_path, "c.yaml", EXAMPLE_YAML.replace("{ssd}", ssd)), env={})
    from_toml = load_config(write(tmp_path, "c.toml", EXAMPLE_TOML.replace("{ssd}", ssd)), env={})
    assert from_yaml == from_toml
    assert from_yaml.layout.to_layout().bytes_per_token == 70272  # MLA latent, 61 layers
    assert from_yaml.hbm.device == "cuda:1" and from_yaml.dram.pin_memory is False
    assert from_yaml.ssd.codec == "bplane-zstd" and from_yaml.ssd.zstd_level == 9
    assert from_yaml.default_pin_ttl_s == 5.0 and isinstance(from_yaml.default_pin_ttl_s, float)
    assert (from_yaml.put_tier, from_yaml.write_through) == ("dram", True)
    assert not Path(ssd).exists()  # the creatability check leaves nothing behind


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".toml"])
def test_to_dict_round_trips_through_files_and_overrides(tmp_path: Path, suffix: str) -> None:
    ssd = str(tmp_path / "ssd")
    cfg = load_config(write(tmp_path, "c.yaml", EXAMPLE_YAML.replace("{ssd}", ssd)), env={})
    data = cfg.to_dict()
    assert set(data["tiers"]) == {"hbm", "dram", "ssd", "remote"}
    text = to_toml(data) if suffix == ".toml" else yaml.safe_dump(data)
    assert load_config(write(tmp_path, "out" + suffix, text), env={}) == cfg
    assert load_config(env={}, overrides=data) == cfg
    assert KVTierConfig.from_dict(data) == cfg


def test_empty_yaml_file_and_empty_section_give_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "empty.yaml", ""), env={}) == KVTierConfig()
    assert load_config(write(tmp_path, "s.yaml", "layout:\n  # num_layers: 2\n"), env={}) == KVTierConfig()


# --- environment and precedence


def test_precedence_defaults_file_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "tiers:\n  dram:\n    capacity_blocks: 100\n    policy: lru\npin_budget_blocks: 7\n")
    env = {"KVTIER_TIERS__DRAM__CAPACITY_BLOCKS": "200", "KVTIER_MOVER_THREADS": "4"}
    overrides = {"tiers": {"dram": {"capacity_blocks": 300}}}
    assert load_config(path, env={}).dram.capacity_blocks == 100  # file beats default 4096
    cfg = load_config(path, env=env)
    assert (cfg.dram.capacity_blocks, cfg.mover_threads, cfg.pin_budget_blocks) == (200, 4, 7)  # env beats file
    cfg = load_config(path, env=env, overrides=overrides)
    assert (cfg.dram.capacity_blocks, cfg.mover_threads, cfg.pin_budget_blocks) == (300, 4, 7)  # overrides beat env


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_NAMESPACE__TENANT", "salt")
    assert load_config().namespace.tenant == "salt"
    assert load_config(env={}).namespace.tenant == ""


def test_env_ignores_other_variables() -> None:
    assert load_config(env={"HOME": "/x", "KVTIERS": "1", "PATH": "/bin"}) == KVTierConfig()


@pytest.mark.parametrize(
    ("name", "text", "get", "expected"),
    [
        ("KVTIER_TIERS__SSD__SYNC", "yes", lambda c: c.ssd.sync, True),
        ("KVTIER_TIERS__SSD__SYNC", "1", lambda c: c.ssd.sync, True),
        ("KVTIER_TIERS__SSD__SYNC", "TRUE", lambda c: c.ssd.sync, True),
        ("KVTIER_WRITE_THROUGH", "true", lambda c: c.write_through, True),
        ("KVTIER_TIERS__HBM__ENABLED", "0", lambda c: c.hbm.enabled, False),
        ("KVTIER_TIERS__DRAM__PIN_MEMORY", "no", lambda c: c.dram.pin_memory, False),
        ("KVTIER_TIERS__DRAM__PIN_MEMORY", "auto", lambda c: c.dram.pin_memory, "auto"),
        ("KVTIER_DEFAULT_PIN_TTL_S", "2.5", lambda c: c.default_pin_ttl_s, 2.5),
        ("KVTIER_PIN_BUDGET_BLOCKS", "10", lambda c: c.pin_budget_blocks, 10),
        ("KVTIER_TIERS__SSD__MAP_SIZE_BYTES", "12345678", lambda c: c.ssd.map_size_bytes, 12345678),
        ("KVTIER_TIERS__SSD__MAP_SIZE_BYTES", "auto", lambda c: c.ssd.map_size_bytes, auto_map_size_bytes(16384, 2 * MiB)),
        ("KVTIER_TIERS__SSD__PATH", "/x", lambda c: c.ssd.path, "/x"),
        ("KVTIER_LAYOUT__ARRANGEMENT", "split", lambda c: c.layout.arrangement, "split"),
        ("KVTIER_NAMESPACE__TENANT", "", lambda c: c.namespace.tenant, ""),
    ],
)
def test_env_values_parse_by_field_type(name: str, text: str, get: Any, expected: object) -> None:
    # HBM disabled by one case: put the first write in DRAM so every case is valid.
    assert get(load_config(env={name: text, "KVTIER_PUT_TIER": "dram"})) == expected


def test_env_var_name_matches_the_documented_scheme() -> None:
    assert env_var_name(("tiers", "ssd", "path")) == "KVTIER_TIERS__SSD__PATH"
    assert env_var_name(("pin_budget_blocks",)) == "KVTIER_PIN_BUDGET_BLOCKS"


@pytest.mark.parametrize(
    ("name", "text", "setting", "value"),
    [
        ("KVTIER_TIERS__SSD__CAPACITY", "5", "KVTIER_TIERS__SSD__CAPACITY", "5"),  # typo
        ("KVTIER_TIERS", "x", "KVTIER_TIERS", "x"),  # a section, not a setting
        ("KVTIER_LAYOUT_NUM_LAYERS", "2", "KVTIER_LAYOUT_NUM_LAYERS", "2"),  # single underscore
        ("KVTIER_PIN_BUDGET_BLOCKS", "abc", "pin_budget_blocks", "abc"),
        ("KVTIER_TIERS__SSD__SYNC", "maybe", "tiers.ssd.sync", "maybe"),
        ("KVTIER_DEFAULT_PIN_TTL_S", "soon", "default_pin_ttl_s", "soon"),
        ("KVTIER_TIERS__DRAM__CAPACITY_BLOCKS", "-5", "tiers.dram.capacity_blocks", -5),  # parsed, then range-checked
    ],
)
def test_bad_env_raises_naming_setting_and_value(name: str, text: str, setting: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={name: text})
    assert info.value.setting == setting
    assert setting in str(info.value) and repr(value) in str(info.value)
    assert name in str(info.value)  # the variable to fix is named too


def test_unknown_env_var_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match="did you mean KVTIER_TIERS__SSD__CAPACITY_BLOCKS") as info:
        load_config(env={"KVTIER_TIERS__SSD__CAPACITY": "5"})
    text = str(info.value)
    assert len(text) < 400, text  # at most three suggestions, not every variable
    import re

    assert len(re.findall(r"KVTIER_[A-Z]\w*", text)) <= 1 + 3 + 1, text  # the variable, 3 suggestions, 1 example


def test_the_projects_own_script_variables_are_not_settings() -> None:
    """scripts/test.sh reads KVTIER_VENV and scripts/pip_retry.sh KVTIER_PIP_TRIES: a shell that exported them
    still loads the config (and so starts ``kvtier serve``); a typo beside them is still refused."""
    assert load_config(env={"KVTIER_VENV": ".venv", "KVTIER_PIP_TRIES": "4"}).write_through is False
    scripts = (ROOT / "scripts" / "test.sh").read_text() + (ROOT / "scripts" / "pip_retry.sh").read_text()
    assert all(name in scripts for name in SCRIPT_ENV)  # still read there (else drop them from SCRIPT_ENV)
    with pytest.raises(ConfigError, match="KVTIER_VENVV"):
        load_config(env={"KVTIER_VENV": ".venv", "KVTIER_VENVV": ".venv"})


# --- bad values: each class, from overrides and from a YAML file

BAD_VALUES: list[tuple[dict[str, Any], str, object]] = [
    ({"tiers": {"dram": {"capacity_blocks": -5}}}, "tiers.dram.capacity_blocks", -5),
    ({"tiers": {"hbm": {"capacity_blocks": -1}}}, "tiers.hbm.capacity_blocks", -1),
    ({"tiers": {"ssd": {"capacity_blocks": -3}}}, "tiers.ssd.capacity_blocks", -3),
    ({"tiers": {"hbm": {"capacity_blocks": 0}}}, "tiers.hbm.capacity_blocks", 0),  # enabled but empty
    ({"tiers": {"hbm": {"policy": "mru"}}}, "tiers.hbm.policy", "mru"),
    ({"tiers": {"ssd": {"policy": "LRU"}}}, "tiers.ssd.policy", "LRU"),
    ({"tiers": {"ssd": {"codec": "lz4"}}}, "tiers.ssd.codec", "lz4"),
    ({"layout": {"arrangement": "paged"}}, "layout.arrangement", "paged"),
    ({"layout": {"dtype": "fp4"}}, "layout.dtype", "fp4"),
    ({"layout": {"num_layers": 0}}, "layout.num_layers", 0),
    ({"layout": {"arrangement": "mla"}}, "layout.num_kv_heads", 8),  # MLA needs one latent head
    ({"tiers": {"ssd": {"zstd_level": 0}}}, "tiers.ssd.zstd_level", 0),
    ({"tiers": {"ssd": {"zstd_level": 23}}}, "tiers.ssd.zstd_level", 23),
    ({"tiers": {"ssd": {"enabled": True, "path": ""}}}, "tiers.ssd.path", ""),
    ({"tiers": {"ssd": {"enabled": True, "path": None}}}, "tiers.ssd.path", None),
    (
        {"tiers": {"ssd": {"enabled": True, "path": "{tmp}", "capacity_blocks": 10, "map_size_bytes": 10 * 2 * MiB - 1}}},
        "tiers.ssd.map_size_bytes",
        10 * 2 * MiB - 1,
    ),
    ({"tiers": {"ssd": {"map_size_bytes": 0}}}, "tiers.ssd.map_size_bytes", 0),
    ({"put_tier": "ssd"}, "put_tier", "ssd"),  # ssd disabled
    ({"put_tier": "gpu"}, "put_tier", "gpu"),
    ({"tiers": {"hbm": {"enabled": False}, "dram": {"enabled": False}}}, "tiers.*.enabled", False),
    ({"layout": {"num_layers": "abc"}}, "layout.num_layers", "abc"),
    ({"tiers": {"dram": {"capacity_blocks": True}}}, "tiers.dram.capacity_blocks", True),
    ({"tiers": {"dram": {"capacity_blocks": 1.5}}}, "tiers.dram.capacity_blocks", 1.5),
    ({"tiers": {"dram": {"enabled": "yes"}}}, "tiers.dram.enabled", "yes"),
    ({"tiers": {"dram": {"pin_memory": "maybe"}}}, "tiers.dram.pin_memory", "maybe"),
    ({"tiers": {"hbm": {"device": "gpu:0"}}}, "tiers.hbm.device", "gpu:0"),
    ({"tiers": {"hbm": {"device": "cuda:x"}}}, "tiers.hbm.device", "cuda:x"),
    ({"namespace": {"model": 7}}, "namespace.model", 7),
    ({"namespace": {"tp_rank": 2, "tp_size": 2}}, "namespace.tp_rank", 2),
    ({"namespace": {"tp_size": 0}}, "namespace.tp_size", 0),
    ({"namespace": {"pp_rank": -1}}, "namespace.pp_rank", -1),
    ({"pin_budget_blocks": -1}, "pin_budget_blocks", -1),
    ({"mover_threads": 0}, "mover_threads", 0),
    ({"tiers": {"ssd": {"read_threads": 0}}}, "tiers.ssd.read_threads", 0),
    ({"tiers": {"ssd": {"write_threads": 0}}}, "tiers.ssd.write_threads", 0),
    ({"placement": {"policy": "lru-3q"}}, "placement.policy", "lru-3q"),
    ({"placement": {"next_use_trust": -1}}, "placement.next_use_trust", -1.0),
    ({"placement": {"rho_max": "high"}}, "placement.rho_max", "high"),
    ({"placement": {"rho_min": 0.4, "rho_max": 0.2}}, "placement.rho_min", 0.4),
    ({"placement": {"policy": "lru-dram", "critical_at": 0.5}}, "placement.critical_at", 0.5),
    ({"tuned": {"date": 20261201}}, "tuned.date", 20261201),
    ({"default_pin_ttl_s": -1.0}, "default_pin_ttl_s", -1.0),
    ({"default_pin_ttl_s": "soon"}, "default_pin_ttl_s", "soon"),
    ({"write_through": 1}, "write_through", 1),
    ({"layout": 5}, "layout", 5),
    ({"tiers": ["hbm"]}, "tiers", ["hbm"]),
]


def _fill(data: Any, tmp: str) -> Any:
    if isinstance(data, dict):
        return {k: _fill(v, tmp) for k, v in data.items()}
    return tmp if data == "{tmp}" else data


@pytest.mark.parametrize("source", ["overrides", "yaml"])
@pytest.mark.parametrize(("data", "setting", "value"), BAD_VALUES, ids=lambda v: str(v)[:40])
def test_bad_value_raises_naming_setting_and_value(
    tmp_path: Path, source: str, data: dict[str, Any], setting: str, value: object
) -> None:
    data = _fill(data, str(tmp_path / "ssd"))
    with pytest.raises(ConfigError) as info:
        if source == "overrides":
            load_config(env={}, overrides=data)
        else:
            load_config(write(tmp_path, "bad.yaml", yaml.safe_dump(data)), env={})
    assert info.value.setting == setting
    assert setting in str(info.value) and repr(value) in str(info.value)


def test_unknown_policy_is_an_unknown_policy_error_listing_registered_names() -> None:
    from kvtier.policies import policy_names

    with pytest.raises(UnknownPolicyError) as info:
        load_config(env={}, overrides={"tiers": {"dram": {"policy": "mru"}}})
    for name in policy_names():
        assert name in str(info.value)


def test_every_registered_policy_is_accepted() -> None:
    from kvtier.policies import policy_names

    for name in policy_names():
        assert load_config(env={}, overrides={"tiers": {"hbm": {"policy": name}}}).hbm.policy == name


def test_error_says_where_the_bad_value_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, "c.toml", "[tiers.dram]\ncapacity_blocks = -5\n")
    with pytest.raises(ConfigError, match=r"must be >= 0 \(set in .*c\.toml\)"):
        load_config(path, env={})


def test_ssd_options_are_validated_only_where_they_matter() -> None:
    # Disabled SSD: a nonsense path and a tiny map size are never looked at.
    cfg = load_config(env={}, overrides={"tiers": {"ssd": {"path": "/etc/passwd/x", "map_size_bytes": 1}}})
    assert cfg.ssd.map_size_bytes == 1


def test_direct_construction_is_validated() -> None:
    with pytest.raises(ConfigError, match="tiers.dram.capacity_blocks=-5"):
        DRAMTierConfig(capacity_blocks=-5)
    with pytest.raises(ConfigError, match="namespace.tp_size"):
        NamespaceConfig(tp_size=0)
    with pytest.raises(ConfigError, match="layout"):
        KVTierConfig(layout="big")  # type: ignore[arg-type]


# --- the SSD directory


def _ssd(path: str) -> dict[str, Any]:
    return {"tiers": {"ssd": {"enabled": True, "path": path, "capacity_blocks": 4}}}


def test_ssd_existing_writable_dir_is_fine(tmp_path: Path) -> None:
    assert load_config(env={}, overrides=_ssd(str(tmp_path))).ssd.resolved_path() == tmp_path


def test_ssd_creatable_dir_is_checked_then_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    load_config(env={}, overrides=_ssd(str(target)))
    assert not (tmp_path / "a").exists()


def test_ssd_home_relative_path_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(env={}, overrides=_ssd("~/kv"))
    assert cfg.ssd.path == "~/kv" and cfg.ssd.resolved_path() == tmp_path / "kv"


def test_ssd_symlinked_dir_resolves_to_its_target(tmp_path: Path) -> None:
    (tmp_path / "nvme").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nvme")
    cfg = load_config(env={}, overrides=_ssd(str(tmp_path / "link")))
    assert cfg.ssd.path == str(tmp_path / "link") and cfg.ssd.resolved_path() == tmp_path / "nvme"


def test_ssd_symlinked_lmdb_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "data.mdb").symlink_to(tmp_path / "elsewhere.mdb")
    with pytest.raises(ConfigError, match=r"tiers.ssd.path=.*data.mdb.* is a symlink or not a regular file"):
        load_config(env={}, overrides=_ssd(str(tmp_path)))


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda p: (p / "f").write_text("x") and p / "f", "is not a directory"),
        (lambda p: (p / "f").write_text("x") and p / "f" / "sub", "is not a directory"),
        (lambda p: p / "nul\0byte", "cannot create directory"),
        (lambda p: "~no_such_user_kvtier/ssd", "cannot create directory"),
    ],
    ids=["path-is-a-file", "ancestor-is-a-file", "nul-byte", "unknown-user"],
)
def test_ssd_bad_path(tmp_path: Path, make: Any, problem: str) -> None:
    path = str(make(tmp_path))
    with pytest.raises(ConfigError, match=problem) as info:
        load_config(env={}, overrides=_ssd(path))
    assert info.value.setting == "tiers.ssd.path" and repr(path) in str(info.value)


def test_ssd_unwritable_ancestor_via_os_access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may write anywhere, so fake the permission check this test is about.
    monkeypatch.setattr(kvtier.config.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="tiers.ssd.path=.*is not writable"):
        load_config(env={}, overrides=_ssd(str(tmp_path / "new")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root bypasses directory permissions")
def test_ssd_unwritable_ancestor_for_real(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(ConfigError, match="tiers.ssd.path"):
            load_config(env={}, overrides=_ssd(str(locked / "ssd")))
    finally:
        locked.chmod(0o700)


def test_ssd_mkdir_failure_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match="tiers.ssd.path=.*cannot create directory.*Permission denied"):
        load_config(env={}, overrides=_ssd(str(tmp_path / "new")))


# --- unknown keys


@pytest.mark.parametrize(
    ("data", "setting", "valid"),
    [
        ({"pin_budget": 1}, "pin_budget", ["layout", "namespace", "tiers", "pin_budget_blocks", "put_tier"]),
        ({"layout": {"num_layer": 2}}, "layout.num_layer", names(LayoutConfig)),
        ({"namespace": {"salt": "x"}}, "namespace.salt", names(NamespaceConfig)),
        ({"tiers": {"nvme": {}}}, "tiers.nvme", ["dram", "hbm", "remote", "ssd"]),
        ({"tiers": {"dram": {"capcity_blocks": 5}}}, "tiers.dram.capcity_blocks", names(DRAMTierConfig)),
        ({"tiers": {"ssd": {"level": 5}}}, "tiers.ssd.level", names(SSDTierConfig)),
        ({"hbm": {"enabled": True}}, "hbm", ["tiers"]),  # tiers belong under "tiers"
    ],
)
def test_unknown_key_lists_the_valid_keys(tmp_path: Path, data: dict[str, Any], setting: str, valid: list[str]) -> None:
    for load in (
        lambda: load_config(env={}, overrides=data),
        lambda: load_config(write(tmp_path, "c.yaml", yaml.safe_dump(data)), env={}),
    ):
        with pytest.raises(ConfigError) as info:
            load()
        assert info.value.setting == setting
        for key in valid:
            assert key in str(info.value)


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'capacity_blocks'"):
        load_config(env={}, overrides={"tiers": {"dram": {"capcity_blocks": 5}}})


# --- file errors


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("missing.yaml", None, "cannot read"),
        ("c.json", "{}", "must end in .yaml, .yml or .toml"),
        ("c.yaml", "layout:\n  num_layers: [1,\n", "line"),
        ("c.yaml", "a: 1\n b: 2\n", "line"),
        ("c.yml", "- 1\n- 2\n", "top level must be a mapping"),
        ("c.toml", "[layout]\nnum_layers = \n", "line"),
        ("c.toml", "x = 1\nx = 2\n", "line"),
        ("c.yaml", b"\xff\xfe\x00bad", "cannot read"),
        ("c.yaml", "date: 1900-02-30\n", "invalid YAML"),
    ],
)
def test_file_errors_name_the_file(tmp_path: Path, name: str, content: str | bytes | None, problem: str) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=problem) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_directory_as_file_is_a_config_error(tmp_path: Path) -> None:
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(folder, env={})


# --- junk never escapes as anything but ConfigError

_SETTING_KEYS = sorted(
    {"layout", "namespace", "tiers", "hbm", "dram", "ssd", "path", "enabled"}
    | {f for cls in (LayoutConfig, NamespaceConfig, HBMTierConfig, SSDTierConfig, KVTierConfig) for f in names(cls)}
)
_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8)
_keys = st.sampled_from(_SETTING_KEYS) | st.text(max_size=6)
_trees = st.recursive(_scalars, lambda inner: st.dictionaries(_keys, inner, max_size=5) | st.lists(inner, max_size=3), max_leaves=20)
_LEAF_PATHS = [
    *((f,) for f in names(KVTierConfig) if f not in ("layout", "namespace", "hbm", "dram", "ssd", "remote")),
    *(("layout", f) for f in names(LayoutConfig)),
    *(("namespace", f) for f in names(NamespaceConfig)),
    *(("tiers", tier, f) for tier, cls in [("hbm", HBMTierConfig), ("dram", DRAMTierConfig), ("ssd", SSDTierConfig),
                                           ("remote", RemoteTierConfig)] for f in names(cls)),
]
_near_values = _scalars | st.sampled_from(["auto", "lru", "raw", "zstd", "cuda:0", "hbm", "ssd", "mla", "int8", "x/y"])


def _nest(flat: dict[tuple[str, ...], object]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


# Well-formed trees of real settings with random values: exercises every validator.
_near_trees = st.dictionaries(st.sampled_from(_LEAF_PATHS), _near_values, max_size=8).map(_nest)
_yamlish = st.lists(st.sampled_from(list("abz019 :-[]{}#\n\t&*!|>'\",.%@`=?~\\") + _SETTING_KEYS), max_size=40).map("".join)


def _load_text_quietly(suffix: str, text: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"junk{suffix}"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load_config(path, env={})
        except ConfigError:
            pass


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Junk may enable the SSD tier: keep any directory check inside tmp_path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=200) | _yamlish, suffix=st.sampled_from([".yaml", ".toml"]))
def test_junk_text_raises_only_config_error(sandbox: Path, text: str, suffix: str) -> None:
    _load_text_quietly(suffix, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=st.dictionaries(_keys, _trees, max_size=6) | _near_trees, suffix=st.sampled_from([".yaml", ".toml", "overrides"]))
def test_junk_settings_raise_only_config_error(sandbox: Path, tree: dict[str, Any], suffix: str) -> None:
    if suffix == "overrides":
        try:
            load_config(env={}, overrides=tree)
        except ConfigError:
            pass
    elif suffix == ".yaml":
        _load_text_quietly(suffix, yaml.safe_dump(tree))
    else:
        _load_text_quietly(suffix, to_toml({k: v for k, v in tree.items() if v is not None and not isinstance(v, list)}))


def test_placement_section_sets_the_policy_and_its_constants(tmp_path: Path) -> None:
    """A file's ``placement`` section (what ``kvtier tune`` writes) names the policy and
    its constants; the environment can set one; unset constants stay the policy's own."""
    from kvtier.placement import make_placement

    path = write(tmp_path, "p.yaml", "placement:\n  policy: kvtier\n  next_use_trust: 2\n  rho_max: 0.4\n"
                                     "tuned:\n  trace: rec/\n  objective: prefill\n")
    cfg = load_config(path, env={"KVTIER_PLACEMENT__CRITICAL_AT": "0.6"})
    assert cfg.placement.params() == {"next_use_trust": 2.0, "rho_max": 0.4, "critical_at": 0.6}
    assert cfg.tuned.trace == "rec/" and cfg.tuned.objective == "prefill"
    policy = make_placement(cfg.placement.policy, params=cfg.placement.params())
    default = make_placement("kvtier")
    assert (policy.next_use_trust, policy.rho_bounds, policy.critical_at) == (2.0, (0.05, 0.4), 0.6)
    assert policy.lead_factor == default.lead_factor and default.next_use_trust == 0.5
    assert load_config(env={}).placement.params() == {}

