"""The spec: each stage of the decode loop as plain PyTorch that is its definition.

Modules: `softmax`, `logits`, `sampling`, `stop`; `registry` lists the
operations, their clauses and tolerance policies.
"""
