"""EngineConfig: one name per setting, nested transport options, and one reader of the environment
(EngineConfig.from_env) shared by the CLI and the SGLang adapter."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import warnings

import pytest

from kvxfer import EngineConfig
from kvxfer.engine.config import env_table
from kvxfer.errors import ConfigError
from kvxfer.integrations.sglang.settings import engine_config
from kvxfer.transport import registry
from kvxfer.transport.options import OPTIONS, ShmOptions, TcpOptions, VerbsOptions


@pytest.fixture(autouse=True)
def _no_kvxfer_environment(monkeypatch):
    """Tests pass their environment explicitly; none of the caller's KVXFER_* settings leak in."""
    for name in list(os.environ):
        if name.startswith("KVXFER_") and name not in ("KVXFER_TEST_SESSION", "KVXFER_TEST_FAULTS"):
            monkeypatch.delenv(name)


# options() ------------------------------------------------------------------------------------------


def test_options_default_to_the_dataclass_of_the_configured_transport():
    config = EngineConfig(max_context=64)
    assert config.transport_options == {}
    assert config.options() == TcpOptions()
    assert config.options("verbs") == VerbsOptions(device=None, port=1, gid_index=None)
    assert config.options("shm") == ShmOptions()
    assert EngineConfig(max_context=64, transport="verbs").options() == VerbsOptions()


def test_options_fill_defaults_around_what_was_given_and_accept_built_dataclasses():
    config = EngineConfig(max_context=64, transport="verbs", transport_options={"verbs": {"device": "rxe0"}})
    config.validate()
    assert config.options() == VerbsOptions(device="rxe0", port=1, gid_index=None)
    built = VerbsOptions(device="mlx5_0", port=2, gid_index=3)
    config = EngineConfig(max_context=64, transport="verbs", transport_options={"verbs": built})
    config.validate()
    assert config.options() is built
    # to_dict() turns option dataclasses into plain data, and EngineConfig(**d) rebuilds the same settings
    again = EngineConfig(**config.to_dict())
    assert again.options() == built and again.transport_options == {"verbs": dataclasses.asdict(built)}


def test_options_of_a_copy_are_independent():
    base = EngineConfig(max_context=64, transport_options={"verbs": {"device": "rxe0"}})
    copy = dataclasses.replace(base, seed=3)
    copy.transport_options["verbs"]["device"] = "rxe1"
    assert base.options("verbs").device == "rxe0"


@pytest.mark.parametrize(("options", "named"), [
    ({"verbs": {"dev": "rxe0"}}, "unknown verbs transport option 'dev'"),
    ({"verbs": {"port": "1"}}, "verbs option 'port' must be int"),
    ({"verbs": {"port": True}}, "verbs option 'port' must be int"),
    ({"verbs": {"gid_index": 1.5}}, "verbs option 'gid_index' must be int or None"),
    ({"verbs": {"windows": "maybe"}}, "verbs option 'windows' is 'maybe'; choose one of 'auto', 'on', 'off'"),
    ({"verbs": {"window_max_runs": "8"}}, "verbs option 'window_max_runs' must be int"),
    ({"tcp": {"staging": "gpu"}}, "tcp option 'staging' is 'gpu'; choose one of None, 'host'"),
    ({"shm": {"ring_bytes": None}}, "shm option 'ring_bytes' must be int"),
    ({"rdma": {"device": "x"}}, "transport_options names unknown transport 'rdma'"),
    ({"tcp": ShmOptions()}, r"transport_options\['tcp'\] must be a dict or a TcpOptions"),
])
def test_a_bad_option_is_a_config_error_naming_transport_and_field(options, named):
    config = EngineConfig(max_context=64, transport_options=options)
    with pytest.raises(ConfigError, match=named):
        config.validate()


def test_options_of_an_unknown_transport_name_it():
    with pytest.raises(ConfigError, match=r"unknown transport 'rdma' \(available: tcp, shm, verbs\)"):
        EngineConfig(max_context=64).options("rdma")


def test_transport_names_come_from_the_registry():
    assert set(registry.names()) == {"tcp", "shm", "verbs"}
    assert set(OPTIONS) == set(registry.names())
    for name in registry.names():
        EngineConfig(max_context=64, transport=name).validate()
    with pytest.raises(ConfigError, match="unknown transport 'ib'.*tcp, shm, verbs"):
        EngineConfig(max_context=64, transport="ib").validate()


# the old spellings ----------------------------------------------------------------------------------


