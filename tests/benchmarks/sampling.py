"""GPU benchmark of `kernels.sample` and `kernels.compute_logprobs`: `make bench-sampling`.

    python -m tests.benchmarks.sampling [--out PATH] [--smoke]

Cases (issue 5): batch 1, 32 and 256 over vocabularies of 32,000, 128,256 and
151,936 tokens, float32 and bfloat16 logits, and four parameter sets:
temperature 0.7 with top-k 50 and top-p 0.9; top-p 0.9 alone; min-p 0.1
alone; greedy with the top-20 logprobs (`sample` at temperature 0, then
`compute_logprobs(logits, tokens, 20)`, timed as one case). Parameters are
per-row tensors, as an engine batching different requests passes them, and
every row has its own seed and step. The logits are a long random tail with a
few raised tokens, from flat rows to peaked ones (`make_logits`).

Per case: our median time (the public calls, argument checks included); the
time one read of the logits takes at the measured copy bandwidth and our time
over it (1 would be a single pass at copy speed); the fraction of rows whose token equals the spec's
(`decodespec.spec.sampling.sample` on the same tensors; ~1.0, float32 rounding aside).
Peers, timed in the same process on the same logits, with their time over
ours (> 1: we are faster):

- `sort_based`: the PyTorch path of Hugging Face's warpers and vLLM's
  fallback sampler, which sorts the vocabulary for top-p (`sort_based_sample`,
  `sort_based_greedy_logprobs`);
- `flashinfer`: FlashInfer's sort-free sampling kernels (`flashinfer_call`).

A peer that is missing or fails is recorded as `{"unavailable": reason}`. The
targets of the issue are evaluated from the measurements. Results:
`results/sampling-gpu.json`.

Without a CUDA GPU the command refuses (exit status 2) unless `--smoke` asks
for tiny shapes in the Triton interpreter, a check of the command itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from types import ModuleType

import torch
from torch import Tensor

from decodespec.spec.sampling import sample as spec_sample
from tests.benchmarks.gpu import (
    RESULTS,
    PeerUnavailable,
    parse_args,
    report_header,
    start_run,
    time_peer,
    write_json,
)

COMMAND = "python -m tests.benchmarks.sampling"
DEFAULT_OUT = RESULTS / "sampling-gpu.json"
PEERS = ("sort_based", "flashinfer")
NUM_PEAKS = 8  # raised tokens per row
PEAK_HEIGHTS = (8.0, 16.0)  # the range of a row's height, drawn uniformly
MAX_STEP = 4096


@dataclass(frozen=True)
class Parameters:
    """One parameter set, given to every row of a case (None: the filter is off)."""

    name: str
    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    num_top_logprobs: int | None = None  # also `compute_logprobs` of the tokens, top n


PARAMETER_SETS = (
    Parameters("T0.7 top-k 50 top-p 0.9", temperature=0.7, top_k=50, top_p=0.9),
    Parameters("top-p 0.9", temperature=1.0, top_p=0.9),
    Parameters("min-p 0.1", temperature=1.0, min_p=0.1),
    Parameters("greedy + top-20 logprobs", temperature=0.0, num_top_logprobs=20),
)


@dataclass(frozen=True)
class Case:
    """`batch` rows of `vocab` logits in `dtype`, sampled with `params`."""

    batch: int
    vocab: int
    dtype: str
    params: Parameters

    @property
    def name(self) -> str:
        return f"b{self.batch} v{self.vocab} {self.dtype} {self.params.name}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def logits_bytes(self) -> int:
        return self.batch * self.vocab * self.torch_dtype.itemsize


def issue_cases() -> list[Case]:
    """The cases of issue 5, smallest vocabulary and batch first."""
    return [
        Case(batch, vocab, dtype, params)
        for vocab in (32_000, 128_256, 151_936)
        for batch in (1, 32, 256)
        for dtype in ("float32", "bfloat16")
        for params in PARAMETER_SETS
    ]


def smoke_cases() -> list[Case]:
    """Every parameter set on a tiny shape, in float32 (the interpreter's bfloat16 is wrong)."""
    return [Case(2, 300, "float32", params) for params in PARAMETER_SETS]


# Targets of issue 5, at one shape (every dtype and parameter set there).
TARGET_BATCH, TARGET_VOCAB = 256, 128_256
MAX_RATIO_TO_ONE_READ = 2.0
MIN_SPEEDUP_OVER_SORT_BASED = 5.0


# ---------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """One case's logits and the keyword arguments of `kernels.sample` (per-row tensors)."""

    logits: Tensor  # [batch, vocab]
    args: dict[str, Tensor]  # temperature, the filters that are on, seed, step


def make_logits(case: Case, device: torch.device) -> Tensor:
    """A tail of `2 · randn`; NUM_PEAKS tokens per row set to the row's height plus `randn`.

    At the lowest height the raised tokens hold a few percent of the mass (a
    flat row, where top-p keeps a large part of the vocabulary); at the highest
    nearly all of it (a peaked row), as an LM's distributions range from one
    step to the next.
    """
    batch, vocab = case.batch, case.vocab
    logits = 2 * torch.randn(batch, vocab, device=device)
    low, high = PEAK_HEIGHTS
    height = low + (high - low) * torch.rand(batch, 1, device=device)
    peaks = torch.randint(vocab, (batch, NUM_PEAKS), device=device)
    logits.scatter_(1, peaks, height + torch.randn(batch, NUM_PEAKS, device=device))
    return logits.to(case.torch_dtype)


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """The logits, the parameter set as per-row tensors, and a random seed and step per row."""
    batch, params = case.batch, case.params

    def per_row(value: float, dtype: torch.dtype) -> Tensor:
        return torch.full((batch,), value, dtype=dtype, device=device)

    args = {"temperature": per_row(params.temperature, torch.float32)}
    if params.top_k is not None:
        args["top_k"] = per_row(params.top_k, torch.int64)
    if params.top_p is not None:
        args["top_p"] = per_row(params.top_p, torch.float32)
    if params.min_p is not None:
        args["min_p"] = per_row(params.min_p, torch.float32)
    args["seed"] = torch.randint(-(2**63), 2**63 - 1, (batch,), device=device)
    args["step"] = torch.randint(MAX_STEP, (batch,), device=device)
    return Inputs(make_logits(case, device), args)


# ---------------------------------------------------------------- the peers
# Each prepares a call on the inputs; only the call itself is timed. Both
# apply the temperature as the engines do: a division, skipped at 1.


def scaled_logits(logits: Tensor, params: Parameters, temperature: Tensor) -> Tensor:
    """float32 logits over the temperature, in one pass (a float32 copy at temperature 1)."""
    if params.temperature == 1.0:
        return logits.float()
    return logits / temperature[:, None]  # float32: the temperature's dtype wins


def sort_based_sample(logits: Tensor, params: Parameters, args: dict[str, Tensor]) -> Tensor:
    """One token per row the way the PyTorch fallbacks of Hugging Face and vLLM draw it.

    Temperature divides the logits; top-k masks what lies below the k-th
    largest value (`torch.topk`); softmax; top-p sorts the probabilities in
    descending order and keeps a token while the mass before it is below p;
    min-p zeroes what lies below `min_p` times the largest probability; then
    `torch.multinomial` draws from what is left (it renormalises itself).
    """
    z = scaled_logits(logits, params, args["temperature"])
    if params.top_k is not None:
        largest = torch.topk(z, params.top_k, dim=-1).values  # k: the largest of any row
        kth_largest = largest.gather(1, args["top_k"][:, None] - 1)
        z = z.masked_fill(z < kth_largest, -math.inf)
    probs = torch.softmax(z, dim=-1)
    if params.top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= args["top_p"][:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    if params.min_p is not None:
        largest_prob = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < args["min_p"][:, None] * largest_prob, 0.0)
    return torch.multinomial(probs, 1).squeeze(1)


def sort_based_greedy_logprobs(logits: Tensor, num_top: int) -> tuple[Tensor, ...]:
    """Greedy tokens and their logprobs as vLLM gathers them: argmax, log_softmax, topk.

    Returns the tokens, their logprobs and ranks, and the top `num_top` ids
    and logprobs of each row.
    """
    tokens = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    token_logprobs = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return tokens, token_logprobs.squeeze(1), ranks, top_ids, top_logprobs


def sort_based_call(case: Case, inputs: Inputs) -> Callable[[], object]:
    """The sort-based path on this case: greedy + logprobs, or sampling."""
    params = case.params
    if params.num_top_logprobs is not None:
        return lambda: sort_based_greedy_logprobs(inputs.logits, params.num_top_logprobs)
    return lambda: sort_based_sample(inputs.logits, params, inputs.args)


def flashinfer_call(case: Case, inputs: Inputs) -> Callable[[], object]:
    """FlashInfer's fused sampling from logits (top-k + top-p) or from probabilities.

    It gets float32 logits and the per-row parameter tensors, as a batch of
    different requests needs (a single Python int top-k would take its
    top-k-first fast path instead); probabilities come from `torch.softmax`,
    as FlashInfer's own from-logits path and vLLM compute them.
    """
    if inputs.logits.device.type != "cuda":
        raise PeerUnavailable("FlashInfer runs on CUDA GPUs only")
    params, logits, args = case.params, inputs.logits, inputs.args
    if params.num_top_logprobs is not None:
        raise PeerUnavailable("FlashInfer has no logprobs operation")
    try:
        from flashinfer import sampling
    except ImportError as error:
        raise PeerUnavailable(f"flashinfer does not import: {error}") from error

    def probs() -> Tensor:
        return torch.softmax(scaled_logits(logits, params, args["temperature"]), dim=-1)

    if params.top_k is not None and params.top_p is not None:
        top_k = args["top_k"].int()
        return lambda: sampling.top_k_top_p_sampling_from_logits(
            scaled_logits(logits, params, args["temperature"]), top_k, args["top_p"]
        )
    if params.top_p is not None:
        return lambda: sampling.top_p_sampling_from_probs(probs(), args["top_p"])
    if params.min_p is not None:
        return lambda: sampling.min_p_sampling_from_probs(probs(), args["min_p"])
    raise PeerUnavailable(f"no FlashInfer function for {params.name}")


PEER_CALLS = {"sort_based": sort_based_call, "flashinfer": flashinfer_call}


# ---------------------------------------------------------------- ours


def our_call(case: Case, inputs: Inputs, kernels: ModuleType) -> Callable[[], Tensor]:
    """`kernels.sample`, then `kernels.compute_logprobs` of its tokens if the case asks."""
    num_top = case.params.num_top_logprobs

    def call() -> Tensor:
        tokens = kernels.sample(inputs.logits, **inputs.args)
        if num_top is not None:
            kernels.compute_logprobs(inputs.logits, tokens, num_top)
        return tokens

    return call


def measure_ours(
    case: Case, inputs: Inputs, kernels: ModuleType, copy_GBps: float, timer: Callable
) -> dict:
    """Our time, against one read of the logits, and how often our token is the spec's."""
    call = our_call(case, inputs, kernels)
    tokens = call()
    equal = tokens == spec_sample(inputs.logits, **inputs.args)
    ms = timer(call)
    one_read_ms = case.logits_bytes / (copy_GBps * 1e9) * 1e3
    return {
        "median_ms": ms,
        "logits_bytes": case.logits_bytes,
        "one_read_ms": one_read_ms,
        "ratio_to_one_read": ms / one_read_ms,
        "fraction_equal_to_spec": equal.float().mean().item(),
    }


def benchmark_case(
    case: Case, kernels: ModuleType, copy_GBps: float, device: torch.device, timer: Callable
) -> dict:
    """Ours and every peer on one case, on the same inputs."""
    inputs = make_inputs(case, device)
    ours = measure_ours(case, inputs, kernels, copy_GBps, timer)
    peers = {}
    for name in PEERS:
        peers[name] = time_peer(partial(PEER_CALLS[name], case, inputs), timer)
        if "median_ms" in peers[name]:
            peers[name]["ratio"] = peers[name]["median_ms"] / ours["median_ms"]
    return {"name": case.name, "case": asdict(case), "ours": ours, "peers": peers}


# ---------------------------------------------------------------- targets


def at_target_shape(results: list[dict]) -> list[dict]:
    """The results at batch TARGET_BATCH and vocabulary TARGET_VOCAB."""
    return [
        result
        for result in results
        if (result["case"]["batch"], result["case"]["vocab"]) == (TARGET_BATCH, TARGET_VOCAB)
    ]


def peer_ratios(results: list[dict], peer: str) -> dict[str, float]:
    """Case name: the peer's time over ours, for the cases where the peer ran."""
    return {
        result["name"]: result["peers"][peer]["ratio"]
        for result in results
        if "ratio" in result["peers"][peer]
    }


def bound_target(target: str, ratios: dict[str, float], bound: float, upper: bool) -> dict:
    """Every ratio at most `bound` (`upper`) or at least `bound`; met None: nothing measured."""
    worst = None
    if ratios:
        worst = max(ratios.values()) if upper else min(ratios.values())
    met = None if worst is None else (worst <= bound if upper else worst >= bound)
    return {"target": target, "bound": bound, "ratios": ratios, "worst": worst, "met": met}


def evaluate_targets(results: list[dict]) -> list[dict]:
    """The targets of issue 5, each with `met` true, false or None (not measured)."""
    shape = f"batch {TARGET_BATCH} x vocab {TARGET_VOCAB:,}"
    target_results = at_target_shape(results)
    one_read = {result["name"]: result["ours"]["ratio_to_one_read"] for result in target_results}
    return [
        bound_target(
            f"within {MAX_RATIO_TO_ONE_READ:g}x of one read of the logits at {shape}",
            one_read,
            MAX_RATIO_TO_ONE_READ,
            upper=True,
        ),
        bound_target(
            f"at least {MIN_SPEEDUP_OVER_SORT_BASED:g}x faster than the sort-based path at {shape}",
            peer_ratios(target_results, "sort_based"),
            MIN_SPEEDUP_OVER_SORT_BASED,
            upper=False,
        ),
        bound_target(
            "no slower than FlashInfer on any case",
            peer_ratios(results, "flashinfer"),
            1.0,
            upper=False,
        ),
    ]


# ---------------------------------------------------------------- the report


TABLE_COLUMNS = f"{'case':<48}{'ours ms':>10}{'read ms':>10}{'/ read':>10}{'= spec':>8}"


def format_row(result: dict) -> str:
    """One case as a table row; peers as peer time / our time (> 1: we are faster)."""
    ours = result["ours"]
    row = (
        f"{result['name']:<48}{ours['median_ms']:>10.4f}{ours['one_read_ms']:>10.4f}"
        f"{ours['ratio_to_one_read']:>10.2f}{ours['fraction_equal_to_spec']:>8.3f}"
    )
    for name in PEERS:
        ratio = result["peers"][name].get("ratio")
        row += f"{'n/a' if ratio is None else f'{ratio:.2f}x':>12}"
    return row


def format_summary(report: dict) -> str:
    """Why peers were unavailable, and the targets."""
    reasons = {
        (name, peer["unavailable"])
        for result in report["cases"]
        for name, peer in result["peers"].items()
        if "unavailable" in peer
    }
    lines = [f"{name} unavailable: {reason}" for name, reason in sorted(reasons)]
    for target in report["targets"]:
        met = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        worst = "" if target["worst"] is None else f" (worst ratio {target['worst']:.2f})"
        lines.append(f"target {target['target']}: {met}{worst}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(COMMAND, __doc__.split("\n\n")[0], DEFAULT_OUT, argv)
    run = start_run(COMMAND, args.smoke)
    copy = run.copy_bandwidth
    print(f"copy bandwidth: {copy['GBps']:.0f} GB/s; peers: peer ms / our ms")
    print(TABLE_COLUMNS + "".join(f"{name:>12}" for name in PEERS))
    results = []
    for case in smoke_cases() if args.smoke else issue_cases():
        results.append(benchmark_case(case, run.kernels, copy["GBps"], run.device, run.timer))
        print(format_row(results[-1]), flush=True)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()

    report = {
        **report_header("sampling-gpu", "bench-sampling", run),
        "logits": {"tail": "2 * randn", "peaks_per_row": NUM_PEAKS, "peak_heights": PEAK_HEIGHTS},
        "cases": results,
        "targets": evaluate_targets(results),
    }
    print(format_summary(report))
    write_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
