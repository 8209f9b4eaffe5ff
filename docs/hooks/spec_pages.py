"""MkDocs hook: the site's pages that are generated from the project's sources.

- `stages/<stage>.md`, one page per stage: its spec module's docstring as
  prose, each numbered clause as a block anchored at its id in lower case (so
  `stages/sampling.md#sample-topk-1` links to SAMPLE-TOPK-1), the tests that
  mark the clause, the engines it differs from, and the reference code read
  from the module with `inspect.getsource`. A stage whose definition spans
  several modules (sampling: the stage, its random numbers, its parameters)
  shows them in that order, the stage's own definition first. The pages are
  virtual: nothing is written to docs/.
- `kernels.md`: the marker `<!-- kernels-api -->` becomes the public API of
  `kernels/`, read from the docstrings of `decodespec.kernels.__all__` with `ast` (the
  kernels are never imported, so the build needs neither a GPU nor Triton).
- `conformance.md`: the marker `<!-- conformance-matrix -->` becomes the
  clause → tests → outcome matrix of `docs/conformance-report.json`, the
  report of a real run of the conformance suite on the kernels, and
  `<!-- conformance-matrix-native -->` the same for the engine's native decode
  step (`docs/conformance-report-native.json`), limited to the clauses of the
  operations it provides.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

from decodespec.spec import registry

# MkDocs loads hooks by path: make the repository's `docs.tools` importable.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from docs.tools import peers  # noqa: E402

KERNELS_MARKER = "<!-- kernels-api -->"
MATRIX_MARKER = "<!-- conformance-matrix -->"
NATIVE_MATRIX_MARKER = "<!-- conformance-matrix-native -->"
REPORT = ROOT / "docs" / "conformance-report.json"
NATIVE_REPORT = ROOT / "docs" / "conformance-report-native.json"
SAMPLING_PICTURES = "sampling-pictures.md"
# The engines a "Differs from ..." note can name: the `engine` of the peer
# matrix's columns (results/peers.json). A clause sentence that names none of
# them is prose, not a note. llguidance is left out: the token mask's clause
# names it where it agrees (MASK-WIDTH-1), and its differences are listed in
# KNOWN_DIFFERENCES.
ENGINES = ("Hugging Face", "PyTorch", "llama.cpp", "FlashInfer", "vLLM", "xgrammar")


@dataclass(frozen=True)
class Stage:
    """A page of the spec: its file name, title and spec module, and the modules
    that complete its definition, each under its own heading (title, module)."""

    name: str
    title: str
    module: str
    parts: tuple[tuple[str, str], ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """Every spec module the page shows, in the page's order."""
        return (self.module, *(module for _, module in self.parts))


STAGES = (
    Stage("generate", "The loop", "decodespec.spec.generate"),
    Stage("forward", "Forward pass", "decodespec.spec.forward"),
    Stage(
        "quant",
        "Weight formats",
        "decodespec.spec.quant",
        parts=(("GGUF blocks", "decodespec.spec.gguf_blocks"),),
    ),
    Stage("attention", "Attention", "decodespec.spec.attention"),
    Stage("token_mask", "Token mask", "decodespec.spec.token_mask"),
    Stage("logits", "Logits", "decodespec.spec.logits"),
    Stage("softmax", "Softmax", "decodespec.spec.softmax"),
    Stage(
        "sampling",
        "Sampling",
        "decodespec.spec.sampling",
        parts=(
            ("Random numbers", "decodespec.spec.rng"),
            ("Parameters", "decodespec.spec.params"),
            ("Checking a parameter", "decodespec.spec.checks"),
        ),
    ),
    Stage("append", "Append", "decodespec.spec.append"),
    Stage("stop", "Stop", "decodespec.spec.stop"),
    Stage("speculative", "Speculative verification", "decodespec.spec.speculative"),
)

