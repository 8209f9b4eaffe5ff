"""How llama.cpp, a peer, is compiled here: for the CPU it runs on, and only with what
the operating system lets a process execute.

    python3 tests/peers/llama_build.py            # the cmake options, one line
    python3 tests/peers/llama_build.py --tag      # a short name for them (make's stamp)
    python3 tests/peers/llama_build.py --json     # the CPU, its flags and the options

llama.cpp's default (`GGML_NATIVE=ON`) compiles with `-march=native`: every
instruction the compiler sees in CPUID. On an Intel Xeon VM whose CPUID
advertises AMX, that put AMX's `tilezero` into libggml-cpu, and the first
decode died of SIGILL: Linux runs AMX only for a process that asked
(`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and a hypervisor may not pass it on, which
CPUID cannot tell. So the build names each instruction set itself
(`GGML_NATIVE=OFF`), from the flags the kernel reports in /proc/cpuinfo (it
clears those it has not enabled in XCR0: AVX, AVX-512), and leaves AMX off
everywhere: llama.cpp uses it only for batched products of a few quantized
types, and a peer that can crash the suite costs more than its prefill.

With `GGML_NATIVE=OFF` ggml turns AVX, AVX2, FMA, F16C, BMI2 and SSE4.2 on by
default, so every option is passed, ON or OFF. Standard library only: make runs
this with the system's python3 before any virtual environment exists.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# ggml's x86 options (ggml/CMakeLists.txt, llama.cpp b6000 and later) and the
# /proc/cpuinfo flags each needs: all of them, as ggml compiles with all of them
# (GGML_AVX512 is -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw).
GGML_X86_OPTIONS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_BMI2": ("bmi2",),
    "GGML_AVX_VNNI": ("avx_vnni", "avx2"),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VNNI": ("avx512_vnni", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_BF16": ("avx512_bf16", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
}
# Never on (the module docstring says why).
GGML_OFF_ALWAYS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpuinfo_text() -> str:
    return CPUINFO.read_text() if CPUINFO.exists() else ""


def cpu_flags(text: str) -> frozenset[str]:
    """The first processor's `flags` line of /proc/cpuinfo's `text`."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_model(text: str) -> str:
    """The `model name` of /proc/cpuinfo's `text` (platform.processor() elsewhere)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()


def ggml_cpu_options(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """cmake options that build ggml's CPU backend for a CPU with `flags`: every x86
    option named ON or OFF, AMX off. On another architecture (`machine` not x86), no
    native code either: ggml's portable baseline for it."""
    machine = machine or platform.machine()
    options = ["-DGGML_NATIVE=OFF"]
    if machine.lower() not in ("x86_64", "amd64", "i686", "i386"):
        return options
    for option, needs in GGML_X86_OPTIONS.items():
        options.append(f"-D{option}={'ON' if flags.issuperset(needs) else 'OFF'}")
    options += [f"-D{option}=OFF" for option in GGML_OFF_ALWAYS]
    return options


def instruction_sets(options: list[str]) -> list[str]:
    """The options turned on, by name without GGML_: ['AVX', 'AVX2', ...]."""
    return [o[len("-DGGML_") : -len("=ON")] for o in options if o.endswith("=ON")]


def tag(options: list[str]) -> str:
    """A short name for `options`, so that a build for another CPU is not reused."""
    return hashlib.sha256(" ".join(options).encode()).hexdigest()[:10]


def describe(text: str | None = None) -> dict:
    """The CPU, the instruction sets it has, and the options a build for it gets: what
    every results file that measures llama.cpp records."""
    text = cpuinfo_text() if text is None else text
    options = ggml_cpu_options(cpu_flags(text))
    return {
        "cpu": cpu_model(text),
        "options": options,
        "instruction_sets": instruction_sets(options),
        "amx": "off (not every kernel or hypervisor lets a process run it)",
        "tag": tag(options),
    }


def main(argv: list[str]) -> int:
    report = describe()
    if argv == ["--tag"]:
        print(report["tag"])
    elif argv == ["--json"]:
        print(json.dumps(report, indent=2))
    elif not argv:
        print(" ".join(report["options"]))
    else:
        print(f"usage: {sys.argv[0]} [--tag | --json]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
