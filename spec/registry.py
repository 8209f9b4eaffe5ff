"""The registry: the spec's operations, the clauses they carry, how outputs compare.

A clause is a paragraph of a spec module's docstring that starts with its id
in brackets, for example `[SAMPLE-TOPK-2] Ties at the boundary are all
kept...`. `clauses()` collects them, so the docstrings stay the single source
of the spec's text; tests name the clauses they check with
`@pytest.mark.clause(...)`, and the conformance report and the documentation
site join the two.

An operation is a function that an implementation under test (the Triton
kernels, or another engine's module) provides with the same name and
signature as the spec's. The conformance suite is written against this table.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

import torch

# The spec's modules by their import names (`decodespec.spec.<stage>` when installed).
SPEC_MODULES = tuple(
    f"{__package__}.{stage}"
    for stage in (
        "softmax",
        "token_mask",
        "logits",
        "sampling",
        "rng",
        "params",
        "checks",
        "stop",
        "attention",
        "append",
        "quant",
        "gguf_blocks",
        "forward",
        "speculative",
        "generate",
    )
)

_CLAUSE = re.compile(r"^\[([A-Z0-9]+(?:-[A-Z0-9]+)*-\d+)\]\s+(.*)$")


@dataclass(frozen=True)
class Clause:
    """One numbered clause: its id, its text and the module that states it."""

    id: str
    text: str
    module: str


def clauses_of(module: ModuleType) -> list[Clause]:
    """The clauses stated in `module`'s docstring, in order."""
    found: list[Clause] = []
    current: tuple[str, list[str]] | None = None
    for line in [*inspect.cleandoc(module.__doc__ or "").splitlines(), ""]:
        match = _CLAUSE.match(line.strip())
        if match or not line.strip() or set(line.strip()) == {"-"}:
            if current is not None:
                found.append(Clause(current[0], " ".join(current[1]), module.__name__))
                current = None
            if match:
                current = (match.group(1), [match.group(2)])
        elif current is not None:
            current[1].append(line.strip())
    return found


def clauses() -> dict[str, Clause]:
    """Every clause of the spec, by id (ids are unique across modules)."""
    table: dict[str, Clause] = {}
    for name in SPEC_MODULES:
        for clause in clauses_of(importlib.import_module(name)):
            if clause.id in table:
                raise ValueError(f"clause {clause.id} is stated twice")
            table[clause.id] = clause
    return table


Kind = Literal["exact", "relative", "boundary"]


@dataclass(frozen=True)
class Tolerance:
    """How an implementation's output is compared with the spec's.

    The reference is always the spec evaluated in float64 on the same
    (already rounded) inputs.

    - `exact`: bit-equal (token ids, masks decided by comparisons, random bits).
    - `relative`: `‖out − ref‖ / ‖ref‖ <= rtol[input dtype]`.
    - `boundary`: discrete output (a kept set, a chosen token) equal except
      at entries whose deciding statistic lies within `margin` of its
      threshold; the tests compute that set explicitly.
    """

    kind: Kind
    rtol: dict[torch.dtype, float] = field(default_factory=dict)
    margin: float = 0.0


RELATIVE = Tolerance(
    "relative",
    rtol={torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2},
)
EXACT = Tolerance("exact")


@dataclass(frozen=True)
class Operation:
    """An operation implementations provide under the same name and signature."""

    name: str
    module: str
    clauses: tuple[str, ...]
    tolerance: Tolerance

    @property
    def reference(self) -> Callable:
        """The spec's function: the definition."""
        return getattr(importlib.import_module(self.module), self.name)


def _op(name: str, module: str, clauses: tuple[str, ...], tolerance: Tolerance) -> Operation:
    return Operation(name, f"{__package__}.{module}", clauses, tolerance)


