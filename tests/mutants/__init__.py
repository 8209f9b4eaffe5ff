"""Deliberately wrong implementations: each module breaks one clause.

`tests/test_mutants.py` runs the conformance suite against each of them
(`--impl tests.mutants.<name>`) and requires the tests of that clause to fail,
which shows that those tests can fail.
"""