# Differences from other engines that the clause texts do not state, by
# stage: (engine, text); the text names the clauses it concerns. Each is
# checked against the peer matrix (docs/tools/peers.py).
KNOWN_DIFFERENCES: dict[str, list[tuple[str, str]]] = {
    "attention": [
        (
            "Hugging Face",
            "`eager_attention_forward` computes the scores and the probabilities in the input "
            "dtype (float16, bfloat16) before multiplying by V, and its softmax in float32 for "
            "float64 inputs (ATTN-DTYPE-1).",
        ),
        (
            "Hugging Face",
            "its attention functions check only their dense query, key and value: a NaN or "
            "infinite scale gives NaN, and mistakes surface as errors naming none of the "
            "spec's arguments (ATTN-VALID-1).",
        ),
        (
            "PyTorch",
            "SDPA and FlexAttention check only their dense query, key and value: a NaN or "
            "infinite scale gives NaN, and mistakes surface as errors naming query, key or "
            "value (ATTN-VALID-1).",
        ),
        (
            "PyTorch",
            "FlexAttention raises IndexError for a sequence without keys instead of giving "
            "zeros and a log-sum-exp of −inf (ATTN-EMPTY-1).",
        ),
    ],
    "token_mask": [
        (
            "xgrammar",
            "when a row's last bitmask word allows every token below the vocabulary size, "
            "its CPU kernel also writes −inf at that word's first disallowed bit past it: a "
            "token of the next row, or memory past the logits (MASK-APPLY-1).",
        ),
        (
            "xgrammar",
            "it checks only the bitmask's dtype (CPU kernel) and device, and otherwise fails "
            "in its C++ checks, its FFI or torch's indexing, naming no argument, or accepts "
            "what the spec refuses: a list of indices, a bitmask with no word, logits with no "
            "column, and, in its torch backend, a one-row bitmask broadcast to every row "
            "(MASK-VALID-1).",
        ),
        (
            "xgrammar",
            "its CPU kernel reads a row's bitmask words as adjacent: a column-major bitmask "
            "(a transposed view) masks the wrong tokens, while row strides (a slice of a "
            "wider buffer, one row broadcast to every row) are read right (MASK-LAYOUT-1).",
        ),
        (
            "llguidance",
            "its `apply_token_bitmask_inplace` (numpy and torch) takes no indices: it masks "
            "every row of the logits it is given (MASK-ROWS-1).",
        ),
        (
            "llguidance",
            "it checks its arguments with `assert` (AssertionError naming no argument), "
            "treats 1-D logits as a batch of one, and accepts logits with no column and a "
            "bitmask with no word (MASK-VALID-1).",
        ),
    ],
    "logits": [
        (
            "Hugging Face",
            "`generate` has a repetition penalty but no frequency or presence penalty "
            "(LOGITS-FREQ-1, LOGITS-PRES-1).",
        ),
        (
            "Hugging Face",
            "`MinNewTokensLengthLogitsProcessor` assigns −inf to the stop ids instead of "
            "adding it, so a NaN logit becomes −inf and the invalid row goes unnoticed "
            "(LOGITS-MINTOK-1).",
        ),
        (
            "llama.cpp",
            "its penalties sampler counts every token accepted into its window, the prompt's "
            "included, so the frequency and presence penalties also hit tokens seen only in "
            "the prompt (LOGITS-FREQ-1, LOGITS-PRES-1).",
        ),
        (
            "Hugging Face",
            "its processors assume tensors: a Python number or a list where a tensor belongs "
            "fails with an AttributeError naming no argument (LOGITS-VALID-1).",
        ),
        (
            "llama.cpp",
            "its samplers take C arrays, so a Python number or a list where a tensor belongs "
            "fails before llama.cpp sees it, naming no argument (LOGITS-VALID-1).",
        ),
    ],
    "softmax": [
        (
            "Hugging Face",
            "`TemperatureLogitsWarper` divides the logits without subtracting the row's "
            "maximum: the same distribution, other values, and a tiny temperature overflows "
            "the maximum to inf (SOFTMAX-TEMP-1).",
        ),
        (
            "llama.cpp",
            "its temperature sampler divides without subtracting the maximum, and at "
            "temperature 0 keeps the first maximum alone, every other token at −inf "
            "(SOFTMAX-TEMP-1).",
        ),
        (
            "Hugging Face",
            "`TemperatureLogitsWarper` assumes a tensor (a number or a list fails with an "
            "AttributeError naming no argument) and divides logits with no column without "
            "error, returning an empty row (SOFTMAX-VALID-1).",
        ),
        (
            "llama.cpp",
            "its temperature sampler takes a C array: a number or a list fails before it, "
            "naming no argument, and an empty candidate array aborts the process "
            "(`GGML_ASSERT(cur_p->size > 0)`), so it is never called on one (SOFTMAX-VALID-1).",
        ),
    ],
    "sampling": [
        (
            "llama.cpp",
            "its default sampler chain applies the temperature after top-k, top-p and "
            "min-p; here the filters see the scaled logits (SAMPLE-ORDER-1), so its min-p "
            "threshold is on the unscaled logits (SAMPLE-MINP-1).",
        ),
        (
            "llama.cpp",
            "which of several tokens tied at the k-th value its top-k keeps depends on their "
            "order in the vocabulary (SAMPLE-TOPK-1).",
        ),
        (
            "llama.cpp",
            "a greedy row's processed logits keep only the first maximum, not the whole "
            "processed row (SAMPLE-GREEDY-1); the token is the same.",
        ),
        (
            "Hugging Face",
            "`TopPLogitsWarper` cuts a sorted list, so of several tied maximum tokens it can "
            "keep one, which SAMPLE-ORDER-1 forbids.",
        ),
        (
            "Hugging Face",
            "`generate`'s warpers assume tensors (a number or a list fails with an "
            "AttributeError naming no argument), and over logits with no column its argmax "
            "and top-k/min-p warpers raise IndexError while top-p returns an empty row "
            "(SAMPLE-VALID-3).",
        ),
        (
            "llama.cpp",
            "its samplers take C arrays, so a number or a list where a tensor belongs fails "
            "before llama.cpp sees it, naming no argument, and an empty candidate array "
            "aborts the process (SAMPLE-VALID-3).",
        ),
    ],
}


