"""`decodespec check --base-url URL`: the spec's observable clauses through the
OpenAI HTTP API of any server (`check_suite.py`, `check_sampling.py`, and with
`--model-file` `check_weights.py`).

The base URL may name the API's root with or without `/v1`: the command asks
`URL/v1/models`, then `URL/models`, and runs the checks where the answer is
OpenAI's model list (`check_client.find_api_root`); where none is, it stops
with the URLs tried and what each answered, not with a list of fails. The
report names the base URL it used.

Safe by construction: loopback only unless `--allow-remote`; a request budget
(`--max-requests`) and a per-request timeout; the API key is read from
`--api-key` or `OPENAI_API_KEY` and only ever sent in the Authorization header.
Prints a table (a progress line on stderr while it runs), or with `--json` the
report for CI; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.parse

from . import check_sampling, check_suite  # noqa: F401 (importing registers their checks)
from .check_client import ApiRoot, Client, find_api_root, is_loopback
from .check_weights import ModelFile, same_weights_check


def add_command(commands) -> None:  # noqa: ANN001 (argparse's private subparsers type)
    """The `check` subcommand of `decodespec`."""
    run = commands.add_parser(
        "check", help="check an OpenAI-compatible server against the spec's clauses"
    )
    run.add_argument(
        "--base-url", required=True,
        help="the server, with or without /v1, e.g. http://127.0.0.1:8000: the checks run "
        "at URL/v1 or URL, whichever answers OpenAI's model list at /models",
    )  # fmt: skip
    run.add_argument("--model", help="the model to ask for (default: the first /models lists)")
    run.add_argument(
        "--model-file", help="the same model's GGUF file or directory: compare the server's "
        "logprobs with the spec's forward pass, and tokenize for logit_bias"
    )  # fmt: skip
    run.add_argument("--api-key", help="sent as a bearer token (default: $OPENAI_API_KEY)")
    run.add_argument("--allow-remote", action="store_true", help="allow a host other than loopback")
    run.add_argument("--max-requests", type=int, default=2000, help="request budget (2000)")
    run.add_argument("--timeout", type=float, default=120.0, help="seconds per request (120)")
    run.add_argument(
        "--only", action="append", default=[], metavar="TEXT",
        help="run the checks whose name or clause contains TEXT (repeatable)",
    )  # fmt: skip
    run.add_argument("--json", action="store_true", help="print the report as JSON")
    run.set_defaults(run=check_command)


def root_url(base_url: str) -> str:
    parts = urllib.parse.urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}"


def server_tokenizer(base_url: str, api_key: str | None, model: str, timeout_s: float):  # noqa: ANN201
    """A tokenize function over the server's own `/tokenize` (llama.cpp's and vLLM's
    forms, at the URL's root), or None when it has none. Its requests are not the
    checks' budget: a tokenize call is cheap."""
    client = Client(root_url(base_url), api_key=api_key, max_requests=10_000, timeout_s=timeout_s)
    forms = (
        lambda text: {"content": text, "add_special": False},  # llama.cpp
        lambda text: {"model": model, "prompt": text, "add_special_tokens": False},  # vLLM
    )
    for body_of in forms:
        exchange = client.call("/tokenize", body_of("Paris"))
        if (
            exchange.ok
            and isinstance(exchange.body, dict)
            and isinstance(exchange.body.get("tokens"), list)
        ):

            def tokenize(text: str, body_of=body_of) -> list[int] | None:  # noqa: ANN001
                reply = client.call("/tokenize", body_of(text))
                tokens = (
                    reply.body.get("tokens") if reply.ok and isinstance(reply.body, dict) else None
                )
                return [t if isinstance(t, int) else t.get("id") for t in tokens or []] or None

            return tokenize
    return None


def check_command(args: argparse.Namespace) -> int:
    _refuse_bad_arguments(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model_file = ModelFile(args.model_file) if args.model_file else None
    checks = select_checks(args.only, model_file)
    root = find_api_root(args.base_url, api_key=api_key, timeout_s=args.timeout)
    model = args.model or first_model(root)
    client = Client(root.base_url, api_key=api_key, max_requests=args.max_requests,
                    timeout_s=args.timeout)  # fmt: skip
    if model_file is not None:
        tokenize = model_file.tokenize
    else:
        tokenize = server_tokenizer(root.base_url, api_key, model, args.timeout)
    context = check_suite.Context(client, model, tokenize)
    context.probe_top_n()
    results = run_checks(checks, context, progress=not args.json)
    report = {"base_url": root.base_url, "base_url_given": args.base_url, "model": model,
              "requests": client.requests, "checks": results}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 1 if any(r["outcome"] == "fail" for r in results) else 0


def _refuse_bad_arguments(args: argparse.Namespace) -> None:
    """ValueError for a host off loopback without `--allow-remote`, or a budget or
    timeout that allows no request: before any request is sent."""
    if not args.allow_remote and not is_loopback(args.base_url):
        raise ValueError(
            f"{args.base_url} is not a loopback address: pass --allow-remote to check another host"
        )
    if args.max_requests < 1 or args.timeout <= 0:
        raise ValueError("--max-requests must be >= 1 and --timeout > 0")


def select_checks(only: list[str], model_file: ModelFile | None) -> list[tuple]:
    """The registered checks (and the `--model-file` one) whose name or clause
    contains one of `only`'s texts; all of them when `only` is empty."""
    checks = list(check_suite.CHECKS) + ([same_weights_check(model_file)] if model_file else [])
    if only:
        checks = [c for c in checks if any(t in c[0] or t in c[1] for t in only)]
        if not checks:
            raise ValueError(f"no check's name or clause contains {' or '.join(only)!r}")
    return checks


def first_model(root: ApiRoot) -> str:
    """The first model the server's `/models` lists; ValueError when it lists none."""
    listed = [m.get("id") for m in root.models.body["data"] if isinstance(m, dict)]
    names = [name for name in listed if isinstance(name, str)]
    if not names:
        raise ValueError(f"GET {root.base_url}/models named no model: pass --model")
    return names[0]


def run_checks(checks: list[tuple], context: check_suite.Context, *, progress: bool) -> list:
    """Each check's result as the report holds it, a progress line on stderr."""
    results = []
    for index, (name, clause, function) in enumerate(checks):
        if progress:
            print(f"\r[{index + 1}/{len(checks)}] {name[:60]:<60}", end="", file=sys.stderr,
                  flush=True)  # fmt: skip
        start = time.perf_counter()
        outcome = check_suite.run_check(function, context)
        results.append({"check": name, "clause": clause, "outcome": outcome.outcome,
                        "detail": outcome.detail, "evidence": outcome.evidence,
                        "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
    if progress:
        print("\r" + " " * 80 + "\r", end="", file=sys.stderr)
    return results


def print_table(report: dict) -> None:
    given = report["base_url_given"]
    found = "" if given.rstrip("/") == report["base_url"] else f" (from --base-url {given})"
    print(f"{report['base_url']}{found}  model {report['model']!r}  {report['requests']} requests")
    for r in report["checks"]:
        print(f"{r['outcome']:<14} {r['clause']:<17} {r['check']}")
        print(f"{'':<32}{r['detail']}")
    counts = {}
    for r in report["checks"]:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
