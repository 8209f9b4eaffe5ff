"""What a weight format costs in quality: `decodespec perplexity [FILE]`.

Measured the way llama.cpp's `llama-perplexity --kl-divergence` does. The
text is tokenized once and cut into windows of `context` tokens; the model
runs once over each window, and the second half of every window is scored,
so each scored token sees at least `context / 2` tokens before it. At every
scored position, for each format `f` against the reference `float32`:

- the negative log-likelihood of the text's next token, `−log p_f(x_{t+1})`;
  perplexity is `exp` of its mean;
- the KL divergence `KL(P_float32 ‖ P_f) = Σ_v p(v) (log p(v) − log q(v))`
  of the next-token distributions, in float64;
- top-1 agreement: whether `f` ranks first the token float32 ranks first.

Each format reports its perplexity, the mean, median, 99th percentile and
maximum KL, and the top-1 agreement. The numbers depend on the text; the
default (`DEFAULT_TEXT`) ships with Python, so every machine scores the same
one: the `pydoc_data.topics` help texts, English prose about Python
(Python Software Foundation License Version 2, the documentation's licence),
its topics joined in sorted order.

Every format runs on the kernels the engine's torch backend runs
(`backend.prepare_for_torch`), so the figures are those of what users run.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from decodespec.spec.forward import ModelWeights, forward_naive

from . import loader
from .backend import prepare_for_torch
from .weight_formats import WEIGHT_FORMATS, check_format, weight_bytes

REFERENCE_FORMAT = "float32"
DEFAULT_CONTEXT = 512
DEFAULT_MAX_TOKENS = 20_480  # 40 windows of 512: 10,240 scored positions
DEFAULT_TEXT = "pydoc_data.topics (Python's help texts, PSF License Version 2)"


def default_text() -> str:
    """The help texts Python ships (`pydoc_data.topics`), topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


@dataclass(frozen=True)
class FormatScore:
    """One format's figures over the scored positions (see the module docstring)."""

    weights: str
    perplexity: float
    mean_nll: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    scored_tokens: int
    weight_bytes: int
    seconds: float


def windows(token_ids: Sequence[int], context: int) -> list[list[int]]:
    """Consecutive windows of `context` tokens (a shorter tail is dropped)."""
    return [
        list(token_ids[start : start + context])
        for start in range(0, len(token_ids) - context + 1, context)
    ]


def scored_log_probs(weights: ModelWeights, window: list[int]) -> Tensor:
    """`[context / 2, vocab]` float64 log-probabilities of the window's second half.

    Row `i` is the distribution of the token after position `context/2 − 1 + i`.
    """
    half = len(window) // 2
    logits = forward_naive(weights, torch.tensor(window))
    return torch.log_softmax(logits[half - 1 : -1].double(), dim=-1)