def test_old_keywords_and_extra_still_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning) as record:
        config = EngineConfig(max_context=64, transport="verbs", ib_device="rxe0", gid_index=1)
    assert sorted(str(w.message) for w in record) == [
        'EngineConfig gid_index is deprecated; use transport_options["verbs"]["gid_index"]',
        'EngineConfig ib_device is deprecated; use transport_options["verbs"]["device"]',
    ]
    assert all(w.filename == __file__ for w in record)  # attributed to the caller
    assert config.options() == VerbsOptions(device="rxe0", port=1, gid_index=1)
    with pytest.warns(DeprecationWarning, match=r'extra\["tcp_staging"\] is deprecated; use '
                                                r'transport_options\["tcp"\]\["staging"\]'):
        config = EngineConfig(max_context=64, extra={"tcp_staging": "host", "note": "kept"})
    assert config.options("tcp").staging == "host"
    assert config.extra == {"note": "kept"}  # extra stays free-form: the setting moved
    with pytest.warns(DeprecationWarning, match="verbs_options"):
        assert config.verbs_options() == VerbsOptions()


def test_the_new_spelling_wins_over_the_old_one():
    with pytest.warns(DeprecationWarning, match="deprecated and ignored"):
        config = EngineConfig(max_context=64, ib_device="old", transport_options={"verbs": {"device": "new"}})
    assert config.options("verbs").device == "new"


def test_the_new_spelling_warns_nothing_and_survives_copies():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = EngineConfig(max_context=64, transport_options={"tcp": {"staging": "host"}})
        copy = dataclasses.replace(config, seed=1)
        rebuilt = EngineConfig(**copy.to_dict())
    assert rebuilt.options("tcp").staging == "host"


# from_env -------------------------------------------------------------------------------------------


def test_from_env_reads_every_scalar_setting_by_its_type():
    env = {
        "KVXFER_MAX_CONTEXT": "4096", "KVXFER_TRANSPORT": "verbs", "KVXFER_HOST": "10.0.0.7",
        "KVXFER_CHECKSUM": "crc32", "KVXFER_KEYRING": "/etc/kvxfer/prefill0", "KVXFER_METRICS_PORT": "9100",
        "KVXFER_DRAIN_TIMEOUT": "2.5", "KVXFER_ALLOW_UNDERSIZED_POOL": "true", "KVXFER_SEED": "7",
        "KVXFER_ALLOC_POLICY": "fifo", "KVXFER_MAX_PENDING_META": " 12 ", "KVXFER_METRICS_HOST": "",
    }
    config = EngineConfig.from_env(env)
    assert (config.max_context, config.transport, config.host, config.checksum) == (4096, "verbs", "10.0.0.7", "crc32")
    assert (config.keyring, config.metrics_port, config.drain_timeout) == ("/etc/kvxfer/prefill0", 9100, 2.5)
    assert config.allow_undersized_pool is True and config.seed == 7 and config.alloc_policy == "fifo"
    assert config.max_pending_meta == 12
    assert config.metrics_host is None  # empty counts as unset
    assert EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "1", "KVXFER_ALLOW_UNDERSIZED_POOL": "0"}
                                 ).allow_undersized_pool is False


@pytest.mark.parametrize("text", ["٤٠٩٦", "４０９６", "²", "1_0", "١.٥"])
def test_from_env_takes_numbers_in_ascii_digits_only(text):
    """int() and float() take any Unicode digit (and underscores): a setting from the environment is
    refused unless it is written in ASCII, naming the variable."""
    var = "KVXFER_DRAIN_TIMEOUT" if "." in text else "KVXFER_MAX_CONTEXT"
    env = {"KVXFER_MAX_CONTEXT": "4096", var: text}
    with pytest.raises(ConfigError, match=var):
        EngineConfig.from_env(env)


def test_from_env_reads_transport_options_by_their_variables():
    env = {"KVXFER_MAX_CONTEXT": "64", "KVXFER_IB_DEVICE": "mlx5_1", "KVXFER_IB_PORT": "2",
           "KVXFER_GID_INDEX": "3", "KVXFER_TCP_STAGING": "host", "KVXFER_SHM_RING_BYTES": "1048576"}
    config = EngineConfig.from_env(env, transport="verbs")
    assert config.options() == VerbsOptions(device="mlx5_1", port=2, gid_index=3)
    assert config.options("tcp").staging == "host"
    assert config.options("shm") == ShmOptions(ring_bytes=1 << 20)


