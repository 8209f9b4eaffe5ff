"""llama.cpp's samplers under the conformance suite (through llama-cpp-python).

`pytest tests/conformance --impl tests.peers.llama_cpp_ops` runs the suite
against llama.cpp's own CPU samplers: every operation below builds a
`llama_token_data_array` from one row of logits (`id = i`, `logit = z_i`,
unsorted), applies one llama.cpp sampler to it with `llama_sampler_apply`,
and reads the array back. The glue only converts layouts:

- a mask operation returns True for the token ids still in the array after
  the sampler ran and still holding a finite logit (llama.cpp filters by
  shrinking the array; its top-k leaves −inf candidates in it when k exceeds
  the finite ones);
- an operation returning logits puts every candidate's logit back at its id
  (and −inf at ids the samplers removed), as float32;
- float16 and bfloat16 logits are converted to float32 (exactly) because
  `llama_token_data.logit` is a C float; float64 logits cannot be given to
  llama.cpp at all (`CONFORMANCE_UNSUPPORTED`).

Penalties. llama.cpp's penalty sampler keeps no prompt mask and no output
counts: it counts the last `penalty_last_n` tokens passed to
`llama_sampler_accept` (the prompt and the output alike) and applies the
repetition penalty to every counted token, then subtracts
`count · penalty_freq + [count > 0] · penalty_present`. `apply_penalties`
feeds each row's history the way llama.cpp's common sampler sees a
sequence: every token of the prompt mask once, then every output token as
many times as `output_counts` says, with `penalty_last_n` equal to that
total, so the window holds the whole history.

`process_logits` is llama.cpp's own sampler chain (`llama_sampler_chain_*`)
in the order of its common sampler's defaults (common/sampling.cpp,
`common_params_sampling::samplers`): logit bias, penalties, top-k, top-p,
min-p, temperature (`llama_sampler_init_temp_ext` with no dynamic range, as
common builds it), without the final `dist`. Rows come back as the chain
leaves them, removed tokens at −inf.

Missing (not defined here): llama.cpp has no min_tokens sampler
(`apply_min_tokens`), and its random choice (`llama_sampler_init_dist`,
std::mt19937 with std::discrete_distribution) is not the spec's Philox
Gumbel-max, so `uniform` and `sample` are not provided; `softmax`,
`log_softmax` and `compute_logprobs` are not public llama.cpp operations.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import llama_cpp
import numpy as np
import torch
from torch import Tensor

__version__ = llama_cpp.__version__

PEER = {
    "name": "llama.cpp",
    "package": "llama_cpp_python",
    "functions": (
        "llama_sampler_apply on a llama_token_data_array with llama_sampler_init_temp, "
        "_top_k, _top_p, _min_p, _penalties (+ llama_sampler_accept), _logit_bias, _greedy; "
        "process_logits: llama_sampler_chain_init/_add with _temp_ext"
    ),
    # what this build of llama.cpp runs on ("CPU : SSE3 = 1 | ... | AVX2 = 1 | ..."): the
    # instruction sets make's build gave it (tests/peers/llama_build.py)
    "system_info": llama_cpp.llama_print_system_info().decode().strip(),
}

CONFORMANCE_UNSUPPORTED = {
    "float64": "llama.cpp's candidates (llama_token_data.logit) are C floats: float32 only",
    "min_tokens": "llama.cpp has no min_tokens sampler (process_logits cannot take stop ids)",
    "token_bitmask": "llama.cpp's grammar sampler takes a GBNF grammar, not a bitmask, and "
    "applies it only when the chain's token is rejected (tests/peers/test_mask_order.py)",
}

# llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)


class _Candidates:
    """One row of logits as llama.cpp's `llama_token_data_array`."""

    def __init__(self, row: Tensor) -> None:
        z = row.detach().to(device="cpu", dtype=torch.float32).numpy()
        if len(z) == 0:
            # llama.cpp's softmax (top-p, dist) aborts the process on an empty array:
            # GGML_ASSERT(cur_p->size > 0) in llama-sampler.cpp.
            raise RuntimeError("llama.cpp aborts on an empty candidate array: not called")
        self.vocab = len(z)
        self.data = np.zeros(self.vocab, dtype=_TOKEN_DATA)
        self.data["id"] = np.arange(self.vocab, dtype=np.int32)
        self.data["logit"] = z
        self.array = llama_cpp.llama_token_data_array(
            data=self.data.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=self.vocab,
            selected=-1,
            sorted=False,
        )

    def apply(self, sampler: object) -> None:
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(self.array))

    def current(self) -> np.ndarray:
        """The candidates now in the array (the samplers may shrink, reorder, repoint it)."""
        size = int(self.array.size)
        if size == 0:
            return np.zeros(0, dtype=_TOKEN_DATA)
        address = ctypes.cast(self.array.data, ctypes.c_void_p).value
        raw = ctypes.string_at(address, size * _TOKEN_DATA.itemsize)
        return np.frombuffer(raw, dtype=_TOKEN_DATA).copy()

    def logits(self) -> np.ndarray:
        """`[vocab]` float32: each candidate's logit at its id, −inf where removed."""
        out = np.full(self.vocab, -np.inf, dtype=np.float32)
        cand = self.current()
        out[cand["id"]] = cand["logit"]
        return out

    def kept(self) -> np.ndarray:
        """`[vocab]` bool: the ids still in the array with a finite logit."""
        out = np.zeros(self.vocab, dtype=bool)
        cand = self.current()
        out[cand["id"][np.isfinite(cand["logit"])]] = True
        return out

    def selected_id(self) -> int:
        selected = int(self.array.selected)
        if not 0 <= selected < int(self.array.size):
            raise RuntimeError(f"llama.cpp selected no candidate (selected = {selected})")
        return int(self.current()["id"][selected])