def peer_notes(stage: Stage | None = None) -> list[peers.Note]:
    """The "Differs from" notes of one stage's page (of every page if None).

    A clause's sentence "Differs from ..." is a note for each engine of
    ENGINES it names; so is each entry of KNOWN_DIFFERENCES, for the
    clauses its text names.
    """
    notes = []
    for each in STAGES if stage is None else (stage,):
        clauses = [
            clause
            for module in each.modules
            for clause in registry.clauses_of(importlib.import_module(module))
        ]
        for clause in clauses:
            _, found, rest = clause.text.partition("Differs from")
            for engine in ENGINES if found else ():
                if engine in rest:
                    notes.append(peers.Note(engine, (clause.id,), f"Differs from{rest}"))
        for engine, text in KNOWN_DIFFERENCES.get(each.name, []):
            clauses = tuple(dict.fromkeys(peers.CLAUSE_ID.findall(text)))
            notes.append(peers.Note(engine, clauses, text))
    return notes


_CLAUSE_START = re.compile(r"^\[([A-Z0-9]+(?:-[A-Z0-9]+)*-\d+)\]\s")
_SECTION = re.compile(r"^(Args|Returns|Raises|Example|Examples):$")


# --- tests that mark each clause -------------------------------------------------------------


def _clause_ids(call: ast.Call, constants: dict[str, list[str]]) -> list[str]:
    """The clause ids named by one `….clause(...)` call: literals and `*NAME` tuples."""
    ids: list[str] = []
    for arg in call.args:
        if isinstance(arg, ast.Starred) and isinstance(arg.value, ast.Name):
            ids += constants.get(arg.value.id, [])
        elif isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            ids.append(arg.value)
    return ids