def test_from_env_keywords_win_over_the_environment_and_options_merge_per_field():
    env = {"KVXFER_MAX_CONTEXT": "64", "KVXFER_TRANSPORT": "verbs", "KVXFER_CHECKSUM": "crc32",
           "KVXFER_IB_DEVICE": "mlx5_1", "KVXFER_GID_INDEX": "3", "KVXFER_METRICS_PORT": "9100"}
    config = EngineConfig.from_env(env, max_context=128, transport="tcp", metrics_port=None,
                                   transport_options={"verbs": {"gid_index": 0}})
    assert (config.max_context, config.transport, config.checksum, config.metrics_port) == (128, "tcp", "crc32", None)
    assert config.options("verbs") == VerbsOptions(device="mlx5_1", port=1, gid_index=0)
    # a built dataclass replaces the environment's options of that transport whole
    config = EngineConfig.from_env(env, transport_options={"verbs": VerbsOptions(port=2)})
    assert config.options("verbs") == VerbsOptions(device=None, port=2, gid_index=None)


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVXFER_MAX_CONTEXT", "512")
    monkeypatch.setenv("KVXFER_TRANSPORT", "shm")
    config = EngineConfig.from_env()
    assert (config.max_context, config.transport) == (512, "shm")


def test_from_env_never_reads_the_negative_control():
    config = EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_UNSAFE_LEGACY": "1"})
    assert config.unsafe_legacy is False
    assert "KVXFER_UNSAFE_LEGACY" not in [row[0] for row in env_table()]


def test_deprecated_variable_names_warn_and_still_work():
    env = {"KVXFER_MAX_CONTEXT": "64", "KVXFER_RDMA_DEVICE": "rxe0"}
    with pytest.warns(DeprecationWarning, match="KVXFER_RDMA_DEVICE is deprecated; use KVXFER_IB_DEVICE"):
        config = EngineConfig.from_env(env, transport="verbs")
    assert config.options().device == "rxe0"
    with pytest.warns(DeprecationWarning, match="KVXFER_RDMA_DEVICE is deprecated and ignored: KVXFER_IB_DEVICE is set"):
        config = EngineConfig.from_env({**env, "KVXFER_IB_DEVICE": "mlx5_0"})
    assert config.options("verbs").device == "mlx5_0"


def test_deprecated_keywords_to_from_env_win_over_the_environment_too():
    env = {"KVXFER_MAX_CONTEXT": "64", "KVXFER_IB_DEVICE": "mlx5_0"}
    with pytest.warns(DeprecationWarning, match="ib_device is deprecated"):
        config = EngineConfig.from_env(env, ib_device="rxe0")
    assert config.options("verbs").device == "rxe0"


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("KVXFER_MAX_CONTEXT", "lots", "an integer"),
    ("KVXFER_DRAIN_TIMEOUT", "10s", "a number"),
    ("KVXFER_ALLOW_UNDERSIZED_POOL", "maybe", "a boolean"),
    ("KVXFER_METRICS_PORT", "http", "an integer"),
    ("KVXFER_GID_INDEX", "first", "an integer"),
    ("KVXFER_RDMA_DEVICE", "", None),  # empty: unset, no error
])
def test_a_bad_variable_is_a_config_error_naming_it(variable, value, expected):
    env = {"KVXFER_MAX_CONTEXT": "64", variable: value}
    if expected is None:
        EngineConfig.from_env(env)
        return
    with pytest.raises(ConfigError, match=f"{variable}={value!r}: expected {expected}"):
        EngineConfig.from_env(env)


def test_from_env_validates_what_it_read():
    with pytest.raises(ConfigError, match="unknown transport 'rdma'"):
        EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_TRANSPORT": "rdma"})
    with pytest.raises(ConfigError, match="tcp option 'staging' is 'gpu'"):
        EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_TCP_STAGING": "gpu"})
    with pytest.raises(ConfigError, match="unknown checksum 'md5'"):
        EngineConfig.from_env({"KVXFER_MAX_CONTEXT": "64", "KVXFER_CHECKSUM": "md5"})


def test_max_context_is_required():
    with pytest.raises(ConfigError, match="max_context is required: set KVXFER_MAX_CONTEXT"):
        EngineConfig.from_env({})
    assert EngineConfig.from_env({}, max_context=8).max_context == 8


def test_every_variable_is_documented_in_the_readme():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for variable, _, deprecated in env_table():
        assert f"`{variable}`" in readme, variable
        for old in deprecated:
            assert f"`{old}`" in readme, old


# the SGLang adapter ---------------------------------------------------------------------------------