@contextlib.contextmanager
def _owned(sampler: object) -> Iterator[object]:
    """A llama.cpp sampler, freed afterwards."""
    if not sampler:
        raise RuntimeError("llama.cpp returned no sampler")
    try:
        yield sampler
    finally:
        llama_cpp.llama_sampler_free(sampler)


def _check(logits: Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must have a floating-point dtype, got {logits.dtype}")


def _per_row(name: str, values: Tensor, batch: int) -> list:
    if list(values.shape) != [batch]:
        raise ValueError(f"{name} must have shape [{batch}], got {list(values.shape)}")
    return values.detach().cpu().tolist()


def _one_sampler_masks(logits: Tensor, make, params: list) -> Tensor:
    _check(logits)
    rows = []
    for row, param in zip(logits, params, strict=True):
        cand = _Candidates(row)
        with _owned(make(param)) as sampler:
            cand.apply(sampler)
        rows.append(cand.kept())
    return torch.from_numpy(np.stack(rows)).to(logits.device)


def _as_logits(rows: list[np.ndarray], like: Tensor) -> Tensor:
    return torch.from_numpy(np.stack(rows)).to(like.device)


# ---------------------------------------------------------------- temperature


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """llama_sampler_init_temp(T) on each row: `z / T`, and for T <= 0 the first
    maximum kept at its value with every other token at −inf. float32."""
    _check(logits)
    temps = _per_row("temperature", temperature, logits.shape[0])
    rows = []
    for row, t in zip(logits, temps, strict=True):
        cand = _Candidates(row)
        with _owned(llama_cpp.llama_sampler_init_temp(float(t))) as sampler:
            cand.apply(sampler)
        rows.append(cand.logits())
    return _as_logits(rows, logits)


# ---------------------------------------------------------------- filters


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """llama_sampler_init_top_k(k) on each row (k = 0: off)."""
    ks = _per_row("top_k", top_k, logits.shape[0])
    return _one_sampler_masks(logits, lambda k: llama_cpp.llama_sampler_init_top_k(int(k)), ks)


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """llama_sampler_init_top_p(p, min_keep=0) on each row (common's default min_keep)."""
    ps = _per_row("top_p", top_p, logits.shape[0])
    return _one_sampler_masks(logits, lambda p: llama_cpp.llama_sampler_init_top_p(p, 0), ps)


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """llama_sampler_init_min_p(m, min_keep=0) on each row (m = 0: off)."""
    ms = _per_row("min_p", min_p, logits.shape[0])
    return _one_sampler_masks(logits, lambda m: llama_cpp.llama_sampler_init_min_p(m, 0), ms)


def greedy(logits: Tensor) -> Tensor:
    """llama_sampler_init_greedy on each row: the id of the array's `selected` entry."""
    _check(logits)
    tokens = []
    for row in logits:
        cand = _Candidates(row)
        with _owned(llama_cpp.llama_sampler_init_greedy()) as sampler:
            cand.apply(sampler)
        tokens.append(cand.selected_id())
    return torch.tensor(tokens, dtype=torch.int64, device=logits.device)


# ---------------------------------------------------------------- processors


def _logit_bias_sampler(bias_row: np.ndarray) -> object:
    ids = np.nonzero(bias_row)[0]
    entries = (llama_cpp.llama_logit_bias * len(ids))()
    for slot, token in enumerate(ids.tolist()):
        entries[slot].token = token
        entries[slot].bias = float(bias_row[token])
    return llama_cpp.llama_sampler_init_logit_bias(len(bias_row), len(ids), entries)


def apply_logit_bias(logits: Tensor, logit_bias: Tensor) -> Tensor:
    """llama_sampler_init_logit_bias with the row's nonzero biases."""
    _check(logits)
    if logit_bias.shape != logits.shape:
        raise ValueError(
            f"logit_bias must have shape {list(logits.shape)}, got {list(logit_bias.shape)}"
        )
    biases = logit_bias.detach().to(device="cpu", dtype=torch.float32).numpy()
    rows = []
    for row, bias_row in zip(logits, biases, strict=True):
        cand = _Candidates(row)
        with _owned(_logit_bias_sampler(bias_row)) as sampler:
            cand.apply(sampler)
        rows.append(cand.logits())
    return _as_logits(rows, logits)


def _history(prompt_row: np.ndarray, counts_row: np.ndarray) -> list[int]:
    """The tokens fed to llama_sampler_accept: each prompt token once, then each output
    token `count` times."""
    history = np.nonzero(prompt_row)[0].tolist()
    for token in np.nonzero(counts_row)[0].tolist():
        history += [token] * int(counts_row[token])
    return history


def _penalties_sampler(
    vocab: int, history: list[int], repeat: float, freq: float, present: float
) -> object:
    """llama_sampler_init_penalties over a window holding the whole history, fed to it."""
    sampler = llama_cpp.llama_sampler_init_penalties(vocab, len(history), repeat, freq, present)
    for token in history:
        llama_cpp.llama_sampler_accept(sampler, token)
    return sampler


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
) -> Tensor:
    """llama_sampler_init_penalties(n_vocab, last_n, repeat, freq, present) per row,
    after llama_sampler_accept of the row's history (module docstring)."""
    _check(logits)
    penalties_of_row = _penalties_per_row(
        logits, prompt_mask, output_counts, repetition_penalty, frequency_penalty, presence_penalty
    )
    rows = []
    for r in range(logits.shape[0]):
        cand = _Candidates(logits[r])
        with _owned(penalties_of_row(r)) as sampler:
            cand.apply(sampler)
        rows.append(cand.logits())
    return _as_logits(rows, logits)


