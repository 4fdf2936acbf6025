"""Flag parsing: sizes, policies, environment defaults."""

from __future__ import annotations

import argparse
import os

import pytest
from kvtag.v1 import store_pb2 as pb
from kvtag_store.app.cli import build_parser
from kvtag_store.backends.mooncake import options as mooncake_options
from kvtag_store.backends.mooncake.backend import MooncakeSettings
from kvtag_store.config import env_name, parse_namespace_policy, parse_size, service_config


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("64kib", 64 << 10),
        ("2GB", 2_000_000_000),
        ("1073741824", 1 << 30),
    ],
)
def test_sizes_accept_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "-1", "1.5GiB"])
def test_bad_sizes_are_refused_with_examples(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="examples"):
        parse_size(text)


def test_environment_names_follow_the_flag_names() -> None:
    assert env_name("--session-ttl-ms") == "KVTAG_SESSION_TTL_MS"
    assert env_name("--metrics-listen") == "KVTAG_METRICS_LISTEN"


def test_environment_supplies_defaults_and_flags_override_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTAG_SESSION_TTL_MS", "1234")
    monkeypatch.setenv("KVTAG_POLICY", "strict")
    monkeypatch.setenv("KVTAG_NAMESPACE_POLICY", "ns-a=isolate, ns-b=strict")
    from_env = service_config(build_parser().parse_args(["serve"]))
    assert (from_env.session_ttl_ms, from_env.default_policy) == (1234, pb.POLICY_STRICT)
    assert from_env.namespace_policies == {"ns-a": pb.POLICY_ISOLATE, "ns-b": pb.POLICY_STRICT}
    flags = service_config(
        build_parser().parse_args(["serve", "--policy", "isolate", "--namespace-policy", "ns-c=strict"])
    )
    assert flags.default_policy == pb.POLICY_ISOLATE
    assert flags.namespace_policies == {"ns-c": pb.POLICY_STRICT}


def test_namespace_policy_needs_an_id_and_a_known_policy() -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_namespace_policy("strict")
    with pytest.raises(argparse.ArgumentTypeError, match="isolate or strict"):
        parse_namespace_policy("ns-a=lenient")


def test_mooncake_flags_default_to_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults are written once, in MooncakeSettings: with no flag, variable or config file for them,
    `serve --backend mooncake` runs on exactly the dataclass's defaults (the arena directory is the
    service's own --shm-dir, emptied here)."""
    for name in [n for n in os.environ if n.startswith("KVTAG_MOONCAKE_")]:
        monkeypatch.delenv(name)
    argv = ["serve", "--backend", "mooncake", "--mooncake-master", "10.0.0.1:1", "--shm-dir", ""]
    args = build_parser().parse_args(argv)
    assert mooncake_options.settings_from(args) == MooncakeSettings(
        master="10.0.0.1:1", metrics="10.0.0.1:9003"
    )