def _server_args(**kw):
    return types.SimpleNamespace(context_length=kw.pop("context_length", 2048), **kw)


def test_sglang_adapter_builds_its_config_from_the_environment():
    env = {"KVXFER_TRANSPORT": "verbs", "KVXFER_HOST": "10.1.2.3", "KVXFER_CHECKSUM": "crc32",
           "KVXFER_ALLOW_UNDERSIZED_POOL": "1", "KVXFER_KEYRING": "/keys/p0", "KVXFER_METRICS_PORT": "9100",
           "KVXFER_GID_INDEX": "1", "KVXFER_DRAIN_TIMEOUT": "60",
           "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "8",
           "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120"}
    config = engine_config(_server_args(disaggregation_ib_device="mlx5_2"), pool_tokens=4096, rank=2, environ=env)
    assert (config.max_context, config.transport, config.host, config.checksum) == (2048, "verbs", "10.1.2.3", "crc32")
    assert config.allow_undersized_pool is True and config.keyring == "/keys/p0"
    assert config.metrics_port == 9102  # KVXFER_METRICS_PORT + rank
    assert config.drain_timeout == 4.0  # capped at half SGLang's deferred-release timeout
    assert (config.transfer_timeout, config.meta_timeout, config.free_policy) == (120.0, 120.0, "keep")
    assert config.options() == VerbsOptions(device="mlx5_2", port=1, gid_index=1)  # SGLang's flag fills the device


def test_sglang_adapter_defaults_and_precedence():
    config = engine_config(_server_args(context_length=None), pool_tokens=4096, rank=0, environ={})
    assert (config.max_context, config.transport, config.metrics_port, config.drain_timeout) == (4096, "tcp", None, 10.0)
    assert config.keyring is None and config.allow_undersized_pool is False
    # KVXFER_IB_DEVICE wins over --disaggregation-ib-device; KVXFER_MAX_CONTEXT does not beat SGLang's context
    env = {"KVXFER_IB_DEVICE": "rxe0", "KVXFER_MAX_CONTEXT": "99"}
    config = engine_config(_server_args(disaggregation_ib_device="mlx5_0"), pool_tokens=4096, rank=0, environ=env)
    assert config.options("verbs").device == "rxe0" and config.max_context == 2048
    with pytest.warns(DeprecationWarning, match="KVXFER_RDMA_DEVICE"):
        config = engine_config(_server_args(), pool_tokens=4096, rank=0, environ={"KVXFER_RDMA_DEVICE": "rxe1"})
    assert config.options("verbs").device == "rxe1"
    with pytest.raises(ConfigError, match="KVXFER_DRAIN_TIMEOUT='soon'"):
        engine_config(_server_args(), pool_tokens=4096, rank=0, environ={"KVXFER_DRAIN_TIMEOUT": "soon"})


# the command line -----------------------------------------------------------------------------------


def _kvxfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_")}
    return subprocess.run([sys.executable, "-m", "kvxfer", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **(env or {})})


@pytest.mark.parametrize("command", ["demo", "stress", "bench"])
def test_cli_offers_every_registered_transport(command):
    out = _kvxfer(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "{tcp,shm,verbs}" in out.stdout
    assert "KVXFER_TRANSPORT" in out.stdout and "KVXFER_IB_DEVICE" in out.stdout


def test_cli_refuses_a_bad_variable_naming_it_before_starting_anything():
    out = _kvxfer("stress", "--requests", "1", env={"KVXFER_GID_INDEX": "first"})
    assert out.returncode == 2
    assert "kvxfer stress: KVXFER_GID_INDEX='first': expected an integer" in out.stderr


def test_cli_transport_settings_come_from_the_environment_and_flags_win(monkeypatch):
    from kvxfer.tools.cli import _engine_settings, build_parser

    parser = build_parser()
    for name, value in {"KVXFER_TRANSPORT": "verbs", "KVXFER_IB_DEVICE": "mlx5_0", "KVXFER_GID_INDEX": "3"}.items():
        monkeypatch.setenv(name, value)
    from_env = _engine_settings(parser.parse_args(["demo"]))
    assert from_env["transport"] == "verbs"
    assert from_env["transport_options"]["verbs"] == {"device": "mlx5_0", "gid_index": 3}
    flags = _engine_settings(parser.parse_args(["bench", "--transport", "tcp", "--ib-device", "rxe0"]))
    assert flags["transport"] == "tcp"
    assert flags["transport_options"]["verbs"] == {"device": "rxe0", "gid_index": 3}
