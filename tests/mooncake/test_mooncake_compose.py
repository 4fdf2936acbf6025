"""The Mooncake compose files say what the binaries accept: every kvtag variable is a flag of
`kvtag-store serve`, every Mooncake flag is one its binary lists, and the HA file wires etcd, two
masters, storage nodes and replicas (a replica per host, shared memory with that host's engines)
the way tests/mooncake/mooncake_ha.py runs them.

No compose tool here can validate a file without touching podman (podman-compose 1.0 has no
`config`; its --dry-run creates the networks), so the files are parsed and checked against the
CLIs' own --help. The project's venv has no YAML parser; the system Python's is used when present.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.prefix) / "bin"
FILES = ("compose.mooncake.yaml", "compose.mooncake-ha.yaml")


def load(name: str) -> dict[str, Any]:
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin")
    code = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"
    if python is None or subprocess.run([python, "-c", "import yaml"], capture_output=True).returncode:
        pytest.skip("no Python with PyYAML outside the venv to parse the compose files")
    out = subprocess.run([python, "-c", code, str(REPO / name)], capture_output=True, text=True, check=True)
    parsed: dict[str, Any] = json.loads(out.stdout)
    return parsed


def help_flags(*argv: str) -> set[str]:
    """The --flags a command's help lists (gflags' --helpfull prints `-flag (text)`)."""
    text = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    found = set(re.findall(r"(?m)^\s+-{1,2}([a-z][a-z0-9_-]+)", text.stdout + text.stderr))
    assert found, f"no flags in the help of {argv}"
    return found


def flag_names(command: list[str]) -> list[str]:
    return [arg.lstrip("-").split("=")[0] for arg in command if arg.startswith("-")]


def kvtag_variables(service: dict[str, Any]) -> list[str]:
    return [name for name in service.get("environment", {}) if name.startswith("KVTAG_")]


@pytest.mark.parametrize("name", FILES)
def test_every_kvtag_variable_and_mooncake_flag_is_one_the_binaries_accept(name: str) -> None:
    compose = load(name)
    serve = help_flags(str(BIN / "kvtag-store"), "serve", "--help")
    master = help_flags(str(BIN / "mooncake_master"), "--helpfull")
    storage = help_flags(str(BIN / "mooncake_client"), "--helpfull")
    for service_name, service in compose["services"].items():
        entry = service.get("entrypoint", [None])[0]
        flags = flag_names([str(a) for a in service.get("command", [])])
        if entry == "mooncake_master":
            assert set(flags) <= master, f"{service_name}: {set(flags) - master} not mooncake_master flags"
        elif entry == "mooncake_client":
            assert set(flags) <= storage, f"{service_name}: {set(flags) - storage} not mooncake_client flags"
        for variable in kvtag_variables(service):
            flag = variable.removeprefix("KVTAG_").lower().replace("_", "-")
            assert flag in serve, f"{service_name}: {variable} names no `kvtag-store serve --{flag}`"


@pytest.mark.parametrize("name", FILES)
def test_mooncake_stays_on_an_internal_network_and_ports_on_loopback(name: str) -> None:
    compose = load(name)
    assert compose["networks"]["mooncake"]["internal"] is True
    for service_name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{service_name} publishes {port} beyond loopback"
        if not service_name.startswith("kvtag"):
            assert service["networks"] == ["mooncake"], f"{service_name} must stay on the internal network"


def test_the_ha_file_runs_etcd_two_ha_masters_and_a_replica_and_storage_node_per_host() -> None:
    services = load("compose.mooncake-ha.yaml")["services"]
    etcd = services["etcd"]
    assert "--advertise-client-urls=http://etcd:2379" in etcd["command"]
    masters = {n: s for n, s in services.items() if s.get("entrypoint") == ["mooncake_master"]}
    assert len(masters) == 2
    metrics = []
    for name, master in masters.items():
        command = master["command"]
        for flag in ("--enable_ha=true", "--enable_oplog=true", "--etcd_endpoints=etcd:2379"):
            assert flag in command, f"{name} lacks {flag}"
        assert f"--rpc_address={name}" in command, f"{name} must advertise its own name in etcd"
        port = next(a.split("=")[1] for a in command if a.startswith("--metrics_port="))
        metrics.append(f"{name}:{port}")
    storage = [s for s in services.values() if s.get("entrypoint") == ["mooncake_client"]]
    replicas = {n: s for n, s in services.items() if n.startswith("kvtag-")}
    assert len(storage) == len(replicas) == 2, "a storage node and a replica per host"
    for node in storage:
        assert "--master_server_address=etcd://etcd:2379" in node["command"]
    for name, replica in replicas.items():
        env = replica["environment"]
        assert env["KVTAG_BACKEND"] == "mooncake"
        assert env["KVTAG_MOONCAKE_MASTER"] == "etcd://etcd:2379"
        assert env["KVTAG_MOONCAKE_METRICS"].split(",") == metrics, (
            "GetStats must be able to follow the leader"
        )
        assert env["KVTAG_MOONCAKE_LOCAL_HOSTNAME"] == name
        shm = env["KVTAG_SHM_DIR"]
        assert any(v.endswith(f":{shm}") for v in replica["volumes"]), (
            f"{name}: engines share {shm} by a volume"
        )
    policies = {r["environment"]["KVTAG_POLICY"] for r in replicas.values()}
    assert len(policies) == 1, "every replica runs the same policy (the census records are shared)"
