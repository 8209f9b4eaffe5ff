"""`decodespec check`'s checks of the sampling distribution, against the
probabilities the server itself reports.

The first token of a prompt is drawn many times (`max_tokens` 1, seeds
0, 1, 2, ... so that the run repeats), and the draws are compared with the
server's own top logprobs for that position at temperature 1, where the raw
and the processed distributions are the same (LOGPROB-RAW-1):
- the filters (top-p, top-k, min-p) must never return a token outside the set
  the spec keeps from those probabilities (SAMPLE-TOPP-1, SAMPLE-TOPK-1,
  SAMPLE-MINP-1); each parameter is chosen halfway between two tokens'
  thresholds, so that rounding in the reported logprobs cannot move the
  boundary;
- at temperature 1 the draws' frequencies must fit the reported probabilities
  (the mass off the top list as one more bin), and at 0.7 and 1.5 the
  frequencies of the list's tokens must fit `p_i^(1/T)` renormalised over the
  list (SAMPLE-CHOICE-1 with SOFTMAX-TEMP-1): chi-square tests at a
  false-alarm rate of 0.001 each.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from statistics import NormalDist

from .check_suite import Context, Outcome, check, unsupported

# prompts whose first token is far from certain; which suits best depends on the model
SPREAD_PROMPTS = (
    "She picked up the",
    "My favourite fruit is the",
    "My favourite colour is",
    "The name of my dog is",
)
# prompts whose first token's top list holds most of the mass, spread over a few tokens
COVERED_PROMPTS = (
    "Yes or no? The answer is",
    "Monday, Tuesday,",
    "A cat says",
    "Water is made of hydrogen and",
    "The opposite of hot is",
)
MIN_COVERAGE = 0.8
MEMBERSHIP_DRAWS = 40
FREQUENCY_DRAWS = 150
FALSE_ALARM = 0.001  # per chi-square test
TEMPERATURES = (0.7, 1.0, 1.5)
CONCURRENCY = 4


def distribution(ctx: Context, prompt: str) -> list[tuple[str, float]]:
    """The server's top list for the prompt's first token at temperature 1, as
    probabilities, most likely first."""
    result = ctx.ok(ctx.complete(prompt, max_tokens=1, temperature=1.0, logprobs=ctx.top_n))
    if not result.positions or len(result.positions[0].top) < 3:
        return []
    return [(token, math.exp(lp)) for token, lp in result.positions[0].top]


def _distributions(ctx: Context, prompts: tuple[str, ...]) -> list:
    """(prompt, distribution) of each of `prompts` with a top list, asked once per run
    (the support-set checks share theirs)."""
    key = ("distributions", prompts)
    if key not in ctx.memo:
        ctx.memo[key] = [(p, probs) for p in prompts if (probs := distribution(ctx, p))]
    if not ctx.memo[key]:
        raise LookupError("no top logprobs came back")
    return ctx.memo[key]


def spread_prompt(ctx: Context) -> tuple[str, list[tuple[str, float]]]:
    """Of `SPREAD_PROMPTS`, the one whose two most likely first tokens hold the least
    mass (so that a filter the server ignores shows within a few draws)."""
    found = _distributions(ctx, SPREAD_PROMPTS)
    return min(found, key=lambda item: item[1][0][1] + item[1][1][1])


def covered_prompt(ctx: Context) -> tuple[str, list[tuple[str, float]]]:
    """Of `COVERED_PROMPTS`, the one with the least likely first token among those
    whose top list holds `MIN_COVERAGE` of the mass (most draws land in the list);
    else the best covered."""
    found = _distributions(ctx, COVERED_PROMPTS)
    covered = [item for item in found if sum(p for _, p in item[1]) >= MIN_COVERAGE]
    if covered:
        return min(covered, key=lambda item: item[1][0][1])
    return max(found, key=lambda item: sum(p for _, p in item[1]))


def draws(ctx: Context, prompt: str, count: int, first_seed: int, **params: object) -> list[str]:
    """`count` first tokens drawn with seeds first_seed, first_seed + 1, ..."""

    def one(seed: int) -> str:
        return ctx.ok(ctx.complete(prompt, max_tokens=1, seed=seed, **params)).text

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, range(first_seed, first_seed + count)))


def _membership(
    ctx: Context, name: str, params: Callable[[list[tuple[str, float]]], dict], keep: int
) -> Outcome:
    try:
        prompt, probs = spread_prompt(ctx)
    except LookupError as error:
        return unsupported(str(error))
    kept = {token for token, _ in probs[:keep]}
    got = draws(ctx, prompt, MEMBERSHIP_DRAWS, 1000, temperature=1.0, **params(probs))
    outside = sorted({token for token in got if token not in kept})
    miss = sum(p for _, p in probs[:keep]) ** MEMBERSHIP_DRAWS
    setting = ", ".join(f"{k} {v:.4g}" for k, v in params(probs).items())
    if outside:
        return Outcome(
            "fail",
            f"{name} ({setting}) on {prompt!r}: drew {outside!r}, outside the kept "
            f"{sorted(kept)!r} the server's own logprobs imply",
            [{"prompt": prompt, "top": probs, "draws": got}],
        )
    return Outcome(
        "pass",
        f"{name} ({setting}): {MEMBERSHIP_DRAWS} draws, all in {sorted(kept)!r} (had the "
        f"filter been ignored, {miss:.1e} chance of no draw outside)",
        [{"prompt": prompt, "top": probs, "draws": got}],
    )


@check("top_p draws stay in the nucleus", "SAMPLE-TOPP-1")
def top_p_nucleus(ctx: Context) -> Outcome:
    # halfway between the first token's mass and the first two's: keeps exactly two
    return _membership(ctx, "top_p", lambda probs: {"top_p": probs[0][1] + probs[1][1] / 2}, keep=2)


@check("top_k draws stay in the k most likely", "SAMPLE-TOPK-1")
def top_k_set(ctx: Context) -> Outcome:
    return _membership(ctx, "top_k", lambda probs: {"top_k": 2}, keep=2)


@check("min_p draws stay above the threshold", "SAMPLE-MINP-1")
def min_p_set(ctx: Context) -> Outcome:
    # halfway between the second and the third token's ratio to the first: keeps two
    def setting(probs: list[tuple[str, float]]) -> dict:
        return {"min_p": (probs[1][1] + probs[2][1]) / 2 / probs[0][1]}

    return _membership(ctx, "min_p", setting, keep=2)


def chi_square_limit(df: int, false_alarm: float) -> float:
    """The chi-square quantile 1 - false_alarm (Wilson and Hilferty's approximation,
    within a few percent for df >= 1 at these tails)."""
    z = NormalDist().inv_cdf(1 - false_alarm)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def frequency_test(
    probs: list[tuple[str, float]], got: list[str], temperature: float
) -> tuple[float, float, int, list[tuple[str, int, float]]]:
    """(statistic, limit, draws tested, bins as (token, observed, expected)).

    At temperature 1 the reported probabilities are the law itself: every draw
    counts, and those off the top list fill a bin of their own (expected: the mass
    the list leaves). At another temperature only the list's tokens have a known
    law, `p_i^(1/T)` renormalised over the list: the draws that land in it are
    tested. Tokens expected fewer than 5 times share one bin."""
    if temperature == 1.0:
        weights, total, tested = dict(probs), 1.0, list(got)
    else:
        weights = {token: p ** (1 / temperature) for token, p in probs}
        total, tested = sum(weights.values()), [token for token in got if token in weights]
    n = len(tested)
    bins: list[tuple[str, int, float]] = []
    rest_observed, rest_expected = 0, 0.0
    for token, weight in weights.items():
        expected, observed = n * weight / total, tested.count(token)
        if expected >= 5:
            bins.append((token, observed, expected))
        else:
            rest_observed, rest_expected = rest_observed + observed, rest_expected + expected
    off_list = sum(token not in weights for token in tested)
    rest_observed += off_list
    rest_expected += n * max(0.0, 1.0 - sum(weights.values()) / total)
    if rest_expected > 0 or rest_observed:
        bins.append(("(the rest)", rest_observed, rest_expected))
    statistic = sum((o - e) ** 2 / e if e > 0 else math.inf for _, o, e in bins if o or e)
    limit = chi_square_limit(len(bins) - 1, FALSE_ALARM) if len(bins) > 1 else math.inf
    return statistic, limit, n, bins


@check("draw frequencies follow the reported probabilities at T 0.7, 1, 1.5", "SAMPLE-CHOICE-1")
def draw_frequencies(ctx: Context) -> Outcome:
    try:
        prompt, probs = covered_prompt(ctx)
    except LookupError as error:
        return unsupported(str(error))
    lines, evidence, bad = [], [], []
    for i, temperature in enumerate(TEMPERATURES):
        got = draws(ctx, prompt, FREQUENCY_DRAWS, 2000 + i * FREQUENCY_DRAWS,
                    temperature=temperature)  # fmt: skip
        statistic, limit, n, bins = frequency_test(probs, got, temperature)
        evidence.append({"temperature": temperature, "bins": bins, "draws_tested": n})
        if len(bins) < 2:  # too few draws in the list to test at this temperature
            lines.append(f"T {temperature}: not tested ({n} draws in the top list)")
            continue
        lines.append(f"T {temperature}: chi2 {statistic:.1f} (limit {limit:.1f}, {n} draws)")
        if statistic > limit:
            bad.append(temperature)
    detail = f"{prompt!r}: " + "; ".join(lines)
    if bad:
        return Outcome("fail", detail, evidence)
    return Outcome("pass", detail, evidence)
