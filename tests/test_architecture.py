"""The package's dependency rules (docs/architecture.md): who may import whom, and no circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the agentrl module prefix it installs as
SOURCES = {
    ROOT / "agentrl": "agentrl",
    ROOT / "envs": "agentrl.envs",
    ROOT / "verifiers": "agentrl.verifiers",
}

FORBIDDEN = {
    "agentrl.rollout": ["agentrl.learner", "agentrl.kernels", "agentrl.loop"],
    "agentrl.inference": ["agentrl.rollout", "agentrl.learner", "agentrl.loop"],
    "agentrl.learner": ["agentrl.rollout", "agentrl.inference", "agentrl.loop"],
    "agentrl.kernels": [
        "agentrl.rollout", "agentrl.inference", "agentrl.learner", "agentrl.loop",
        "agentrl.report", "agentrl.envs", "agentrl.verifiers",
    ],
    "agentrl.report": ["agentrl.rollout", "agentrl.inference", "agentrl.learner", "agentrl.loop"],
    "agentrl.envs": ["agentrl.learner", "agentrl.loop", "agentrl.kernels"],
    "agentrl.verifiers": ["agentrl.learner", "agentrl.loop", "agentrl.rollout", "agentrl.kernels"],
    # agentrl.inference by side: the client talks to any SGLang server, the engine serves whoever
    # asks, the server hosts the engine (only through its package: test_server_hosts_the_engine_...)
    "agentrl.inference.client": ["agentrl.inference.engine", "agentrl.inference.server"],
    "agentrl.inference.engine": ["agentrl.inference.client", "agentrl.inference.server"],
    "agentrl.inference.server": ["agentrl.inference.client"],
}
INFERENCE_SIDES = (
    "agentrl.inference.client", "agentrl.inference.engine", "agentrl.inference.server",
)


def _modules() -> dict[str, Path]:
    out = {}
    for folder, prefix in SOURCES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([prefix, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every agentrl module ``name`` imports, at any depth of the file (lazy imports too)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base])
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_layout_is_there() -> None:
    for pkg in ("rollout", "inference", "learner", "kernels", "loop", "report"):
        assert f"agentrl.{pkg}" in MODULES, pkg
        doc = ast.get_docstring(ast.parse(MODULES[f"agentrl.{pkg}"].read_text()))
        assert doc and "never import" in doc, f"agentrl.{pkg} must say what it never imports"


@pytest.mark.parametrize("side", INFERENCE_SIDES)
def test_each_inference_side_says_what_it_never_imports(side: str) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[side].read_text()))
    assert doc and "never import" in doc, f"{side} must say what it never imports"


def test_server_hosts_the_engine_through_its_package_alone() -> None:
    # agentrl.inference.engine (LocalEngine, PAUSE_MODES, PauseMode) is the one interface
    engine = "agentrl.inference.engine"
    bad = [
        (name, dep)
        for name, deps in GRAPH.items()
        if name.startswith("agentrl.inference.server.")
        for dep in deps
        if dep.startswith(engine + ".")
    ]
    assert not bad, bad


def test_shared_inference_modules_import_no_side() -> None:
    # base, sglang_api, routing_records, api_keys, weight_group, weight_ipc: what the sides share
    shared = [
        n for n in GRAPH
        if n.startswith("agentrl.inference.") and n.count(".") == 2 and n not in INFERENCE_SIDES
    ]
    assert "agentrl.inference.base" in shared and "agentrl.inference.sglang_api" in shared
    bad = [
        (name, dep)
        for name in shared + ["agentrl.inference"]
        for dep in GRAPH[name]
        if any(dep == side or dep.startswith(side + ".") for side in INFERENCE_SIDES)
    ]
    assert not bad, bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_what_it_must_not(package: str) -> None:
    bad = [
        (name, dep)
        for name, deps in GRAPH.items()
        if name == package or name.startswith(package + ".")
        for dep in deps
        for forbidden in FORBIDDEN[package]
        if dep == forbidden or dep.startswith(forbidden + ".")
    ]
    assert not bad, bad


def test_no_import_circle() -> None:
    # a module importing its own package's __init__ (which re-exports it) is not a circle
    def edges(name: str) -> set[str]:
        return {d for d in GRAPH[name] if not name.startswith(d + ".")}

    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        path.append(n)
        for d in edges(n):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[n] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_no_module_over_500_lines_outside_the_triton_kernels() -> None:
    # the Triton kernels and their launch code (autotune tables, the custom op)
    kernels = {"agentrl.kernels._attention_kernels", "agentrl.kernels.attention"}
    long = {n: len(p.read_text().splitlines()) for n, p in MODULES.items() if n not in kernels}
    assert {n: k for n, k in long.items() if k > 500} == {}
