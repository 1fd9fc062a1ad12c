"""The server's settings: one model read from a file, SLED_SERVE_* variables and `sled serve`
flags made from its fields; every bad key named with where it came from."""
from __future__ import annotations

import argparse

import pytest

from sled_cli import serve
from tests.conftest import serve_settings_of as settings_of
from verify_server.settings import ServerSettings, SettingsError, load_settings

# Every flag `sled serve` had before its flags were made from the settings: each still works.
FLAGS = ["--model", "--host", "--port", "--metrics-port", "--dtype", "--device",
         "--trust-remote-code", "--max-sessions", "--max-draft-tokens", "--max-batch-sessions",
         "--context-length", "--kv-budget", "--kv-fraction", "--kv-block-tokens",
         "--max-step-tokens", "--idle-timeout", "--sat-adapter", "--no-sat", "--engine",
         "--mqtt-host", "--mqtt-port", "--mqtt-username", "--mqtt-password", "--mqtt-tls",
         "--mqtt-ca-file", "--mqtt-cert-file", "--mqtt-key-file", "--mqtt-topic-prefix",
         "--server-id", "--announce-endpoint", "--announce-interval"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sled serve")
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_help_lists_every_flag():
    parser = argparse.ArgumentParser(prog="sled serve")
    serve.add_arguments(parser)
    text = parser.format_help()
    for flag in FLAGS + ["--config", "--max-draft-len"]:
        assert flag in text, flag
    assert "SLED_SERVE_" in text


def test_flags_keep_their_names_and_meanings():
    s = settings_of("--model", "m", "--max-draft-tokens", "6", "--kv-budget", "2MiB",
                    "--idle-timeout", "0.5", "--no-sat", "--trust-remote-code", "--engine", "padded",
                    "--mqtt-password", "pw", "--context-length", "100")
    assert (s.model, s.max_draft_tokens, s.kv_budget, s.idle_timeout) == ("m", 6, 2 << 20, 0.5)
    assert (s.sat, s.trust_remote_code, s.engine, s.context_length) == (False, True, "padded", 100)
    assert s.mqtt_password.get_secret_value() == "pw"
    assert settings_of("--max-draft-len", "5").max_draft_tokens == 5
    defaults = settings_of()
    assert defaults == ServerSettings() and defaults.port == 50051 and defaults.sat


def test_the_draft_limits_old_name_still_reads_as_a_key_and_a_variable(tmp_path, monkeypatch):
    """max_draft_tokens, the wire's name, was max_draft_len on the server: both still read."""
    toml = tmp_path / "serve.toml"
    toml.write_text("max_draft_len = 7\n")
    assert settings_of("--config", str(toml)).max_draft_tokens == 7
    monkeypatch.setenv("SLED_SERVE_MAX_DRAFT_LEN", "9")
    assert settings_of().max_draft_tokens == 9
    monkeypatch.setenv("SLED_SERVE_MAX_DRAFT_LEN", "0")          # its error names the variable set
    with pytest.raises(SettingsError, match="SLED_SERVE_MAX_DRAFT_LEN"):
        settings_of()
    monkeypatch.setenv("SLED_SERVE_MAX_DRAFT_TOKENS", "5")        # both names at once: which?
    with pytest.raises(SettingsError, match="name the same setting"):
        settings_of()
    monkeypatch.delenv("SLED_SERVE_MAX_DRAFT_LEN")
    monkeypatch.setenv("SLED_SERVE_MAX_DRAFT_TOKENS", "0")
    with pytest.raises(SettingsError, match="max_draft_tokens"):
        settings_of()


def test_file_then_variables_then_flags(tmp_path, monkeypatch):
    toml = tmp_path / "serve.toml"
    toml.write_text('model = "from-file"\nmax_sessions = 8\nkv_budget = "1GiB"\nport = 7000\n')
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("model: from-yaml\nmax_sessions: 9\n")
    monkeypatch.setenv("SLED_SERVE_MAX_SESSIONS", "12")
    s = settings_of("--config", str(toml), "--port", "7001")
    assert (s.model, s.max_sessions, s.kv_budget, s.port) == ("from-file", 12, 1 << 30, 7001)
    monkeypatch.delenv("SLED_SERVE_MAX_SESSIONS")
    assert settings_of("--config", str(yaml)).max_sessions == 9


def test_bad_keys_are_named_with_where_they_came_from(tmp_path, monkeypatch):
    toml = tmp_path / "serve.toml"
    toml.write_text('max_sesions = 4\nkv_fraction = 2\n')
    monkeypatch.setenv("SLED_SERVE_IDLE_TIMEOUT", "-1")
    monkeypatch.setenv("SLED_SERVE_BOGUS", "1")
    with pytest.raises(SettingsError) as exc:
        settings_of("--config", str(toml), "--kv-budget", "12 parsecs", "--max-step-tokens", "8")
    lines = str(exc.value).splitlines()
    assert lines[0] == "bad server settings:"
    expected = {"max_sesions": str(toml), "kv_fraction": str(toml), "idle_timeout": "SLED_SERVE_IDLE_TIMEOUT",
                "bogus": "SLED_SERVE_BOGUS", "kv_budget": "--kv-budget",
                "max_step_tokens": "--max-step-tokens"}
    for key, origin in expected.items():
        line = next((line for line in lines if line.strip().startswith(key)), None)
        assert line is not None and f"({origin})" in line, (key, lines)
    assert "cannot read size '12 parsecs'" in str(exc.value)
    assert "max_step_tokens (8) must hold a full draft + 1 (33)" in str(exc.value)
    assert len(lines) == 1 + len(expected)
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")


def test_announcement_settings_build_the_announcer_config():
    assert serve.announce_config(settings_of()) is None
    config = serve.announce_config(settings_of("--mqtt-host", "broker", "--mqtt-ca-file", "ca.pem",
                                               "--server-id", "gpu-1", "--port", "6000",
                                               "--host", "10.0.0.2", "--announce-interval", "2"))
    assert (config.broker.host, config.broker.port, config.broker.tls) == ("broker", 8883, True)
    assert (config.server_id, config.endpoint, config.interval_s) == ("gpu-1", "10.0.0.2:6000", 2.0)
    with pytest.raises(SettingsError, match="announce endpoint"):
        settings_of("--announce-endpoint", "nowhere")


def test_the_example_config_is_valid():
    from pathlib import Path

    example = load_settings(Path(__file__).parent.parent / "docs" / "serve.example.toml")
    assert (example.model, example.kv_budget, example.max_draft_tokens) == ("gemma3-270m", 4 << 30, 32)
    assert example.server_id == "gpu-1" and not example.mqtt_host
