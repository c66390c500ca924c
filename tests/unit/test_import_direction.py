"""Kettle's packages import downward only, and the launcher and the router never load torch.

Layers, top to bottom: the CLI; the launcher and the benchmarks; the router and the shard (which never import
each other: they talk over gRPC); models; quantization; layers; kernels; tensors (checkpoints, KV cache,
process group); then the torch-free foundations every process shares (catalog, proto, hub, grammar,
tracing, process memory); progress reporting; logging; and the settings they all read. A module may import its
own package or any package below it, at module level or inside a function alike; the launcher and the router
import nothing of the torch stack (shard to tensors).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import kettle

LAYERS = [
    {"cli"},
    {"launcher", "bench"},
    {"router", "shard"},
    {"models"},
    {"quantization"},
    {"layers"},
    {"kernels"},
    {"tensors"},
    {"catalog", "proto", "hub", "grammar", "tracing", "process_memory"},
    {"progress"},
    {"logging_setup"},
    {"", "settings"},
]
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}
# The launcher and the router stay off the torch stack entirely; the launcher builds the shards' command
# lines from their config dataclass, which is torch-free.
TORCH_FREE = {"launcher", "router"}
TORCH_STACK = {"shard", "models", "quantization", "layers", "kernels", "tensors"}
# The kernel builder compiles C through a subprocess and imports nothing of torch: the launcher builds the
# kernels while it prepares the model.
ALLOWED = {("launcher", "kettle.shard.config"), ("launcher", "kettle.kernels.build")}
ROOT = Path(kettle.__file__).parent


def package_of(module: str) -> str:
    """The package of a module: "kettle.models.llama" → "models", "kettle.cli" → "cli", "kettle" → ""."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(source: str) -> set[str]:
    """Every kettle module `source` imports, wherever the import statement is (module level or a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "kettle"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kettle":
            names = [f"{node.module}.{alias.name}" for alias in node.names] if node.module == "kettle" else []
            found |= set(names) or {node.module}
    return found


def violations(files: dict[str, str]) -> list[str]:
    """Each import that points up or sideways, as "importer → imported"; `files`: module name → source."""
    found = []
    for module, source in sorted(files.items()):
        here = package_of(module)
        for target in sorted(imported_modules(source)):
            there = package_of(target)
            if there == here or (here, target) in ALLOWED:
                continue
            if there not in RANK or RANK[there] <= RANK[here] or (here in TORCH_FREE and there in TORCH_STACK):
                found.append(f"{module} → {target}")
    return found


def kettle_sources() -> dict[str, str]:
    """Module name → source of every Python file in the package."""
    return {
        ".".join(("kettle", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__"): path.read_text()
        for path in ROOT.rglob("*.py")
    }


def test_every_package_is_in_a_layer():
    packages = {package_of(module) for module in kettle_sources()}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to LAYERS"


def test_packages_import_downward_only():
    assert violations(kettle_sources()) == []


@pytest.mark.parametrize(
    "module, source",
    [
        ("kettle.layers.linear", "from kettle.models.weights import Weights"),  # up
        ("kettle.tensors.weights", "def f():\n    from kettle.shard import distributed"),  # up, lazily
        ("kettle.router.app", "import kettle.shard.engine"),  # sideways
        ("kettle.launcher.main", "from kettle.models import registry"),  # the launcher reaching for torch
    ],
)
def test_an_upward_import_is_caught(module, source):
    assert violations({module: source}) != []


def import_cycles(files: dict[str, str]) -> list[list[str]]:
    """Groups of modules that import each other, directly or around a circle (lazy imports count too); an import
    of a package counts as an import of its `__init__`."""
    graph = {
        module: {t for t in imported_modules(source) if t in files and t != module} for module, source in files.items()
    }
    # Tarjan's strongly connected components, iteratively (a deep package would exhaust the recursion limit).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return cycles


def test_no_module_imports_itself_around_a_circle():
    assert import_cycles(kettle_sources()) == []


def test_an_import_circle_is_caught():
    files = {
        "kettle.router.a": "from kettle.router.b import f",
        "kettle.router.b": "def f():\n    import kettle.router.a",
    }
    assert import_cycles(files) == [["kettle.router.a", "kettle.router.b"]]


def test_a_downward_import_passes():
    source = "from kettle.layers.norm import RMSNorm\nfrom kettle import catalog"
    assert violations({"kettle.models.llama": source}) == []


@pytest.mark.parametrize("package", ["kettle.launcher", "kettle.router"])
def test_launcher_and_router_never_load_torch(package):
    """Importing every module of the package, in a fresh interpreter, leaves torch (and transformers) out."""
    script = (
        "import importlib, pkgutil, sys\n"
        f"import {package} as package\n"
        "for info in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "    importlib.import_module(info.name)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
