"""Hashing modes as people read them: field diffs, refusal messages, likely causes of probe drift."""

from __future__ import annotations

import struct
import time

from kvtag.v1 import store_pb2 as pb
from kvtag_proto import ids

# Descriptor fields in the order of the canonical encoding.
MODE_FIELDS = (
    "key_scheme",
    "scheme_version",
    "hash_algorithm",
    "hash_block_size",
    "lookahead_tokens",
    "seed_fingerprint",
)
_INT_FIELDS = {"hash_block_size", "lookahead_tokens"}


def decode_mode(encoding: bytes) -> pb.HashingMode:
    """Inverse of kvtag_proto.ids.mode_encoding (the census stores the encoding)."""
    if not encoding.startswith(ids.MODE_DOMAIN):
        raise ValueError("not a kvtag mode encoding")
    pos = len(ids.MODE_DOMAIN)
    mode = pb.HashingMode()
    for name in MODE_FIELDS:
        (length,) = struct.unpack_from(">I", encoding, pos)
        pos += 4
        if name in _INT_FIELDS:
            setattr(mode, name, length)
        else:
            setattr(mode, name, encoding[pos : pos + length].decode("utf-8"))
            pos += length
    return mode


def field_text(mode: pb.HashingMode, name: str) -> str:
    value = getattr(mode, name)
    return str(value) if name in _INT_FIELDS else (value or "(empty)")


def mode_diff(established: pb.HashingMode, requested: pb.HashingMode) -> list[pb.FieldDiff]:
    return [
        pb.FieldDiff(
            field=name, established=field_text(established, name), requested=field_text(requested, name)
        )
        for name in MODE_FIELDS
        if getattr(established, name) != getattr(requested, name)
    ]


def describe_namespace(namespace_id: str, ns: pb.NamespaceDescriptor) -> str:
    tenant = f", tenant {ns.tenant}" if ns.tenant else ""
    return f"`{namespace_id}` ({ns.model_name}, {ns.kv_dtype}{tenant})"


def refusal_message(
    engine_id: str, namespace: str, established_mode_id: str, diffs: list[pb.FieldDiff]
) -> str:
    """What happened, why, and what to do, in one line."""
    requested = ", ".join(f"{d.field} {d.requested}" for d in diffs)
    wanted = ", ".join(f"{d.field} {d.established}" for d in diffs)
    hint = ""
    if any(d.field == "lookahead_tokens" for d in diffs):
        hint = " (lookahead follows the speculative decoding config: EAGLE-family drafters use 1)"
    return (
        f"engine `{engine_id}` hashes with {requested} but namespace {namespace} is strict on mode "
        f"{established_mode_id} with {wanted}{hint}; configure the engine to hash the same way, "
        "or start a separate namespace (e.g. another tenant) or run the namespace with policy isolate"
    )


def likely_cause(mode: pb.HashingMode, reference_labels: dict[str, str], labels: dict[str, str]) -> str:
    """Why two engines that declare one mode can still produce different probe keys."""
    causes: list[str] = []
    differing = sorted(
        k for k in set(reference_labels) | set(labels) if reference_labels.get(k) != labels.get(k)
    )
    if differing:
        shown = ", ".join(
            f"{k}: {reference_labels.get(k, '(unset)')} vs {labels.get(k, '(unset)')}" for k in differing
        )
        causes.append(f"the engines' labels differ ({shown})")
    if mode.key_scheme == "vllm":
        causes.append(
            "vLLM seeds its block hashes (NONE_HASH) from PYTHONHASHSEED: set the same PYTHONHASHSEED on "
            "every engine, or a fixed seed"
        )
        causes.append(
            f"the hash algorithm or vLLM version behind `{mode.hash_algorithm}` / scheme version "
            f"{mode.scheme_version} differs (e.g. sha256 vs sha256_cbor, another vLLM release)"
        )
    else:
        causes.append(
            f"a different implementation or version of the `{mode.key_scheme}` scheme or of the hash "
            f"algorithm `{mode.hash_algorithm}` (check both engines run the same kvtag-client and that "
            "the seed/seed_fingerprint really matches)"
        )
    return "likely cause: " + "; or ".join(causes)


def probe_disagreement(
    request: pb.OpenSessionRequest,
    ns_text: str,
    mode_id: str,
    reference_engine_id: str,
    reference_labels: dict[str, str],
    *,
    strict: bool,
) -> tuple[str, pb.ProbeDisagreement]:
    """The message and record of an engine whose probe keys differ from the reference engine's in the
    same declared mode: the two hash differently in fact, whatever they declare."""
    cause = likely_cause(request.mode, reference_labels, dict(request.labels))
    record = pb.ProbeDisagreement(
        namespace_id=ids.namespace_id(request.namespace),
        mode_id=mode_id,
        reference_engine_id=reference_engine_id,
        engine_id=request.engine_id,
        likely_cause=cause,
        at_unix_ms=int(time.time() * 1000),
    )
    verdict = "refused" if strict else "flagged"
    message = (
        f"engine `{request.engine_id}` declares mode {mode_id} in namespace {ns_text} but its probe keys "
        f"differ from engine `{reference_engine_id}`'s, so the two hash differently in fact and would "
        f"never share hits ({verdict}); {cause}"
    )
    return message, record
