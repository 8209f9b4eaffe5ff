"""Rules of the project itself: the dependency rule, clause coverage, runnable docstrings."""

from __future__ import annotations

import ast
import doctest
import importlib
import sys
from pathlib import Path

import pytest
import torch

from decodespec.spec import registry

ROOT = Path(__file__).resolve().parent.parent
NAMESPACE = "decodespec"
PACKAGES = ("spec", "kernels", "reference")

# What each package may import from the project (ARCHITECTURE.md, "Dependency rule").
ALLOWED = {
    "spec": {"spec"},
    "kernels": {"kernels"},
    "reference": {"reference", "spec", "kernels"},
}
THIRD_PARTY = {
    "spec": {"torch"},
    "kernels": {"torch", "triton"},
}


def _imports(path: Path) -> list[tuple[str, int]]:
    """What a file imports, as (name, line): a project package by its folder name
    (`decodespec.spec.x` and a relative `.x` inside spec/ are both "spec"), anything
    else by its top-level module name (a bare `spec` stays "spec" too: see
    test_project_packages_are_imported_through_the_namespace)."""
    own = path.relative_to(ROOT).parts[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            modules = [own]
        elif isinstance(node, ast.ImportFrom) and node.level > 1:
            modules = [node.module or own]  # `from ..spec import x` leaves the package
        elif isinstance(node, ast.ImportFrom) and node.module == NAMESPACE:
            modules = [alias.name for alias in node.names]  # from decodespec import kernels
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == NAMESPACE and len(parts) > 1:
                parts = parts[1:]
            names.append((parts[0], node.lineno))
    return names


@pytest.mark.parametrize("package", PACKAGES)
def test_dependency_rule(package):
    project = set(PACKAGES) | {"tests", "docs"}
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if name in project and name not in ALLOWED[package]:
                violations.append(where)
            elif package in THIRD_PARTY and name not in project:
                if name not in sys.stdlib_module_names and name not in THIRD_PARTY[package]:
                    violations.append(where)
    assert not violations, "dependency rule broken:\n" + "\n".join(violations)


def _absolute_imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
    return found


@pytest.mark.parametrize("package", ["spec", "kernels", "reference"])
def test_no_import_cycles_between_modules(package):
    """Within a package, module imports form no cycle (TYPE_CHECKING ones included)."""
    folder = ROOT / package
    graph = {}
    for path in folder.glob("*.py"):
        tree = ast.parse(path.read_text())
        graph[path.stem] = {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }

    def visit(module: str, path: tuple[str, ...]) -> None:
        for imported in graph.get(module, ()):
            assert imported not in path, f"import cycle: {' -> '.join((*path, imported))}"
            visit(imported, (*path, imported))

    for module in graph:
        visit(module, (module,))


# The engine's layers (docs/engine.md, "How the engine is built"): what each module of
# reference/ may import from reference/. Control flows down only: the scheduler sees
# requests and the block manager, never the runner or the drafters; the sampler is
# called by the runner and the drafters, and calls nothing above it.
ENGINE_LAYERS = {
    "grammar": {"grammar_backends", "schema_policy", "tokenizer", "unique_keys"},
    "grammar_backends": {"tokenizer"},
    "schema_policy": set(),
    "unique_keys": set(),
    "logits_state": set(),
    "request_options": {"grammar"},
    "request": {"block_allocator", "logits_state", "request_options"},
    "block_manager": {"block_allocator", "request"},
    "sampler": {"backend", "logits_state", "request"},
    "runner": {"backend", "cache", "native_step", "request", "sampler"},  # the step it runs
    "drafters": {"backend", "cache", "logits_state", "native_step", "request", "sampler"},
    "scheduler": {"block_manager", "request"},
}


@pytest.mark.parametrize("module", sorted(ENGINE_LAYERS))
def test_engine_modules_import_only_the_layers_below(module):
    tree = ast.parse((ROOT / "reference" / f"{module}.py").read_text())
    imported = {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1
    }
    assert imported <= ENGINE_LAYERS[module], (
        f"reference/{module}.py imports {sorted(imported - ENGINE_LAYERS[module])}, "
        f"above its layer (it may import {sorted(ENGINE_LAYERS[module])})"
    )


def test_project_packages_are_imported_through_the_namespace():
    """Installed, the packages exist only as decodespec.spec, decodespec.kernels and
    decodespec.reference: a bare `import spec` works in a checkout (the repository
    root is on sys.path) and nowhere else, and would load a second copy of a module
    beside the namespaced one."""
    violations = []
    for folder in (*PACKAGES, "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, line in _absolute_imports(path):
                if module.split(".")[0] in PACKAGES:
                    violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not violations, "use decodespec.<package>:\n" + "\n".join(violations)


def test_installed_package_is_the_checkout():
    """The editable install maps decodespec.* onto the repository's folders."""
    for package in PACKAGES:
        module = importlib.import_module(f"{NAMESPACE}.{package}")
        assert Path(module.__file__).resolve() == ROOT / package / "__init__.py"


def _clause_marks() -> dict[str, list[str]]:
    """Clause id -> test files that mark it (read from the sources).

    Every `….clause(...)` call counts, as a decorator or inside
    `pytest.param(..., marks=...)`, with literal ids or `*NAME` of a
    module-level tuple of ids.
    """
    marks: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        constants = {
            target.id: [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List))
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "clause"
            ):
                continue
            for arg in node.args:
                if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
                    ids = constants.get(arg.value.id, [])
                else:
                    ids = [arg.value] if isinstance(arg, ast.Constant) else []
                for clause_id in ids:
                    marks.setdefault(clause_id, []).append(path.name)
    return marks


def test_every_clause_has_a_test():
    marks = _clause_marks()
    untested = sorted(set(registry.clauses()) - set(marks))
    assert not untested, f"clauses without a test: {untested}"


def test_every_marked_clause_exists():
    unknown = sorted(set(_clause_marks()) - set(registry.clauses()))
    assert not unknown, f"tests name clauses the spec does not state: {unknown}"


def test_every_operation_names_real_clauses():
    known = registry.clauses()
    for op in registry.OPERATIONS.values():
        assert callable(op.reference), op.name
        assert set(op.clauses) <= set(known), (op.name, set(op.clauses) - set(known))


@pytest.mark.parametrize(
    "module",
    (
        *registry.SPEC_MODULES,
        "decodespec.spec.registry",
        "decodespec.kernels.append",
        "decodespec.kernels.attention",
        "decodespec.kernels.logprobs",
        "decodespec.kernels.sampling",
        "decodespec.kernels.speculative",
        "decodespec.kernels.token_mask",
        "decodespec.kernels.quant_linear",
        "decodespec.reference.drafters",
        "decodespec.reference.native_attention",
    ),
)
def test_docstring_examples_run(module):
    result = doctest.testmod(
        importlib.import_module(module),
        extraglobs={"torch": torch},
        optionflags=doctest.NORMALIZE_WHITESPACE,
    )
    assert result.failed == 0


def test_the_kernels_check_the_sampling_arguments_as_the_spec_does():
    """kernels/ may not import spec/ (it is vendorable): it keeps a copy of the spec's
    table of ranges and of which of `sample`'s tensors are integers or per token."""
    import inspect

    from decodespec.kernels import sampling as kernels
    from decodespec.spec import sampling
    from decodespec.spec.params import RANGES

    arguments = inspect.signature(sampling.sample).parameters
    spec = {
        name: (r.low, r.high, r.low_open, r.high_open)
        for name, r in RANGES.items()
        if name in arguments
    }
    assert kernels._RANGES == spec
    assert kernels._INTEGER == sampling._INTEGER
    assert kernels._PER_TOKEN == sampling._PER_TOKEN


def test_readme_python_examples_run(capsys):
    """The README's Python examples are executed, so they cannot rot."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README has no Python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