def score_formats(
    model: str | Path,
    formats: Sequence[str],
    text: str,
    *,
    context: int = DEFAULT_CONTEXT,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    progress: Callable[[str], None] = lambda _message: None,
) -> dict:
    """Score `text` with the model in each format against float32.

    Args:
        model: a GGUF file or Hugging Face directory.
        formats: weight formats to compare (float32, the reference, is always run).
        text: the text to score.
        context: tokens per window (an even number, at least 4, at most the
            model's context).
        max_tokens: use at most this many tokens of the text.
        progress: called with a message per window.

    Returns:
        `{"text": ..., "tokens": ..., "context": ..., "windows": ...,
        "formats": [FormatScore as a dict, float32 first]}`.

    Raises:
        ValueError: an unknown format, a bad `context`, or a text too short for
            one window.
    """
    for name in formats:
        check_format(name)
    if context < 4 or context % 2:
        raise ValueError(f"context must be an even number >= 4, got {context}")
    order = [REFERENCE_FORMAT, *(f for f in dict.fromkeys(formats) if f != REFERENCE_FORMAT)]
    loaded, tokenizer = loader.load_formats(model, order, progress=progress)
    models = {name: prepare_for_torch(weights) for name, weights in loaded.items()}
    max_context = models[REFERENCE_FORMAT].config.max_context
    if context > max_context:
        raise ValueError(f"context {context} is longer than the model's {max_context}")
    token_ids = tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
    chunks = windows(token_ids, context)
    if not chunks:
        raise ValueError(
            f"the text has {len(token_ids)} tokens: fewer than one window of {context}"
        )
    nll: dict[str, list[Tensor]] = {name: [] for name in order}
    kl: dict[str, list[Tensor]] = {name: [] for name in order}
    same_top: dict[str, list[Tensor]] = {name: [] for name in order}
    seconds = dict.fromkeys(order, 0.0)
    for number, window in enumerate(chunks, start=1):
        progress(f"window {number}/{len(chunks)}")
        targets = torch.tensor(window[len(window) // 2 :])
        reference = probabilities = top = None
        for name in order:
            start = time.perf_counter()
            log_probs = scored_log_probs(models[name], window)
            seconds[name] += time.perf_counter() - start
            if reference is None:
                reference, probabilities = log_probs, log_probs.exp()
                top = log_probs.argmax(dim=-1)
            nll[name].append(-log_probs.gather(1, targets[:, None])[:, 0])
            kl[name].append((probabilities * (reference - log_probs)).sum(dim=-1).clamp_min(0))
            same_top[name].append(log_probs.argmax(dim=-1) == top)
    scores = []
    for name in order:
        losses, divergences = torch.cat(nll[name]), torch.cat(kl[name])
        scores.append(
            FormatScore(
                weights=name,
                perplexity=math.exp(float(losses.mean())),
                mean_nll=float(losses.mean()),
                kl_mean=float(divergences.mean()),
                kl_median=float(divergences.median()),
                kl_p99=float(torch.quantile(divergences, 0.99)),
                kl_max=float(divergences.max()),
                top1_agreement=float(torch.cat(same_top[name]).double().mean()),
                scored_tokens=int(losses.numel()),
                weight_bytes=weight_bytes(models[name]),
                seconds=seconds[name],
            )
        )
    return {
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokens": len(chunks) * context,
        "context": context,
        "windows": len(chunks),
        "formats": [asdict(score) for score in scores],
    }


def format_table(result: dict) -> str:
    """The scores as a text table, one format per row."""
    lines = [
        f"{result['windows']} windows of {result['context']} tokens, "
        f"{result['formats'][0]['scored_tokens']} scored; KL(float32 ‖ format) in nats",
        f"{'weights':<9} {'PPL':>8} {'ΔPPL':>7} {'KL mean':>9} {'KL p99':>9} {'KL max':>8} "
        f"{'top-1':>7} {'MB':>7}",
    ]
    base = result["formats"][0]["perplexity"]
    for s in result["formats"]:
        lines.append(
            f"{s['weights']:<9} {s['perplexity']:8.3f} {s['perplexity'] - base:+7.3f} "
            f"{s['kl_mean']:9.5f} {s['kl_p99']:9.5f} {s['kl_max']:8.4f} "
            f"{100 * s['top1_agreement']:6.2f}% {s['weight_bytes'] / 1e6:7.1f}"
        )
    return "\n".join(lines)


def add_command(commands) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    """The `perplexity` subcommand of `decodespec`."""
    parser = commands.add_parser(
        "perplexity",
        help="perplexity and KL divergence to float32 of each weight format on a text",
    )
    parser.add_argument("file", nargs="?", help=f"a UTF-8 text file (default: {DEFAULT_TEXT})")
    parser.add_argument("--model", help="GGUF file or Hugging Face directory (default: bundled)")
    parser.add_argument(
        "--weights",
        default=",".join(WEIGHT_FORMATS),
        help="comma-separated formats to compare with float32 (default: all)",
    )
    parser.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per window")
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens of the text to use"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.set_defaults(run=run_command)


def run_command(args) -> int:  # noqa: ANN001
    import json

    from .model_files import bundled_model_path

    formats = [name.strip() for name in args.weights.split(",") if name.strip()]
    if args.max_tokens < args.context:
        raise ValueError(f"--max-tokens {args.max_tokens} is less than --context {args.context}")
    if args.file is None:
        text = default_text()
    else:
        path = Path(args.file)
        if not path.is_file():
            raise FileNotFoundError(f"text file {path} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not UTF-8 text: {error}") from error
    model = args.model or bundled_model_path()
    result = score_formats(
        model,
        formats,
        text,
        context=args.context,
        max_tokens=args.max_tokens,
        progress=lambda message: print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True),
    )
    print("\r\033[K", end="", file=sys.stderr)
    result["text"] = DEFAULT_TEXT if args.file is None else str(args.file)
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
