"""Command line: `decodespec demo` shows the sampling stage on example logits."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from spec.sampling import SamplingParams, process_logits, sample, sampling_tensors
from spec.softmax import softmax

# A made-up next-token distribution after "The capital of France is": a few
# likely continuations and a long tail, enough to see each filter act.
EXAMPLE_TOKENS = [
    " Paris",
    " a",
    " the",
    " located",
    " known",
    " not",
    " one",
    " home",
    " famous",
    " also",
    " Lyon",
    " called",
    " in",
    " very",
    " Marseille",
    " beautiful",
]
EXAMPLE_LOGITS = [
    6.9,
    6.3,
    6.0,
    5.2,
    4.9,
    4.1,
    3.8,
    3.5,
    3.5,
    3.3,
    2.6,
    2.4,
    2.2,
    1.9,
    1.5,
    1.1,
]


def demo(params: SamplingParams, draws: int) -> str:
    """The example distribution before and after the filters, and seeded draws."""
    vocab = len(EXAMPLE_TOKENS)
    logits = torch.tensor([EXAMPLE_LOGITS])
    tensors = sampling_tensors(
        [params], vocab_size=vocab, prompt_token_ids=[[0]], output_token_ids=[[]]
    )
    raw = softmax(logits)[0]
    filtered_args = {k: v for k, v in tensors.items() if k != "seed"}
    filtered = softmax(process_logits(logits, **filtered_args))[0]
    lines = [
        f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p} "
        f"min_p={params.min_p} seed={params.seed}",
        "",
        f"{'token':<12} {'raw p':>8} {'filtered p':>11}",
    ]
    for i in raw.argsort(descending=True, stable=True).tolist():
        mark = "" if filtered[i] > 0 else "  (removed)"
        lines.append(f"{EXAMPLE_TOKENS[i]!r:<12} {raw[i]:8.4f} {filtered[i]:11.4f}{mark}")
    # One row per step of the same request: every draw uses fresh random numbers.
    batch = {k: v.repeat(draws) for k, v in tensors.items()}
    batch["step"] = torch.arange(draws)
    tokens = sample(logits.repeat(draws, 1), **batch).tolist()
    lines += ["", f"{draws} seeded draws:", "".join(EXAMPLE_TOKENS[t] for t in tokens)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="decodespec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("demo", help="the sampling stage on example logits")
    show.add_argument("--temperature", type=float, default=1.0)
    show.add_argument("--top-k", type=int, default=0)
    show.add_argument("--top-p", type=float, default=0.9)
    show.add_argument("--min-p", type=float, default=0.0)
    show.add_argument("--seed", type=int, default=0)
    show.add_argument("--draws", type=int, default=12)
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            seed=args.seed,
        )
    except ValueError as error:
        parser.error(str(error))
    print(demo(params, args.draws))
    return 0


if __name__ == "__main__":
    sys.exit(main())
