"""The C product's loops for each instruction set give the same bits (QUANT-A8-1, issue 61).

`native_quantized.c` carries the product's loops once for each x86 instruction set
(`native_quantized_loops.h`): AVX2 (`maddubs` + `madd`), AVX-VNNI and AVX-512 VNNI
(`vpdpbusd`), and `avx2-dpbusd`, the VNNI loops with each `vpdpbusd` done by AVX2
instructions, which every AVX2 machine runs. Every one must hand the float32 steps the
same integers, hence give the AVX2 loops' bits, for 4-bit and 8-bit weights, float32 and
float16 scales and offsets, any number of blocks and of activation rows.
`DECODESPEC_NATIVE_ISA` picks the loops in a fresh process; a set this CPU lacks is
skipped, naming what it lacks (from /proc/cpuinfo), never run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# The /proc/cpuinfo flags each set of loops needs.
NEEDS = {
    "scalar": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx2-dpbusd": {"avx2", "fma", "f16c"},
    "avxvnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx512vnni": {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"},
}
BEST_FIRST = ("avx512vnni", "avxvnni", "avx2", "scalar")  # as the library chooses, unasked

# Run with DECODESPEC_NATIVE_ISA set, argv = [output file]: the loops that ran, and every
# case's product (cases seeded: the same in every process).
CHILD = r"""
import dataclasses, sys, torch
from decodespec.reference import cpu_linear, native_library
from decodespec.spec.quant import quantize_weight

outputs = {}
for bits in (4, 8):
    for blocks in (1, 7, 9, 18):
        columns = blocks * 32
        for group in ((32, 64) if bits == 4 else (32, columns)):
            if columns % group:
                continue
            for fields in ("float32", "float16", "float16, offsets"):
                g = torch.Generator().manual_seed(bits * 1000 + blocks * 10 + group)
                weight = quantize_weight(torch.randn(37, columns, generator=g), bits=bits,
                                         group_size=group)
                if fields != "float32":
                    offsets = weight.offsets
                    if fields == "float16, offsets":
                        offsets = offsets + torch.randn(offsets.shape, generator=g) * weight.scales
                    weight = dataclasses.replace(weight, scales=weight.scales.half().float(),
                                                 offsets=offsets.half().float())
                kernel = cpu_linear.pack(weight)
                assert isinstance(kernel, cpu_linear.ActivationQuantizedLinear)
                for tokens in (1, 2, 5, 17):
                    x = torch.randn(tokens, columns, generator=g) * 3
                    key = f"bits {bits}, K {columns}, group {group}, {fields}, {tokens} rows"
                    outputs[key] = kernel.linear(x)
torch.save({"isa": native_library.library().quantized_isa().decode(), "outputs": outputs},
           sys.argv[1])
"""


def cpu_flags() -> set[str]:
    """This CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    lines = [line for line in text.splitlines() if line.startswith("flags")]
    return set(lines[0].split(":", 1)[1].split()) if lines else set()


def lacking(isa: str) -> set[str]:
    return NEEDS[isa] - cpu_flags()


def environment(isa: str | None) -> dict[str, str]:
    """This process's environment with DECODESPEC_NATIVE_ISA=isa (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "DECODESPEC_NATIVE_ISA"}
    return env if isa is None else {**env, "DECODESPEC_NATIVE_ISA": isa}


def chosen(isa: str | None) -> str:
    """The loops the library runs in a process with DECODESPEC_NATIVE_ISA=isa."""
    code = "from decodespec.reference import native_library as n; print(n.library().quantized_isa().decode())"  # noqa: E501
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment(isa),
                          capture_output=True, text=True, check=True,
                          timeout=600).stdout.strip()  # fmt: skip


def products(isa: str | None, tmp_path: Path) -> dict:
    """The loops that ran and every case's product, in a process with
    DECODESPEC_NATIVE_ISA=isa (None: unset)."""
    out = tmp_path / f"{isa}.pt"
    subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, env=environment(isa),
                   check=True, timeout=600)  # fmt: skip
    return torch.load(out)


@pytest.mark.clause("QUANT-A8-1")
@pytest.mark.parametrize("isa", ["avx2-dpbusd", "avxvnni", "avx512vnni", "scalar"])
def test_each_instruction_sets_loops_give_the_avx2_loops_bits(isa, tmp_path):
    """Bitwise the AVX2 loops' products, for every case (4-bit and 8-bit, groups of one
    block, two and whole rows, float32 and float16 fields with and without offsets, K of
    1 to 18 blocks, 37 weight rows, 1 to 17 activation rows)."""
    if lacking("avx2"):
        pytest.skip(f"this CPU lacks {', '.join(sorted(lacking('avx2')))}: no AVX2 loops")
    if lacking(isa):
        pytest.skip(f"this CPU lacks {', '.join(sorted(lacking(isa)))}: the {isa} loops "
                    "cannot run here")  # fmt: skip
    reference, tested = products("avx2", tmp_path), products(isa, tmp_path)
    assert (reference["isa"], tested["isa"]) == ("avx2", isa)
    assert tested["outputs"].keys() == reference["outputs"].keys()
    differing = [key for key, out in tested["outputs"].items()
                 if not torch.equal(out, reference["outputs"][key])]  # fmt: skip
    assert not differing, (
        f"the {isa} loops give other bits than the AVX2 loops in {len(differing)} of "
        f"{len(reference['outputs'])} cases, first {differing[0]}; reproduce: "
        f"DECODESPEC_NATIVE_ISA={isa} pytest {__file__}"
    )


def test_unasked_the_best_loops_this_cpu_runs_are_chosen(tmp_path):
    """Without DECODESPEC_NATIVE_ISA: AVX-512 VNNI, else AVX-VNNI, else AVX2, else
    the scalar loops, whichever this CPU has first (never `avx2-dpbusd`)."""
    expected = next(isa for isa in BEST_FIRST if not lacking(isa))
    ran = chosen(None)
    assert ran == expected, f"this CPU's flags call for {expected}; the library chose {ran}"


@pytest.mark.parametrize("isa", ["avxvnni", "avx512vnni"])
def test_asking_for_loops_this_cpu_lacks_runs_the_best_it_has(isa):
    """DECODESPEC_NATIVE_ISA naming loops this CPU cannot run is not obeyed (their first
    instruction would kill the process): the best loops it has run instead."""
    if not lacking(isa):
        pytest.skip(f"this CPU has {isa}: there is nothing to refuse")
    assert chosen(isa) == next(best for best in BEST_FIRST if not lacking(best))
