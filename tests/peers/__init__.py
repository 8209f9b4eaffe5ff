"""Adapters that put engines nobody here wrote under the conformance suite.

Each module here is one column of the peer matrix: an implementation module
for `pytest tests/conformance --impl tests.peers.<module>`. It maps the
registry's operations (`decodespec.spec.registry.OPERATIONS`) onto the
peer's own public functions, with the spec's names and signatures. The glue
only converts layouts (dense masks to the peer's token lists, pages to the
dense K/V a peer takes); it never re-implements the peer's rule, so a test
that fails shows what the peer does.

Beside each module, `<module>.xfails` records every disagreement a run
found, one test a line:

    tests/conformance/test_x.py::test_ties  # SAMPLE-TOPK-2: keeps exactly k tokens

The reason starts with the clause the test fails on and says, in one
sentence, what the peer does instead. Tests are never loosened to make a
peer pass. What a peer lacks altogether is either missing (the module does
not define the operation) or an unsupported feature
(`CONFORMANCE_UNSUPPORTED`).

`python -m tests.peers.run` (`make peers`) runs every peer available on the
machine and writes `results/peers.json`, the matrix the site renders. Two
comparisons that are not a conformance run ride along in it: the decoding
loop next to llama.cpp's (`llama_cpp_loop.py`) and, for grammar masks, the
allowed sets of llama.cpp's grammar sampler and xgrammar and the tokens
mask-first and llama.cpp's chain-first sampling can return (`mask_order.py`).
"""
