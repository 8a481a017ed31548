"""The package's import graph: dependencies point down the request's flow.

    cli -> plan, bench -> server, llm -> engine -> executor -> worker -> models -> layers -> base

(base: the top-level modules config, errors, sampling_params, outputs, platform, hardware.) A module
may import its own package and the levels below it, never above. The one boundary type a runner
reads from above is engine/scheduler_output.py. Imports under `if TYPE_CHECKING:` (annotations
only, no run-time dependency) may name only that boundary type when they point up.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parent
LEVELS = {
    "base": 0, "layers": 1, "models": 2, "worker": 3, "executor": 4, "engine": 5,
    "server": 6, "llm": 6, "__init__": 7, "plan": 8, "bench": 8, "cli": 9,
}
BASE_MODULES = {"config", "errors", "sampling_params", "outputs", "platform", "hardware", "version"}
BOUNDARY = "tokenmill.engine.scheduler_output"
MAY_READ_BOUNDARY = {"worker", "executor"}


def _package(module: str) -> str:
    """tokenmill.engine.scheduler -> engine; tokenmill.config -> base; tokenmill -> __init__."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return "base" if parts[1] in BASE_MODULES else parts[1]


def _module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str):
    """(imported tokenmill module, line, annotation-only) for every import in the tree."""
    type_only_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.body:
                type_only_lines.update(n.lineno for n in ast.walk(child) if hasattr(n, "lineno"))
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative import: resolve against this module's package
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            # `from tokenmill import hardware` imports the module tokenmill.hardware
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
        for name in names:
            if name == "tokenmill" or name.startswith("tokenmill."):
                yield name, node.lineno, node.lineno in type_only_lines


def _graph():
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        yield path, module, tree, list(_imports(tree, module))


def test_every_package_has_a_level():
    packages = {_package(module) for _, module, _, _ in _graph()}
    assert packages <= set(LEVELS), packages - set(LEVELS)


def test_imports_point_down():
    violations = []
    for path, module, _, imports in _graph():
        source = _package(module)
        for target_module, line, _ in imports:
            target = _package(target_module)
            if target == source or LEVELS[target] < LEVELS[source]:
                continue
            if target_module == BOUNDARY and source in MAY_READ_BOUNDARY:
                continue
            violations.append(f"{path.relative_to(ROOT)}:{line} {source} -> {target_module}")
    assert not violations, "\n".join(violations)


def test_the_rules_the_issue_names():
    lower = {"models", "layers", "worker"}
    upper_for_lower = {"engine", "server", "plan", "bench"}
    for path, module, _, imports in _graph():
        source = _package(module)
        for target_module, line, _ in imports:
            target = _package(target_module)
            where = f"{path.relative_to(ROOT)}:{line} imports {target_module}"
            if source in lower and target in upper_for_lower:
                assert target_module == BOUNDARY and source == "worker", where
            assert not (source == "layers" and target == "models"), where
            assert not (source == "engine" and target in {"server", "plan", "bench"}), where
            # the engine says what to compute and sample; building the sampler's and kernels' inputs is the runner's
            assert not (source == "engine" and target in {"worker", "layers"}), where


def test_no_two_packages_import_each_other():
    edges: set[tuple[str, str]] = set()
    for _, module, _, imports in _graph():
        source = _package(module)
        for target_module, _, type_only in imports:
            target = _package(target_module)
            if target != source and not type_only:
                edges.add((source, target))
    mutual = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    assert not mutual, mutual


def test_no_module_flips_the_onednn_switch():
    for path, _, tree, _ in _graph():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                if isinstance(target, ast.Attribute) and ast.unparse(target).endswith("backends.mkldnn.enabled"):
                    raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} sets torch.backends.mkldnn.enabled")
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("backends.mkldnn.flags"):
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} uses torch.backends.mkldnn.flags")