def _penalties_per_row(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
):
    """`row -> a new penalties sampler fed that row's history`, the tensors read once."""
    batch, vocab = logits.shape
    for name, t in (("prompt_mask", prompt_mask), ("output_counts", output_counts)):
        if list(t.shape) != [batch, vocab]:
            raise ValueError(f"{name} must have shape {[batch, vocab]}, got {list(t.shape)}")
    prompts = prompt_mask.detach().cpu().numpy()
    counts = output_counts.detach().cpu().to(torch.int64).numpy()
    reps = _per_row("repetition_penalty", repetition_penalty, batch)
    freqs = _per_row("frequency_penalty", frequency_penalty, batch)
    pres = _per_row("presence_penalty", presence_penalty, batch)

    def sampler(r: int) -> object:
        history = _history(prompts[r], counts[r])
        return _penalties_sampler(vocab, history, reps[r], freqs[r], pres[r])

    return sampler


# ---------------------------------------------------------------- the chain


def process_logits(
    logits: Tensor,
    *,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    step: Tensor | None = None,
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
) -> Tensor:
    """llama.cpp's sampler chain in its common sampler's default order, without `dist`:
    logit_bias, penalties, top_k, top_p, min_p, temp_ext(T, 0, 1). float32
    `[batch, vocab]`, removed tokens at −inf. `step` is unused (llama.cpp keeps no
    step); min_tokens has no llama.cpp sampler and raises NotImplementedError."""
    del step
    _check(logits)
    batch = logits.shape[0]
    if stop_token_mask is not None or min_tokens is not None:
        raise NotImplementedError("llama.cpp has no min_tokens sampler")
    temps = _per_row("temperature", temperature, batch)
    ks = _per_row("top_k", top_k, batch) if top_k is not None else [0] * batch
    ps = _per_row("top_p", top_p, batch) if top_p is not None else [1.0] * batch
    ms = _per_row("min_p", min_p, batch) if min_p is not None else [0.0] * batch
    biases = (
        logit_bias.detach().to(device="cpu", dtype=torch.float32).numpy()
        if logit_bias is not None
        else None
    )
    penalty_inputs = (
        prompt_mask,
        output_counts,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
    )
    penalties = all(t is not None for t in penalty_inputs)
    if any(t is not None for t in penalty_inputs) and not penalties:
        raise ValueError(
            "prompt_mask, output_counts, repetition_penalty, frequency_penalty and "
            "presence_penalty must be given together"
        )
    if penalties:
        penalties_of_row = _penalties_per_row(logits, *penalty_inputs)
    rows = []
    for r in range(batch):
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        with _owned(chain):  # the chain owns and frees the samplers added to it
            if biases is not None:
                llama_cpp.llama_sampler_chain_add(chain, _logit_bias_sampler(biases[r]))
            if penalties:
                llama_cpp.llama_sampler_chain_add(chain, penalties_of_row(r))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_k(int(ks[r])))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(ps[r], 0))
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_min_p(ms[r], 0))
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_temp_ext(float(temps[r]), 0.0, 1.0)
            )
            cand = _Candidates(logits[r])
            cand.apply(chain)
            rows.append(cand.logits())
    return _as_logits(rows, logits)


__all__ = [
    "apply_logit_bias",
    "apply_penalties",
    "apply_temperature",
    "greedy",
    "min_p_mask",
    "process_logits",
    "top_k_mask",
    "top_p_mask",
]
