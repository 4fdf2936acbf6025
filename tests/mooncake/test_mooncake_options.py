"""The --mooncake-* flags, their KVTAG_MOONCAKE_* variables and the JSON config file, in that order."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from kvtag_store import config
from kvtag_store.backends.mooncake import options as mooncake_options


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    mooncake_options.add_arguments(parser)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master": "10.0.0.1:1", "local-buffer": "1GB", "protocol": "rdma"}))
    monkeypatch.setenv("KVTAG_MOONCAKE_CONFIG", str(config))
    monkeypatch.setenv("KVTAG_MOONCAKE_LOCAL_BUFFER", "128MiB")
    settings = mooncake_options.settings_from(parse(["--mooncake-master", "127.0.0.1:50051"]))
    assert settings.master == "127.0.0.1:50051"
    assert settings.local_buffer_bytes == 128 << 20
    assert settings.protocol == "rdma"
    assert settings.metrics == "127.0.0.1:9003"
    assert settings.segment_bytes == 0


def test_missing_master_is_an_error_naming_every_way_to_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTAG_MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("KVTAG_MOONCAKE_CONFIG", raising=False)
    with pytest.raises(ValueError, match="KVTAG_MOONCAKE_MASTER"):
        mooncake_options.settings_from(parse([]))


def test_unknown_config_key_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"master": "h:1", "segment": "1GB"}))
    with pytest.raises(ValueError, match="segment"):
        mooncake_options.resolve(parse(["--mooncake-config", str(config)]))


@pytest.mark.parametrize(
    ("text", "size"),
    [("64MiB", 64 << 20), ("64MB", 64_000_000), ("1GiB", 1 << 30), ("4TiB", 4 << 40), ("4096", 4096)],
)
def test_sizes_parse_like_the_service_flags(text: str, size: int) -> None:
    """One parser for every size: MB is decimal, MiB binary, here as in --capacity."""
    assert mooncake_options.parse_size(text) == size == config.parse_size(text)


def test_default_local_buffer_is_64_mib() -> None:
    settings = mooncake_options.settings_from(parse(["--mooncake-master", "127.0.0.1:1"]))
    assert settings.local_buffer_bytes == 64 << 20


def test_malformed_size_is_refused() -> None:
    with pytest.raises(ValueError, match="not a size"):
        mooncake_options.parse_size("lots")


def test_this_suite_does_not_shadow_the_mooncake_wheel() -> None:
    """The suite is the package `tests.mooncake`; with its folder on sys.path it would be `mooncake`."""
    import mooncake.store

    assert Path(mooncake.store.__file__).resolve().parents[1] != Path(__file__).resolve().parents[1]
    assert "site-packages" in Path(mooncake.store.__file__).parts


def test_an_ha_master_needs_every_masters_metrics_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """With etcd:// there is no single master host to guess port 9003 on; GetStats must follow the
    leader, so the flag names each master's metrics endpoint."""
    monkeypatch.delenv("KVTAG_MOONCAKE_METRICS", raising=False)
    monkeypatch.delenv("KVTAG_MOONCAKE_CONFIG", raising=False)
    with pytest.raises(ValueError, match="--mooncake-metrics naming every master"):
        mooncake_options.settings_from(parse(["--mooncake-master", "etcd://127.0.0.1:2379"]))
    both = "127.0.0.1:9003,127.0.0.1:9013"
    settings = mooncake_options.settings_from(
        parse(["--mooncake-master", "etcd://127.0.0.1:2379", "--mooncake-metrics", both])
    )
    assert settings.metrics == both


def test_metrics_of_no_reachable_master_fail_at_start_naming_each_address() -> None:
    from kvtag_store.backends.base import BackendUnavailable
    from kvtag_store.backends.mooncake.client import probe_master_metrics, read_master_metrics

    from tests.net import free_port

    dead = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailable) as probed:
        probe_master_metrics(dead, timeout_s=0.5)
    for address in dead.split(","):
        assert address in str(probed.value)
    with pytest.raises(BackendUnavailable, match=r"no Mooncake master among .* leads"):
        read_master_metrics(dead, timeout_s=0.5)
