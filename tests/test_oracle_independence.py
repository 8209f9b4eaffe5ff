"""The test oracles share no code with what they judge.

An oracle that called `sampling_tensors` (or anything built on it: the spec's
loop, the engine) would repeat a bug in how a parameter becomes a tensor
instead of catching it. Each module listed here is read with `ast` (never
imported): it may import no module of the project under test (`decodespec`,
and the folders `spec`, `kernels`, `reference` as top-level names), no test
module that does, and may name none of the functions that turn parameters
into tensors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# oracle module -> what it computes on its own
ORACLES = {
    "tests/param_oracle.py": "every sampling parameter's effect on a row, and the choice",
    "tests/oracle.py": "the filters' kept sets in float64, with rounding margins",
    "tests/triton_philox.py": "the random numbers, from Triton's own Philox",
}
PROJECT_PACKAGES = ("decodespec", "spec", "kernels", "reference")
# The functions (and the method and tensors) that map parameters to tensors.
FORBIDDEN_NAMES = {
    "sampling_tensors",
    "SamplingTensors",
    "process_logits_args",
    "stop_ids",
    "seed_to_int64",
}


def _module_file(module: str) -> Path | None:
    """The file of a `tests.…` module, if it is one."""
    if module.split(".")[0] != "tests":
        return None
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every import in the tree, `from x import y` as x and x.y."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, node.lineno))
    return found


def violations(path: Path, seen: set[Path] | None = None) -> list[str]:
    """What ties the module at `path` (or a test module it imports) to the code under test."""
    seen = set() if seen is None else seen
    if path in seen:
        return []
    seen.add(path)
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    tree = ast.parse(path.read_text(), filename=str(path))
    problems = []
    for module, line in _imports(tree):
        if module.startswith("."):
            problems.append(f"{rel}:{line} imports {module} (relative: resolve it by name)")
        elif module.split(".")[0] in PROJECT_PACKAGES:
            problems.append(f"{rel}:{line} imports {module}, code under test")
        elif (helper := _module_file(module)) is not None:
            problems += [f"{p} (via {rel}:{line})" for p in violations(helper, seen)]
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.alias):
            name = node.asname or node.name.split(".")[-1]
        if name in FORBIDDEN_NAMES:
            problems.append(f"{rel}:{getattr(node, 'lineno', '?')} names {name}")
    return problems


@pytest.mark.parametrize("oracle", list(ORACLES))
def test_oracle_shares_no_code_with_what_it_judges(oracle):
    problems = violations(ROOT / oracle)
    assert not problems, (
        f"{oracle} ({ORACLES[oracle]}) must not use the code it judges:\n  " + "\n  ".join(problems)
    )


@pytest.mark.parametrize(
    "source",
    [
        "from decodespec.spec.params import sampling_tensors\n",
        "from decodespec.spec import params\nparams.sampling_tensors([], vocab_size=1)\n",
        "import decodespec.spec.generate\n",
        "def f(p, eos):\n    return p.stop_ids(eos)\n",
        "import importlib\nimportlib.import_module('decodespec.reference.sampler')\n",
        "from tests.spec.test_generate import slow_loop\n",
    ],
)
def test_the_check_catches_an_oracle_that_uses_the_builder(tmp_path, source):
    module = tmp_path / "leaky_oracle.py"
    module.write_text(source)
    assert violations(module), source
