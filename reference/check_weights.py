"""`decodespec check --model-file PATH`: does the server compute that model?

Teacher forcing over the API: for each prefix of a fixed text's token ids the
server is asked for one token at temperature 0 with its top logprobs (the
prompt sent as token ids, so that both sides see the same tokens), and the
answer is compared with the spec's forward pass (`spec.forward.forward_naive`,
float32, the file's weights dequantized) at the same position:
- top-1 agreement: the server's most likely token is the spec's;
- KL(server ‖ spec) over the server's top list, both renormalised over it.

A server that computes the model in its own quantized arithmetic (QUANT-A8-1,
llama.cpp's) stays within `MAX_MEAN_KL` and `MIN_TOP1` of the definition; one
that computes another model, or a broken one, does not.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..spec.forward import forward_naive
from .check_suite import STORY, Context, Outcome, unsupported
from .loader import load_model

TEXT = STORY + " there lived an old fisherman who loved to tell stories."
MAX_MEAN_KL = 0.05
MIN_TOP1 = 0.9


class ModelFile:
    """The model and tokenizer of `--model-file`, loaded once for the checks."""

    def __init__(self, path: str | Path) -> None:
        self.weights, self.tokenizer = load_model(path, weights="float32")
        self._pieces: dict[str, int] | None = None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def piece_ids(self) -> dict[str, int]:
        """Each token's text (as `decode` gives it) to its first id."""
        if self._pieces is None:
            self._pieces = {}
            for i in range(self.weights.config.vocab_size):
                self._pieces.setdefault(self.tokenizer.decode([i], skip_special_tokens=False), i)
        return self._pieces


def compare(ctx: Context, model: ModelFile) -> tuple[list[dict], list]:
    """Per position: the server's and the spec's top token and the KL; and the
    exchanges."""
    ids = model.tokenizer.encode(TEXT)
    with torch.no_grad():
        logprobs = torch.log_softmax(forward_naive(model.weights, torch.tensor(ids)), dim=-1)
    pieces = model.piece_ids()
    rows, exchanges = [], []
    for t in range(1, len(ids)):
        result, exchange = ctx.greedy(ids[:t], max_tokens=1, logprobs=ctx.top_n)
        exchanges.append(exchange)
        if not result.positions or not result.positions[0].top:
            raise LookupError("no top logprobs came back")
        top = [(token, lp) for token, lp in result.positions[0].top if token in pieces]
        spec = logprobs[t - 1]
        spec_top = model.tokenizer.decode([int(spec.argmax())], skip_special_tokens=False)
        server_norm = math.log(sum(math.exp(lp) for _, lp in top))
        spec_lps = [float(spec[pieces[token]]) for token, _ in top]
        spec_norm = math.log(sum(math.exp(lp) for lp in spec_lps))
        kl = sum(
            math.exp(lp - server_norm) * ((lp - server_norm) - (s - spec_norm))
            for (_, lp), s in zip(top, spec_lps, strict=True)
        )
        rows.append(
            {"position": t, "server_top": result.positions[0].top[0][0], "spec_top": spec_top,
             "kl": kl, "prompt_tokens": (result.usage or {}).get("prompt_tokens")}
        )  # fmt: skip
    return rows, exchanges


def same_weights_check(model: ModelFile) -> tuple[str, str, object]:
    """The check, registered only when `--model-file` is given."""

    def same_weights(ctx: Context) -> Outcome:
        try:
            rows, exchanges = compare(ctx, model)
        except LookupError as error:
            return unsupported(str(error))
        agree = sum(r["server_top"] == r["spec_top"] for r in rows) / len(rows)
        mean_kl = sum(r["kl"] for r in rows) / len(rows)
        detail = (
            f"{len(rows)} positions: top-1 agreement {agree:.0%} (at least {MIN_TOP1:.0%}), "
            f"mean KL {mean_kl:.4f} (at most {MAX_MEAN_KL})"
        )
        evidence = [{"positions": rows}, exchanges[0].evidence()]
        ok = agree >= MIN_TOP1 and mean_kl <= MAX_MEAN_KL
        return Outcome("pass" if ok else "fail", detail, evidence)

    return ("the server computes --model-file's model", "FWD-LAYER-1", same_weights)