def _tuple_constants(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level `NAME = (...)` tuples and lists of string constants."""
    return {
        target.id: [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List))
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def _is_clause_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "clause"
    )


def clause_tests() -> dict[str, list[str]]:
    """Clause id -> `tests/path.py::test_name` of the tests that mark it.

    Read from the sources as tests/test_project.py does: a test marks a
    clause with a `clause(...)` decorator, or inside the `pytest.param(...,
    marks=...)` of one of its decorators.
    """
    tests: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        constants = _tuple_constants(tree)
        for function in tree.body:
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            test_id = f"{path.relative_to(ROOT).as_posix()}::{function.name}"
            for decorator in function.decorator_list:
                for node in ast.walk(decorator):
                    if _is_clause_call(node):
                        for clause_id in _clause_ids(node, constants):
                            tests.setdefault(clause_id, [])
                            if test_id not in tests[clause_id]:
                                tests[clause_id].append(test_id)
    return tests


# --- stage pages -----------------------------------------------------------------------------


def clause_anchor(clause_id: str) -> str:
    """The HTML id of a clause's block: its id in lower case."""
    return clause_id.lower()


def _clause_block(clause: registry.Clause, tests: list[str]) -> str:
    """A clause as an anchored block with a self link and the tests that enforce it."""
    anchor = clause_anchor(clause.id)
    enforced = ", ".join(f"`{test}`" for test in tests) or "*no test marks this clause*"
    return (
        f'<div class="clause" id="{anchor}" markdown>\n\n'
        f"[**{clause.id}**](#{anchor}) {clause.text}\n\n"
        f"*Enforced by:* {enforced}\n\n"
        "</div>\n"
    )


def _prose_with_clauses(module: ModuleType, tests: dict[str, list[str]]) -> str:
    """The module docstring after its first line, each clause replaced by its block.

    A clause's paragraph ends where `registry.clauses_of` ends it: at a blank
    line, a line of dashes or the next clause.
    """
    by_id = {clause.id: clause for clause in registry.clauses_of(module)}
    lines = inspect.cleandoc(module.__doc__ or "").splitlines()[1:]
    out: list[str] = []
    in_clause = False
    for line in lines:
        start = _CLAUSE_START.match(line.strip())
        if start:
            out += ["", _clause_block(by_id[start.group(1)], tests.get(start.group(1), []))]
            in_clause = True
        elif in_clause and line.strip() and set(line.strip()) != {"-"}:
            continue
        else:
            in_clause = False
            out.append(line)
    return "\n".join(out)


def _differences_admonition(stage: Stage, matrix: dict | None) -> str:
    """The stage's notes, each with what the peer matrix's runs say of it."""
    items = []
    for note in peer_notes(stage):
        links = ", ".join(f"[{c}](#{clause_anchor(c)})" for c in note.clauses)
        line = f"- **{note.engine}** ({links}): {note.text}"
        if matrix is not None:
            verdict, runs = peers.note_check(note, matrix)
            seen = {"confirmed": "seen in the peer runs", "unchecked": "not run on this machine"}
            line += f" *({seen.get(verdict, verdict)}: {runs})*"
        items.append(line)
    if not items:
        body = "No difference from Hugging Face, vLLM, FlashInfer or llama.cpp is recorded yet."
        return f'!!! note "Differs from"\n\n    {body}\n'
    indented = "\n".join(f"    {item}" for item in items)
    return f'!!! note "Differs from"\n\n{indented}\n'


def _public_definitions(module: ModuleType) -> list[tuple[str, object]]:
    """The module's own public functions and classes, in source order."""
    own = [
        (name, value)
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]
    return sorted(own, key=lambda item: inspect.getsourcelines(item[1])[1])


def _reference_code(module: ModuleType, level: str = "###") -> str:
    """Every public definition's source, in python code blocks under `level` headings."""
    sections = []
    for name, value in _public_definitions(module):
        source = inspect.getsource(value).rstrip()
        sections.append(f"{level} `{name}`\n\n```python\n{source}\n```\n")
    return "\n".join(sections)


def _source_path(module_name: str) -> str:
    """`decodespec.spec.rng` -> `spec/rng.py`, the file in the repository."""
    return module_name.removeprefix("decodespec.").replace(".", "/") + ".py"


def _summary(module: ModuleType) -> str:
    return inspect.cleandoc(module.__doc__ or "").splitlines()[0]


def stage_page(stage: Stage, tests: dict[str, list[str]], docs_dir: Path) -> str:
    """The markdown of one stage's page: its module's prose, then each part's."""
    module = importlib.import_module(stage.module)
    sources = ", ".join(f"`{_source_path(name)}`" for name in stage.modules)
    parts = [f"# {stage.title}\n", f"{_summary(module)} Source: {sources}.\n"]
    if stage.name == "sampling" and (docs_dir / SAMPLING_PICTURES).exists():
        parts.append(f"The filters in pictures: [sampling pictures](../{SAMPLING_PICTURES}).\n")
    parts.append(_prose_with_clauses(module, tests))
    for title, name in stage.parts:
        part = importlib.import_module(name)
        parts += [f"\n## {title}\n", f"{_summary(part)} Source: `{_source_path(name)}`.\n"]
        parts.append(_prose_with_clauses(part, tests))
    parts += [
        "\n## Differences from other engines\n",
        _differences_admonition(stage, peers.load() if peers.MATRIX.exists() else None),
        "\n## Reference code\n",
        f"Read from the module{'s' if stage.parts else ''} when the site is built: "
        "this *is* the definition.\n",
    ]
    if not stage.parts:
        parts.append(_reference_code(module))
    for name in stage.modules if stage.parts else ():
        parts.append(f"### `{_source_path(name)}`\n")
        parts.append(_reference_code(importlib.import_module(name), level="####"))
    return "\n".join(parts)


# --- kernels API -----------------------------------------------------------------------------


def _kernels_all() -> list[str]:
    """The names of `decodespec.kernels.__all__`, read from kernels/__init__.py."""
    tree = ast.parse((ROOT / "kernels" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise ValueError("kernels/__init__.py defines no __all__")


def _kernel_definitions() -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """Top-level public functions and classes of kernels/*.py, by name."""
    found: dict[str, ast.FunctionDef | ast.ClassDef] = {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                found[node.name] = node
    return found


def _signature(node: ast.FunctionDef | ast.ClassDef) -> str:
    """`def name(args) -> returns` or `class name(bases)`, as written in the source."""
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(base) for base in node.bases)
        return f"class {node.name}({bases})" if bases else f"class {node.name}"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"def {node.name}({ast.unparse(node.args)}){returns}"


def _section_markdown(title: str, body: list[str]) -> str:
    """One Google-style docstring section (Args, Returns, Raises, Example) as markdown."""
    text = inspect.cleandoc("\n".join(body))
    if title in ("Args", "Raises"):
        entries = re.split(r"\n(?=\S)", text)
        items = []
        for entry in entries:
            name, _, description = entry.partition(":")
            items.append(f"- `{name.strip()}`: {' '.join(description.split())}")
        return f"**{title}**\n\n" + "\n".join(items)
    if title.startswith("Example"):
        return f"**{title}**\n\n" + _example_markdown(text)
    return f"**{title}**: {text}"


def _example_markdown(text: str) -> str:
    """Doctest lines as a `pycon` block, the prose around them as paragraphs."""
    blocks = []
    for paragraph in text.split("\n\n"):
        if paragraph.lstrip().startswith(">>>"):
            blocks.append(f"```pycon\n{paragraph}\n```")
        else:
            blocks.append(paragraph)
    return "\n\n".join(blocks)


def docstring_markdown(docstring: str) -> str:
    """A Google-style docstring as markdown: description, then its sections."""
    description: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in docstring.splitlines():
        heading = _SECTION.match(line)
        if heading:
            sections.append((heading.group(1), []))
        elif sections:
            sections[-1][1].append(line)
        else:
            description.append(line)
    parts = ["\n".join(description).strip()]
    parts += [_section_markdown(title, body) for title, body in sections]
    return "\n\n".join(parts)


def kernels_api() -> str:
    """The public API of `kernels/`: one section per name of `decodespec.kernels.__all__`."""
    definitions = _kernel_definitions()
    sections = []
    for name in _kernels_all():
        node = definitions[name]
        sections.append(
            f"### `{name}`\n\n```python\n{_signature(node)}\n```\n\n"
            f"{docstring_markdown(ast.get_docstring(node) or '')}\n"
        )
    return "\n".join(sections)


# --- conformance matrix ----------------------------------------------------------------------


def _test_function(nodeid: str) -> str:
    """A test's node id without its parameters."""
    return nodeid.split("[", 1)[0]


def _outcome_summary(outcomes: list[str]) -> str:
    """How many runs had each outcome, as in "3 passed, 1 skipped"."""
    return ", ".join(f"{count} {outcome}" for outcome, count in sorted(Counter(outcomes).items()))


def _matrix_row(clause_id: str, entry: dict, stage_of: dict[str, str]) -> str:
    """One row of the matrix: the clause, its test functions and their outcomes."""
    by_function: dict[str, list[str]] = {}
    for test in entry["tests"]:
        by_function.setdefault(_test_function(test["nodeid"]), []).append(test["outcome"])
    cells = [f"`{name}`: {_outcome_summary(outcomes)}" for name, outcomes in by_function.items()]
    link = f"[{clause_id}](stages/{stage_of[entry['module']]}.md#{clause_anchor(clause_id)})"
    boundaries = ", ".join(entry.get("boundaries", [])) or "none"
    return f"| {link} | {'<br>'.join(cells) or 'none in tests/conformance'} | {boundaries} |"


def provided_clauses(report: dict) -> list[str] | None:
    """The clauses of the operations a report's implementation provides, or None for
    all of them: an implementation named explicitly skips the others' tests ("does
    not provide operation"), and their rows would say nothing about it."""
    missing = set(report["missing_operations"]) - set(report["self_checked_operations"])
    if not missing:
        return None
    provided = [op for name, op in registry.OPERATIONS.items() if name not in missing]
    return [c for c in report["clauses"] if any(c in op.clauses for op in provided)]


def conformance_matrix(report_path: Path = REPORT) -> str:
    """The clause → tests → outcome matrix of a conformance report, or why there is none."""
    if not report_path.exists():
        return (
            '!!! warning "No report yet"\n\n'
            f"    `docs/{report_path.name}` is missing: run `make docs-report` "
            "to produce it.\n"
        )
    report = json.loads(report_path.read_text())
    impl = report["implementation"]
    platform = report["platform"]
    shown = provided_clauses(report)
    clauses = {c: e for c, e in report["clauses"].items() if shown is None or c in shown}
    outcomes = {t["nodeid"]: t["outcome"] for c in clauses.values() for t in c["tests"]}
    stage_of = {module: stage.name for stage in STAGES for module in stage.modules}
    header = [
        f"Implementation **{impl['name']}** {impl['version']}, run on {report['date']} "
        f"(Python {platform['python']}, torch {platform['torch']}, {platform['device']}); "
        f"pytest exit status {report['exit_status']}.",
        "",
        f"Tests marking a clause: {_outcome_summary(list(outcomes.values()))}.",
        "",
    ]
    if shown is not None:
        provided = [n for n in registry.OPERATIONS if n not in report["missing_operations"]]
        names = ", ".join(f"`{n}`" for n in provided)
        header += [
            f"Operations it provides: {names}; the clauses of the others are left out.",
            "",
        ]
    if report["self_checked_operations"]:
        names = ", ".join(f"`{name}`" for name in report["self_checked_operations"])
        header += [f"Operations the implementation lacks, run as a spec self-check: {names}.", ""]
    by_reason: dict[str, list[str]] = {}
    for feature, reason in report.get("unsupported_features", {}).items():
        by_reason.setdefault(reason, []).append(f"`{feature}`")
    for reason, features in by_reason.items():
        header += [f"Unsupported features (their tests skip): {', '.join(features)}: {reason}.", ""]
    families = report.get("boundary_families", {})
    if families:
        header += [
            "Boundary families (the last column: which of them a clause's tests draw; "
            "`tests/strategies.py`):",
            "",
            *[f"- **{name}**: {what}" for name, what in families.items()],
            "",
        ]
    rows = [_matrix_row(clause_id, entry, stage_of) for clause_id, entry in clauses.items()]
    table_head = ["| Clause | Tests: outcomes | Boundaries drawn |", "| --- | --- | --- |"]
    return "\n".join([*header, *table_head, *rows]) + "\n"


# --- MkDocs events ---------------------------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated stage pages to the site."""
    tests = clause_tests()
    docs_dir = Path(config.docs_dir)
    for stage in STAGES:
        content = stage_page(stage, tests, docs_dir)
        files.append(File.generated(config, f"stages/{stage.name}.md", content=content))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the markers of kernels.md and conformance.md."""
    if page.file.src_uri == "kernels.md":
        return markdown.replace(KERNELS_MARKER, kernels_api())
    if page.file.src_uri == "conformance.md":
        return markdown.replace(MATRIX_MARKER, conformance_matrix()).replace(
            NATIVE_MATRIX_MARKER, conformance_matrix(NATIVE_REPORT)
        )
    return markdown
