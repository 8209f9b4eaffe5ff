"""Verification that rolls back one token too many when every draft is accepted:
the bonus token is left at −1 and `num_accepted` still counts it. Breaks
VERIFY-OUTPUT-1; a suite that fed such tokens straight to `bincount` would crash
on the −1 instead of failing an assertion (the clean-failures family)."""

from decodespec.spec.speculative import Verification
from decodespec.spec.speculative import verify_drafts as spec_verify_drafts


def verify_drafts(*args, **kwargs) -> Verification:
    out = spec_verify_drafts(*args, **kwargs)
    num_draft = kwargs["num_draft"] if "num_draft" in kwargs else args[3]
    everything = out.num_accepted == num_draft.to(out.num_accepted.device)
    rows = everything.nonzero().flatten()
    tokens = out.tokens.clone()
    tokens[rows, num_draft[rows].long()] = -1
    return Verification(tokens, out.num_accepted)
