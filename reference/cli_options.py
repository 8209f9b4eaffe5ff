"""What the `decodespec` commands share: their common flags, loading the model with
progress on stderr, and a prompt's token ids (the chat template)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import PARAMETERS, SamplingParams

from . import loader
from .engine import DEFAULT_LONG_PROMPT_CHUNK, DEFAULT_LONG_PROMPT_INTERVAL, DEFAULT_TOKEN_BUDGET
from .grammar import DEFAULT_BACKEND as DEFAULT_GRAMMAR_BACKEND
from .grammar_backends import BACKENDS as GRAMMAR_BACKENDS
from .model_files import bundled_model_path
from .tokenizer import Tokenizer
from .weight_formats import AUTO, WEIGHT_CHOICES, LoadSummary


def load_model_with_progress(
    path: str | None, weights: str | None = None
) -> tuple[ModelWeights, Tokenizer]:
    """The model at `path` (default: bundled) in weight format `weights`, with
    progress on stderr; what the format kept and what it quantized is always said."""
    model = Path(path) if path is not None else bundled_model_path()
    start = time.perf_counter()
    live = sys.stderr.isatty()  # redraw one status line on a terminal, else stay quiet

    def report(message: str) -> None:
        if isinstance(message, LoadSummary):
            print(f"\r\033[K{message}" if live else message, file=sys.stderr, flush=True)
        elif live:
            print(f"\r\033[K{message}", end="", file=sys.stderr, flush=True)

    if live:
        report(f"loading {model.name} ...")
    else:
        # One write: a Ctrl-C between the text and its newline would share its line.
        print(f"loading {model.name} ...\n", end="", file=sys.stderr, flush=True)
    loaded, tokenizer = loader.load_model(model, weights=weights, progress=report)
    end = "\r\033[K" if live else ""
    print(f"{end}loaded {model.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return loaded, tokenizer


def prompt_ids(
    tokenizer: Tokenizer, prompt: str, raw: bool, system: str | None = None
) -> list[int]:
    """The prompt's token ids, wrapped in the model's chat template (after the `system`
    message, if any) unless `raw`."""
    if raw or tokenizer.chat_template is None:
        if system is not None:
            raise ValueError("a system message needs the chat template (not raw)")
        return tokenizer.encode(prompt)
    messages = [{"role": "system", "content": system}] if system is not None else []
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def add_sampling_flags(
    parser: argparse.ArgumentParser, names: Sequence[str] | None = None, **defaults: object
) -> None:
    """An option for each parameter that `SamplingParams` declares a flag for (those
    of `names`, if given), with the field's default unless `defaults` gives another.
    A name in `names` or `defaults` that is not a parameter with a flag is a ValueError."""
    for name in [*(names or ()), *defaults]:
        if name not in PARAMETERS or PARAMETERS[name].flag is None:
            raise ValueError(f"{name!r} is not a sampling parameter with a command-line flag")
    for name, declared in PARAMETERS.items():
        if declared.flag is None or (names is not None and name not in names):
            continue
        about = {"dest": name, "help": declared.help}
        if declared.type is bool:
            parser.add_argument(declared.flag, action="store_true", **about)
        elif declared.type is tuple:  # a sequence: one value per use of the flag
            parser.add_argument(
                declared.flag, action="append", default=[], metavar=declared.metavar, **about
            )
        else:
            default = defaults.get(name, SamplingParams.__dataclass_fields__[name].default)
            parser.add_argument(
                declared.flag, type=declared.type, default=default, metavar=declared.metavar,
                **about,
            )  # fmt: skip


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The parameters the command's sampling flags give."""
    given = {name: getattr(args, name) for name in PARAMETERS if hasattr(args, name)}
    return SamplingParams(**given)


def torch_device(name: str) -> torch.device:
    """`auto` is the GPU when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def speculation(spec: str | None) -> tuple[str | None, str | None]:
    """`--speculate` as the engine's `speculate` and the draft model's path."""
    if spec is None or spec == "ngram":
        return spec, None
    if spec.startswith("layers:"):
        if not spec.removeprefix("layers:").isdigit():
            raise ValueError(f"--speculate {spec}: N of layers:N must be a positive integer")
        return spec, None
    if spec.startswith("model:") and len(spec) > len("model:"):
        path = spec.removeprefix("model:")
        if not Path(path).exists():
            raise ValueError(f"--speculate {spec}: no file or directory {path}")
        return "model", path
    raise ValueError(f"--speculate must be ngram, layers:N or model:PATH, got {spec!r}")


def add_weights_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default=AUTO,
        help="weight format: auto (default: a GGUF file's own, Q4_0/Q4_1/Q4_K as int4 bit "
        "for bit, Q8_0 as int8, float files as float32), float32 (the reference), "
        "bfloat16, int8 (per channel) or int4 (groups of 32); the int formats run on "
        "PyTorch's CPU kernels with the torch backend",
    )


def add_grammar_backend_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        default=DEFAULT_GRAMMAR_BACKEND,
        help=f"the library that compiles structured outputs (default {DEFAULT_GRAMMAR_BACKEND})",
    )


def add_budget_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token-budget",
        type=int,
        default=DEFAULT_TOKEN_BUDGET,
        metavar="N",
        help=f"tokens per forward pass (chunked prefill; default {DEFAULT_TOKEN_BUDGET}): "
        "decoding requests one each, prompts in chunks of what is left; 0 runs every "
        "prompt whole",
    )

    parser.add_argument(
        "--long-prompt-chunk",
        type=int,
        default=DEFAULT_LONG_PROMPT_CHUNK,
        metavar="N",
        help="a long prompt's tokens per chunk (one longer than the budget) while other "
        f"requests decode, so that they keep most of their rate (default "
        f"{DEFAULT_LONG_PROMPT_CHUNK}); 0: what the budget leaves, every pass",
    )
    parser.add_argument(
        "--long-prompt-interval",
        type=int,
        default=DEFAULT_LONG_PROMPT_INTERVAL,
        metavar="N",
        help="passes from one chunk of a long prompt to the next while other requests "
        f"decode (default {DEFAULT_LONG_PROMPT_INTERVAL}; 1: every pass)",
    )


def budget_options(args: argparse.Namespace) -> dict[str, int | None]:
    """`--token-budget`, `--long-prompt-chunk` and `--long-prompt-interval` as the
    engine's `token_budget`, `long_prompt_chunk` and `long_prompt_interval` (0: None,
    prompts whole; 0: the budget's chunks)."""
    for flag, value in (("--token-budget", args.token_budget),
                        ("--long-prompt-chunk", args.long_prompt_chunk)):  # fmt: skip
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if args.long_prompt_interval < 1:
        raise ValueError(f"--long-prompt-interval must be >= 1, got {args.long_prompt_interval}")
    return {"token_budget": args.token_budget or None,
            "long_prompt_chunk": args.long_prompt_chunk or None,
            "long_prompt_interval": args.long_prompt_interval}  # fmt: skip


def add_batch_invariant_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="for the spec and triton backends, bfloat16 weights or a machine without a C "
        "compiler: a seeded request's tokens and logprobs bitwise the same whatever else runs "
        "beside it (projections padded to blocks of rows, attention per row; see "
        "docs/determinism.md), refused, naming why, where this machine's GEMM breaks its "
        "premise. The default backend is batch-invariant without it (a no-op there)",
    )
