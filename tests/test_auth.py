"""Keyrings: generation, the on-disk form ``kvxfer keygen`` writes, and addresses that carry keys."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest

from kvxfer import DecodeEngine, EngineConfig, PrefillEngine
from kvxfer.errors import ConfigError, PeerError
from kvxfer.wire.auth import Keyring, split_address, write_cluster, z85_to_hex

from .conftest import PAGE_TOKENS, make_layout


def test_keygen_writes_keyrings_that_trust_each_other_and_engines_use_them(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvxfer", "keygen", str(tmp_path), "prefill0", "decode0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    secret = tmp_path / "prefill0" / "self.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    prefill_ring, decode_ring = Keyring.load(tmp_path / "prefill0"), Keyring.load(tmp_path / "decode0")
    assert sorted(prefill_ring.trusted.values()) == ["decode0", "prefill0"]
    assert prefill_ring.is_trusted(decode_ring.public) and decode_ring.is_trusted(prefill_ring.public)
    assert prefill_ring.secret.decode() not in repr(prefill_ring)
    # engines take the directories as configured paths
    with PrefillEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=str(tmp_path / "prefill0"))) as p, \
            DecodeEngine(make_layout(16), EngineConfig(max_context=16 * PAGE_TOKENS, keyring=str(tmp_path / "decode0"))) as d:
        assert z85_to_hex(prefill_ring.public) in p.address
        assert d.connect(p.address) == p.engine_id
    again = subprocess.run([sys.executable, "-m", "kvxfer", "keygen", str(tmp_path), "prefill0"],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exist" in again.stderr


def test_broken_keyrings_are_clear_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="no self.key_secret"):
        Keyring.load(tmp_path)
    (tmp_path / "self.key_secret").write_text("not a certificate")
    with pytest.raises(ConfigError, match="self.key_secret"):
        Keyring.load(tmp_path)
    with pytest.raises(ConfigError, match="40 z85 characters"):
        Keyring(b"short", b"x" * 40)
    with pytest.raises(ConfigError, match="distinct"):
        write_cluster(tmp_path / "k", ["a", "a"])
    with pytest.raises(ConfigError, match="cannot read"):
        EngineConfig(max_context=16, keyring=str(tmp_path)).load_keyring()


def test_a_public_only_certificate_is_not_a_keyring(tmp_path):
    ring = Keyring.generate("x")
    ring.save(tmp_path / "x")
    public_only = tmp_path / "x" / "trusted" / "x.key"
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "self.key_secret").write_text(public_only.read_text())
    with pytest.raises(ConfigError, match="no secret key"):
        Keyring.load(tmp_path / "y")


def test_addresses_carry_the_server_key():
    ring = Keyring.generate()
    address = ring.address("tcp://127.0.0.1:5555")
    assert split_address(address) == ("tcp://127.0.0.1:5555", ring.public)
    assert split_address("tcp://127.0.0.1:5555") == ("tcp://127.0.0.1:5555", None)
    with pytest.raises(PeerError, match="not hex"):
        split_address("tcp://h:1#curve=zz")
    with pytest.raises(PeerError, match="32 bytes"):
        split_address("tcp://h:1#curve=abcd")
