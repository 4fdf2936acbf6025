"""The store's layering, read from its imports: the rules docs/architecture.md states ("The layers").

Each test reads every `import` of store_service/kvtag_store with `ast` (those under TYPE_CHECKING
too) and names the arrows that break its rule, so a failure says which file to change. The last
test holds the product code (store, client, proto) to its size limits.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "store_service" / "kvtag_store"

# Top to bottom: a layer imports only the layers below it.
LAYERS = ["app", "api", "observe", "policy", "backends"]
# Floors beside a layer's, on its level: they import what it may, and neither imports the other.
BESIDE = {"events": "observe"}
# Beside the floors: who may import it. It imports only shared modules.
SIDE = {"security": {"app", "api", "observe", "events"}}
# Modules every layer may use; they import nothing of the store's.
SHARED = {"config", "errors", "heap"}
# What api, observe and policy may import of the backends: the contracts and capability Protocols,
# and the in-process record CensusStore.describe keeps (policy's snapshot census is a CensusStore too).
BACKEND_FACE = {"kvtag_store.backends.base", "kvtag_store.backends.descriptions"}


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str) -> str:
    """The longest prefix of `name` that is a module or package of the store."""
    parts = name.split(".")
    while parts:
        candidate = ROOT.parent.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return name


def arrows() -> Iterator[tuple[str, str]]:
    """(importing module, imported store module) for every import in the store."""
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_of(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                if name == "kvtag_store" or name.startswith("kvtag_store."):
                    yield module, _resolve(name)


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _level(floor: str) -> int | None:
    """The floor's place in LAYERS (a floor beside a layer has that layer's), None off the layers."""
    floor = BESIDE.get(floor, floor)
    return LAYERS.index(floor) if floor in LAYERS else None


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for source, target in arrows():
        floor, into = _floor(source), _floor(target)
        level, below = _level(floor), _level(into)
        if level is None or below is None or floor == into:
            continue
        if below < level or (below == level and (floor in BESIDE or into in BESIDE)):
            wrong.append(f"{source} -> {target}")
    layers = " > ".join(LAYERS) + "; " + ", ".join(f"{f} beside {o}" for f, o in BESIDE.items())
    assert not wrong, f"arrows that run back up or sideways ({layers}):\n" + "\n".join(wrong)


def test_security_is_used_by_app_api_observe_and_events_and_uses_only_shared_modules() -> None:
    wrong = []
    for source, target in arrows():
        floor, into = _floor(source), _floor(target)
        if into in SIDE and floor != into and floor not in SIDE[into]:
            wrong.append(f"{source} -> {target} (only {sorted(SIDE[into])} may use {into})")
        if floor in SIDE and into != floor and into not in SHARED:
            wrong.append(f"{source} -> {target} ({floor} uses only {sorted(SHARED)})")
    assert not wrong, "\n".join(wrong)


def test_shared_modules_import_nothing_of_the_store() -> None:
    wrong = [
        f"{source} -> {target}"
        for source, target in arrows()
        if _floor(source) in SHARED and _floor(target) != _floor(source)
    ]
    assert not wrong, "config, errors and heap must stay leaves:\n" + "\n".join(wrong)


def test_api_observe_events_and_policy_know_backends_only_through_base() -> None:
    wrong = [
        f"{source} -> {target}"
        for source, target in arrows()
        if _floor(source) in {"api", "observe", "events", "policy"}
        and _floor(target) == "backends"
        and target not in BACKEND_FACE
    ]
    assert not wrong, f"only {sorted(BACKEND_FACE)} are the backends' face:\n" + "\n".join(wrong)


def test_the_disk_tier_imports_nothing_of_the_memory_tier_above_it() -> None:
    wrong = [
        f"{source} -> {target}"
        for source, target in arrows()
        if source.startswith("kvtag_store.backends.memory.disk")
        and target.startswith("kvtag_store.backends.memory")
        and not target.startswith("kvtag_store.backends.memory.disk")
    ]
    assert not wrong, "the disk tier knows the memory tier only as ports.MemorySide:\n" + "\n".join(wrong)


def test_the_backends_never_import_each_other_and_their_shared_parts_import_neither() -> None:
    backends = {"memory", "mooncake"}
    wrong = []
    for source, target in arrows():
        if _floor(source) != "backends" or _floor(target) != "backends":
            continue
        mine, theirs = source.split(".")[2:3], target.split(".")[2:3]
        if not theirs or theirs == mine or theirs[0] not in backends:
            continue
        wrong.append(f"{source} -> {target}")
    assert not wrong, "base, shm and key_index serve both backends; neither uses the other:\n" + "\n".join(
        wrong
    )


def test_the_rules_see_every_floor() -> None:
    """A new subpackage must be placed in the rules (and in docs/architecture.md) to be checked."""
    floors = {_floor(_module_of(p)) for p in ROOT.rglob("*.py")} - {""}
    placed = set(LAYERS) | set(BESIDE) | set(SIDE) | SHARED
    assert floors <= placed, f"not placed in the layering: {sorted(floors - placed)}"


# The limits the code-health rounds set for product code (issue 41): past them, split by job.
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 400
PRODUCT = [
    ROOT,
    ROOT.parents[1] / "client" / "kvtag_client",
    ROOT.parents[1] / "proto" / "python" / "kvtag_proto",
]


def test_no_product_file_is_over_500_lines_and_no_class_over_400() -> None:
    wrong = []
    for package in PRODUCT:
        for path in sorted(package.rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > MAX_FILE_LINES:
                wrong.append(f"{path.relative_to(ROOT.parents[1])}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_CLASS_LINES:
                        wrong.append(f"{path.relative_to(ROOT.parents[1])}: class {node.name} {size} lines")
    assert not wrong, "\n".join(wrong)
