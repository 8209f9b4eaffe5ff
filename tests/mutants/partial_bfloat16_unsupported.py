"""A correct partial implementation: only `softmax`, without bfloat16 support."""

from decodespec.spec.softmax import softmax

CONFORMANCE_UNSUPPORTED = {"bfloat16": "this implementation has no bfloat16 path"}

__all__ = ["softmax"]
