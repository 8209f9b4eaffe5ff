"""The spec: each stage of the decode loop as plain PyTorch that is its definition.

Modules: `forward`, `attention`, `append`, `token_mask`, `logits`, `softmax`,
`sampling`, `stop`, `speculative`, and `generate`, the loop that composes
them for one request; `registry` lists the operations, their clauses and tolerance
policies.
"""
