"""The model runner and the drafters: a pass is a function of its inputs.

The runner and the drafters read requests and write only the KV cache; what
they computed (tokens, the positions now cached, a draft model's cache
positions, prompt scores) comes back in `PassOutcome` and `Draft`, and only
the scheduler and the block manager change a `Request` (issue 39). So a
failed pass needs no undo: its outcome is dropped.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

from decodespec.reference.engine import Engine
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.params import SamplingParams
from tests.engine.test_speculative_engine import DRAFTERS, drafter_name, make_engine
from tests.engine.toy import ByteTokenizer, random_weights, small_config

REFERENCE = Path(__file__).resolve().parents[2] / "reference"
# Modules that compute a pass; they may change only their own objects (`self.x = ...`).
PASS_MODULES = ("runner.py", "drafters.py", "sampler.py")


PLAIN = (int, float, str, bool, list, tuple, type(None))


def snapshot(requests) -> list[dict]:
    """Each request's attributes: plain values copied, objects by identity, and the
    tokens its stop stage holds."""
    return [
        {
            **{
                name: copy.copy(value) if isinstance(value, PLAIN) else id(value)
                for name, value in vars(r).items()
            },
            "stop_checker.token_ids": list(r.stop_checker.token_ids),
            "stop_checker.text": r.stop_checker.text,
        }
        for r in requests
    ]


def watch(engine: Engine, changed: list[str]) -> None:
    """Wrap the runner's `run` and the drafter's `propose` so that any change they make
    to a request is recorded in `changed`."""

    def guarded(function, name):
        def call(batch, *args, **kwargs):
            before = snapshot(batch)
            result = function(batch, *args, **kwargs)
            for r, old, new in zip(batch, before, snapshot(batch), strict=True):
                changed.extend(
                    f"{name} changed request {r.id}'s {key}: {old[key]!r} -> {new[key]!r}"
                    for key in old
                    if old[key] != new[key]
                )
            return result

        return call

    engine.runner.run = guarded(engine.runner.run, "runner.run")
    if engine.drafter is not None:
        engine.drafter.propose = guarded(engine.drafter.propose, "drafter.propose")


@pytest.mark.parametrize("drafter", [None, *DRAFTERS])
def test_a_pass_changes_no_request(drafter):
    weights = random_weights(small_config(num_layers=2), seed=3)
    if drafter is None:
        engine = Engine(weights, ByteTokenizer())
    else:
        engine = make_engine(weights, ByteTokenizer(), drafter_name(drafter, weights), num_draft=3)
    changed: list[str] = []
    watch(engine, changed)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    engine.add_request(list(b"abcabcabc abc"), params, RequestOptions(prompt_logprobs=2))
    engine.add_request(list(b"xyz xyz"), params)
    passes = 0
    while engine.has_unfinished():
        engine.step()
        passes += 1
    assert passes > 1
    assert not changed, "\n".join(changed[:10])
    assert all(r.finish_reason == "length" for r in engine.requests.values())


def test_a_failed_pass_changes_no_request(monkeypatch):
    """A pass that raises for the batch is re-run request by request; the request whose
    pass fails alone finishes with "error", the other goes on as if alone."""
    weights = random_weights(small_config(num_layers=2), seed=3)
    engine = Engine(weights, ByteTokenizer())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    good = engine.add_request(list(b"good"), params)
    bad = engine.add_request(list(b"bad"), params)
    engine.step()  # both prefilled
    run = engine.runner.run

    def failing(batch, *args, **kwargs):
        if any(r.id == bad for r in batch):
            raise RuntimeError("this request's pass fails")
        return run(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", failing)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(bad).finish_reason == "error"
    assert "this request's pass fails" in engine.output(bad).error
    alone = Engine(weights, ByteTokenizer())
    alone_id = alone.add_request(list(b"good"), params)
    while alone.has_unfinished():
        alone.step()
    assert engine.output(good).token_ids == alone.output(alone_id).token_ids


@pytest.mark.parametrize("module", PASS_MODULES)
def test_pass_modules_assign_no_attribute_but_their_own(module):
    """No `x.attr = ...`, `x.attr += ...` or `del x.attr[...]` with x other than `self` in
    the modules that compute a pass: a request's state has one writer, the scheduler."""
    tree = ast.parse((REFERENCE / module).read_text())
    offences = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                while isinstance(target, ast.Subscript):
                    target = target.value
                if not isinstance(target, ast.Attribute):
                    continue
                owner = target.value
                if not (isinstance(owner, ast.Name) and owner.id == "self"):
                    offences.append(f"{module}:{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    assert not offences, "a pass module changes an object it does not own:\n" + "\n".join(offences)
