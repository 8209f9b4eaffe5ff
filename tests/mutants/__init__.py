"""Implementations for testing the suite itself.

Each module but one breaks one clause on purpose: `tests/test_mutants.py` runs
the conformance suite against each (`--impl tests.mutants.<name>`) and requires
the tests of that clause to fail, which shows those tests can fail.
The boundary mutants break a clause only where a boundary family of
`tests/strategies.py` reaches (ties across vocabulary chunks, exact thresholds,
many KV tiles); the clean-failure mutants must fail assertions, never crash.
`partial_bfloat16_unsupported` is correct but partial: `tests/test_harness.py`
uses it to check how missing operations and unsupported features are reported.
"""
