"""Mask first (the spec, vLLM) or chain first (llama.cpp): which tokens can come out.

MASK-ORDER-1 puts the grammar's mask before every filter: the filters
choose among allowed tokens. llama.cpp's common sampler
(common/sampling.cpp, `common_sampler_sample`) runs its chain (top-k, top-p,
min-p, temperature, dist) on the unmasked logits first, then checks the
sampled token with the grammar sampler; only a rejected token makes it
start again from the logits with the grammar applied first and the chain
after it. The tokens llama.cpp can return are therefore

    (K_raw ∩ A) ∪ (K_masked if K_raw holds a token the grammar rejects)

where A is the grammar's allowed set, K_raw the chain's kept set on the
raw logits and K_masked its kept set on the masked ones; the spec's are
its own filters' kept set on the masked logits.

`compare()` computes both on the bundled SmolLM2's vocabulary (49152
tokens) with real grammars, and reports:

1. Allowed sets: along a valid text of each grammar (tokenized by
   llama.cpp), at every state, llama.cpp's grammar sampler
   (`llama_sampler_init_grammar` from GBNF, advanced with
   `llama_sampler_accept`, applied to every token) and xgrammar's bitmask
   (`GrammarMatcher.fill_next_token_bitmask` of the same grammar compiled
   as EBNF, with a `TokenizerInfo` of the model's raw token bytes; control
   tokens as b"", llama.cpp's end-of-generation tokens as its stop tokens).
2. Kept sets, temperature 1 (so that the two orders of the temperature
   and the filters, a difference of their own, play no part): the spec's
   `apply_token_bitmask` of xgrammar's bitmask then `process_logits`,
   against llama.cpp's chain (`tests.peers.llama_cpp_ops.process_logits`)
   on the raw logits, its grammar sampler's check of the kept tokens, and
   on rejection its grammar sampler then its chain. The logits are
   constructed cases (which tokens carry the mass decides the outcome)
   and the model's own logits, computed by llama.cpp after `PROMPT`, along
   the text, with llama.cpp's default top-k 40 and top-p 0.95.

`python -m tests.peers.mask_order` prints the report as JSON.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import math
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np
import torch
import xgrammar

from decodespec.reference.model_files import bundled_model_path
from decodespec.spec.sampling import process_logits
from decodespec.spec.token_mask import apply_token_bitmask
from tests.peers import llama_cpp_ops


@dataclass(frozen=True)
class Grammar:
    """A grammar in GBNF (llama.cpp) and the same text as xgrammar's EBNF, and a text
    it accepts."""

    name: str
    gbnf: str
    text: str


GRAMMARS = (
    Grammar("choice", 'root ::= "yes" | "no" | "maybe"', "maybe"),
    Grammar(
        "json answer",
        'root ::= "{\\"answer\\": " ("true" | "false" | [0-9]+) "}"',
        '{"answer": 1234}',
    ),
)
TOP_K, TOP_P = 40, 0.95  # llama.cpp's common defaults, for the model's logits
PROMPT = "Answer in the format asked for. Is the sky blue? Answer: "


class Vocabulary:
    """The bundled model's vocabulary, as llama.cpp loads it and as xgrammar is told it."""

    def __init__(self) -> None:
        self.llm = llama_cpp.Llama(
            model_path=str(bundled_model_path()),
            n_ctx=256,
            n_threads=torch.get_num_threads(),
            seed=0,
            verbose=False,
        )
        self.vocab = self.llm._model.vocab
        self.size = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.eog = [t for t in range(self.size) if llama_cpp.llama_vocab_is_eog(self.vocab, t)]
        buffer = ctypes.create_string_buffer(256)
        pieces = []
        for token in range(self.size):
            # special=False: control tokens render as b"", which xgrammar treats as special.
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buffer, len(buffer), 0, False)
            pieces.append(buffer.raw[:n])
        info = xgrammar.TokenizerInfo(
            pieces, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=self.eog
        )
        self.compiler = xgrammar.GrammarCompiler(info)

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=False)

    def logits_along(self, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
        """llama.cpp's `[vocab]` float32 logits after the prompt and after each token."""
        self.llm.reset()
        rows = []
        for chunk in [prompt, *([t] for t in tokens)]:
            self.llm.eval(chunk)
            rows.append(torch.from_numpy(np.array(self.llm.scores[self.llm.n_tokens - 1])))
        return rows


class States:
    """One grammar at one prefix, in both libraries: llama.cpp's grammar sampler and
    xgrammar's matcher, each having accepted the same tokens."""

    def __init__(self, vocab: Vocabulary, grammar: Grammar, prefix: list[int]) -> None:
        self.vocab = vocab
        self.grammar = grammar
        self.prefix = prefix
        matcher = xgrammar.GrammarMatcher(vocab.compiler.compile_grammar(grammar.gbnf))
        for token in prefix:
            if not matcher.accept_token(token):
                raise ValueError(f"xgrammar rejects token {token} of {grammar.text!r}")
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab.size)
        matcher.fill_next_token_bitmask(self.bitmask)

    def grammar_sampler(self) -> object:
        """A new llama.cpp grammar sampler that has accepted the prefix."""
        sampler = llama_cpp.llama_sampler_init_grammar(
            self.vocab.vocab, self.grammar.gbnf.encode(), b"root"
        )
        for token in self.prefix:
            llama_cpp.llama_sampler_accept(sampler, token)
        return sampler

    def llama_allowed(self, logits: torch.Tensor | None = None) -> torch.Tensor:
        """`[vocab]` bool: the tokens llama.cpp's grammar sampler leaves finite."""
        row = torch.zeros(self.vocab.size) if logits is None else logits
        cand = llama_cpp_ops._Candidates(row)
        with llama_cpp_ops._owned(self.grammar_sampler()) as sampler:
            cand.apply(sampler)
        return torch.from_numpy(cand.kept())

    def xgrammar_allowed(self) -> torch.Tensor:
        """`[vocab]` bool: the tokens xgrammar's bitmask allows."""
        zeros = torch.zeros(1, self.vocab.size)
        return torch.isfinite(apply_token_bitmask(zeros, self.bitmask))[0]

    def mask_first(self, logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
        """The spec: the bitmask on the raw logits, then its filters (temperature 1)."""
        masked = apply_token_bitmask(logits[None], self.bitmask)
        out = process_logits(
            masked,
            temperature=torch.tensor([1.0]),
            top_k=torch.tensor([top_k]),
            top_p=torch.tensor([top_p]),
        )
        return torch.isfinite(out[0])

    def chain_first(self, logits: torch.Tensor, top_k: int, top_p: float) -> dict[str, Any]:
        """llama.cpp: its chain on the raw logits, its grammar's check of what the chain
        kept, and on a rejection the grammar then the chain (module docstring)."""

        def chain(row: torch.Tensor) -> torch.Tensor:
            out = llama_cpp_ops.process_logits(
                row[None],
                temperature=torch.tensor([1.0]),
                top_k=torch.tensor([top_k]),
                top_p=torch.tensor([top_p]),
            )
            return torch.isfinite(out[0])

        kept_raw = chain(logits)
        checked = self.llama_allowed(logits.masked_fill(~kept_raw, -math.inf)) & kept_raw
        resamples = bool((kept_raw & ~checked).any())
        reachable = checked.clone()
        if resamples:
            grammar_masked = self.llama_allowed(logits)
            reachable |= chain(logits.masked_fill(~grammar_masked, -math.inf))
        return {"kept_raw": kept_raw, "accepted": checked, "resamples": resamples, "set": reachable}


def _ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def _from_probabilities(size: int, mass: dict[int, float], seed: int) -> torch.Tensor:
    """Logits whose softmax puts `mass[t]` on each token t and spreads the rest over
    the others at random (no ties)."""
    g = torch.Generator().manual_seed(seed)
    rest = 1.0 - sum(mass.values())
    others = torch.rand(size, generator=g, dtype=torch.float64) + 0.5
    others[list(mass)] = 0.0
    p = others / others.sum() * rest
    for token, share in mass.items():
        p[token] = share
    return torch.log(p).to(torch.float32)


def constructed_cases(states: States) -> list[dict[str, Any]]:
    """Logits whose mass sits on chosen allowed or disallowed tokens of this state."""
    allowed = _ids(states.xgrammar_allowed())
    g = torch.Generator().manual_seed(1)
    disallowed = [
        t for t in torch.randperm(states.vocab.size, generator=g).tolist() if t not in allowed
    ][:40]
    a = allowed[:2]
    cases = [
        # top-k 5: the five largest are allowed, then the five largest are not
        ("top-k 5, the 5 largest allowed", {t: 0.15 for t in allowed[:5]}, 5, 1.0),
        ("top-k 5, the 5 largest disallowed", {t: 0.15 for t in disallowed[:5]}, 5, 1.0),
        # top-p 0.55: an allowed token (0.5), another (0.1), and 0.35 on disallowed tokens,
        # each smaller than the second: the raw nucleus is the two allowed tokens, while
        # the mask renormalizes the first to 0.5 / 0.65 > 0.55, a nucleus of one.
        (
            "top-p 0.55, the nucleus allowed, disallowed mass below it",
            {a[0]: 0.5, a[1]: 0.1, **{t: 0.01 for t in disallowed[:35]}},
            0,
            0.55,
        ),
        # top-p 0.7: a disallowed token inside the raw nucleus, between two allowed ones
        (
            "top-p 0.7, a disallowed token inside the nucleus",
            {a[0]: 0.4, disallowed[0]: 0.25, a[1]: 0.2},
            0,
            0.7,
        ),
    ]
    rows = []
    for seed, (name, mass, top_k, top_p) in enumerate(cases):
        logits = _from_probabilities(states.vocab.size, mass, seed)
        rows.append({"case": name, **_compare(states, logits, top_k, top_p)})
    return rows


def _compare(states: States, logits: torch.Tensor, top_k: int, top_p: float) -> dict[str, Any]:
    mask_first = states.mask_first(logits, top_k, top_p)
    chain = states.chain_first(logits, top_k, top_p)
    return {
        "top_k": top_k,
        "top_p": top_p,
        "mask_first": _ids(mask_first),
        "chain_raw_kept": len(_ids(chain["kept_raw"])),
        "chain_raw_allowed": len(_ids(chain["accepted"])),
        "resamples": chain["resamples"],
        "chain_first": _ids(chain["set"]),
        "same": bool(torch.equal(mask_first, chain["set"])),
    }


def compare() -> dict[str, Any]:
    """Allowed sets along each grammar's text, then kept sets (module docstring)."""
    vocab = Vocabulary()
    prompt = vocab.tokenize(PROMPT)
    grammars = []
    for grammar in GRAMMARS:
        tokens = vocab.tokenize(grammar.text)
        steps = []
        along = vocab.logits_along(prompt, tokens)
        for n, logits in enumerate(along):
            states = States(vocab, grammar, tokens[:n])
            theirs, ours = states.llama_allowed(), states.xgrammar_allowed()
            step = {
                "prefix": vocab.llm.detokenize(tokens[:n]).decode(errors="replace"),
                "llama_cpp_allowed": int(theirs.sum()),
                "xgrammar_allowed": int(ours.sum()),
                "equal": bool(torch.equal(theirs, ours)),
                "only_llama_cpp": _ids(theirs & ~ours)[:10],
                "only_xgrammar": _ids(ours & ~theirs)[:10],
            }
            step["model_logits"] = _compare(states, logits, TOP_K, TOP_P)
            steps.append(step)
        middle = States(vocab, grammar, tokens[: len(tokens) // 2])
        grammars.append(
            {
                "name": grammar.name,
                "gbnf": grammar.gbnf,
                "text": grammar.text,
                "tokens": tokens,
                "steps": steps,
                "constructed": constructed_cases(middle),
            }
        )
    return {
        "model": bundled_model_path().name,
        "vocab_size": vocab.size,
        "end_of_generation": vocab.eog,
        "versions": {
            "llama_cpp_python": llama_cpp.__version__,
            "xgrammar": importlib.metadata.version("xgrammar"),
        },
        "prompt": PROMPT,
        "model_logits_filters": {"top_k": TOP_K, "top_p": TOP_P, "temperature": 1.0},
        "grammars": grammars,
    }


if __name__ == "__main__":
    print(json.dumps(compare(), indent=2))
