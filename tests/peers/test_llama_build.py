"""llama.cpp is built for the CPU it runs on, AMX never (tests/peers/llama_build.py): the
options from a CPU's flags, for the Intel and AMD machines this project runs on."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.peers import llama_build

ROOT = Path(__file__).resolve().parents[2]

# /proc/cpuinfo's flags of the two machines issue 58 names (abridged to what matters)
EPYC = "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni"
XEON = (
    EPYC + " avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16"
    " avx_vnni amx_bf16 amx_tile amx_int8"
)


def options(flags: str) -> dict[str, str]:
    found = llama_build.ggml_cpu_options(frozenset(flags.split()), machine="x86_64")
    return dict(option.removeprefix("-D").split("=") for option in found)


def test_an_avx2_cpu_gets_avx2_and_no_avx512():
    got = options(EPYC)
    assert got["GGML_NATIVE"] == "OFF"
    assert all(got[o] == "ON" for o in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"))
    assert all(got[o] == "OFF" for o in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX_VNNI"))


def test_an_avx512_cpu_gets_its_extensions_and_never_amx():
    got = options(XEON)
    for option in ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16"):
        assert got[option] == "ON", option
    assert got["GGML_AVX_VNNI"] == "ON"
    assert all(got[o] == "OFF" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))


def test_every_option_is_named_on_or_off():
    """With GGML_NATIVE=OFF ggml turns AVX2 and others on by default: an option left
    out would be on for a CPU without it."""
    got = options("fpu sse sse2")
    assert set(got) == {"GGML_NATIVE", *llama_build.GGML_X86_OPTIONS, *llama_build.GGML_OFF_ALWAYS}
    assert set(got.values()) == {"OFF"}


def test_avx512_needs_all_the_subsets_ggml_compiles_with():
    got = options(EPYC + " avx512f avx512_vnni")  # no avx512bw, vl, dq, cd
    assert got["GGML_AVX512"] == got["GGML_AVX512_VNNI"] == "OFF"


def test_another_architecture_gets_no_native_code_either():
    assert llama_build.ggml_cpu_options(frozenset(), machine="aarch64") == ["-DGGML_NATIVE=OFF"]


def test_cpuinfo_is_read_from_the_first_processor():
    text = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2\n\n"
    text += "processor\t: 1\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2\n"
    report = llama_build.describe(text)
    assert report["cpu"] == "Intel(R) Xeon(R)"
    assert "AVX2" in report["instruction_sets"] and "AVX" not in report["instruction_sets"]
    assert report["tag"] != llama_build.describe(text.replace("avx2", "avx"))["tag"]


def test_make_and_the_benches_build_with_these_options():
    """The Makefile's llama-cpp-python build and the benches' llama-server build take the
    options from llama_build, with the system's python3 (no venv yet), and none builds
    with -march=native on x86."""
    done = subprocess.run(
        ["python3", "tests/peers/llama_build.py"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == llama_build.describe()["options"]
    makefile = (ROOT / "Makefile").read_text()
    assert "LLAMA_CPU_OPTIONS := $(shell python3 tests/peers/llama_build.py)" in makefile
    assert 'CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_CPU_OPTIONS)"' in makefile
    assert "GGML_NATIVE=ON" not in makefile
    from tests.benchmarks import versus_llama

    assert set(llama_build.describe()["options"]) <= set(versus_llama.CMAKE_OPTIONS)
    assert "-DGGML_NATIVE=OFF" in versus_llama.CMAKE_OPTIONS