# Margins: float32 evaluation of a sum over the vocabulary (top-p mass) or of
# z_max + ln m (min-p) differs from the float64 reference by rounding only.
# The tests scale `margin` by the statistic's magnitude and the vocabulary
# size where the bound depends on them.
OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        _op(
            "softmax",
            "softmax",
            ("SOFTMAX-STABLE-1", "SOFTMAX-INF-1", "SOFTMAX-VALID-1"),
            RELATIVE,
        ),
        _op(
            "log_softmax",
            "softmax",
            ("SOFTMAX-LOG-1", "SOFTMAX-INF-1", "SOFTMAX-VALID-1"),
            RELATIVE,
        ),
        _op("apply_temperature", "softmax", ("SOFTMAX-TEMP-1", "SOFTMAX-VALID-1"), RELATIVE),
        _op(
            "apply_token_bitmask",
            "token_mask",
            (
                "MASK-LAYOUT-1",
                "MASK-APPLY-1",
                "MASK-WIDTH-1",
                "MASK-ROWS-1",
                "MASK-EMPTY-1",
                "MASK-ORDER-1",
                "MASK-VALID-1",
            ),
            EXACT,
        ),
        _op("compute_logits", "logits", ("LOGITS-PROJ-1", "LOGITS-VALID-1"), RELATIVE),
        _op("apply_logit_bias", "logits", ("LOGITS-BIAS-1", "LOGITS-VALID-1"), RELATIVE),
        _op("apply_min_tokens", "logits", ("LOGITS-MINTOK-1", "LOGITS-VALID-1"), RELATIVE),
        _op(
            "apply_penalties",
            "logits",
            ("LOGITS-REP-1", "LOGITS-FREQ-1", "LOGITS-PRES-1", "LOGITS-VALID-1"),
            RELATIVE,
        ),
        _op("greedy", "sampling", ("SAMPLE-GREEDY-1", "SAMPLE-VALID-3"), EXACT),
        _op("top_k_mask", "sampling", ("SAMPLE-TOPK-1", "SAMPLE-TOPK-2", "SAMPLE-VALID-3"), EXACT),
        _op(
            "top_p_mask",
            "sampling",
            ("SAMPLE-TOPP-1", "SAMPLE-TOPP-2", "SAMPLE-VALID-3"),
            Tolerance("boundary", margin=2.0**-24),  # per vocabulary entry summed
        ),
        _op(
            "min_p_mask",
            "sampling",
            ("SAMPLE-MINP-1", "SAMPLE-VALID-3"),
            Tolerance("boundary", margin=2.0**-21),
        ),
        _op(
            "uniform",
            "rng",
            ("SAMPLE-RNG-1", "SAMPLE-RNG-2", "SAMPLE-RNG-3", "SAMPLE-VALID-3"),
            EXACT,
        ),
        _op(
            "sample",
            "sampling",
            (
                "SAMPLE-VALID-1",
                "SAMPLE-VALID-2",
                "SAMPLE-VALID-3",
                "SAMPLE-ORDER-1",
                "SAMPLE-CHOICE-1",
                "LOGITS-ORDER-1",
                "SAMPLE-INVARIANT-1",
            ),
            Tolerance("boundary", margin=2.0**-20),
        ),
        _op(
            "process_logits",
            "sampling",
            (
                "SAMPLE-ORDER-1",
                "SAMPLE-GREEDY-1",
                "LOGITS-ORDER-1",
                "SAMPLE-VALID-3",
                "SAMPLE-INVARIANT-1",
            ),
            Tolerance("boundary", margin=2.0**-20),
        ),
        _op(
            "compute_logprobs",
            "sampling",
            (
                "LOGPROB-RAW-1",
                "LOGPROB-RANK-1",
                "LOGPROB-TOP-1",
                "SAMPLE-VALID-3",
                "SAMPLE-INVARIANT-1",
            ),
            Tolerance(
                "boundary",
                rtol={torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3},
                margin=2.0**-20,
            ),
        ),
        _op(
            "paged_attention",
            "attention",
            (
                "ATTN-LAYOUT-1",
                "ATTN-PACK-1",
                "ATTN-CAUSAL-1",
                "ATTN-SCALE-1",
                "ATTN-GQA-1",
                "ATTN-DTYPE-1",
                "ATTN-LSE-1",
                "ATTN-EMPTY-1",
                "ATTN-BOUNDS-1",
                "ATTN-VALID-1",
                "ATTN-INVARIANT-1",
            ),
            RELATIVE,
        ),
        _op(
            "append_kv",
            "append",
            ("APPEND-SLOT-1", "APPEND-SKIP-1", "APPEND-STATE-1", "APPEND-VALID-1"),
            EXACT,
        ),
        _op(
            "verify_drafts",
            "speculative",
            (
                "VERIFY-ACCEPT-1",
                "VERIFY-RESIDUAL-1",
                "VERIFY-BONUS-1",
                "VERIFY-GREEDY-1",
                "VERIFY-OUTPUT-1",
                "VERIFY-VALID-1",
            ),
            Tolerance("boundary", margin=2.0**-20),
        ),
        _op(
            "quantized_linear",
            "quant",
            (
                "QUANT-GROUP-1",
                "QUANT-CODES-1",
                "QUANT-LINEAR-1",
                "QUANT-TOL-1",
                "QUANT-VALID-1",
            ),
            RELATIVE,
        ),
    )
}

# Optional features an implementation may declare unsupported (a module-level
# `CONFORMANCE_UNSUPPORTED = {"feature": "reason"}`): their tests skip with
# that reason instead of failing.
FEATURES: dict[str, str] = {
    "float64": "float64 inputs",
    "float16": "float16 inputs",
    "bfloat16": "bfloat16 inputs",
    "token_bitmask": "a grammar's token bitmask in sample and process_logits",
    "logit_bias": "per-row logit bias in sample",
    "min_tokens": "min_tokens masking in sample",
    "penalties": "repetition, frequency and presence penalties in sample",
    "lse": "the log-sum-exp output of paged_attention (return_lse=True)",
}
