"""The C library of the torch backend: compiled at first use, loaded with ctypes.

Four sources make one library: `native_step.c`, the loops between the kernels
of the native decode step (`native_step.py`); `native_attention.c`, the stage
contract's KV append and attention, which the step calls
(`native_attention.py`); `native_quantized.c`, the quantized projections, and
`native_dense.c`, the float32 ones (`cpu_linear.py`). They are compiled once
per machine with the system's C compiler into the user's cache directory,
keyed by the sources, the flags and the compiler.

Where that fails (no compiler, a compile error, an unwritable cache directory,
a library that does not load from a noexec one) `library()` says why in one
line on stderr, the first time, and raises `NativeUnavailable` with that
line every time, without compiling again; each caller then runs its PyTorch
path. `DECODESPEC_NATIVE=0` turns
every user of the library off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("native_step.c", "native_attention.c", "native_quantized.c", "native_dense.c")
)
# Included by a source (once for each instruction set), not compiled alone; part of the
# library's key all the same.
HEADERS = (Path(__file__).with_name("native_quantized_loops.h"),)
# Reassociation lets the compiler vectorize the dot products and sums (attention's,
# the norm's): another order of float32 sums, as any kernel's.
CFLAGS = ("-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")  # fmt: skip
_VOID_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": [_VOID_P, _VOID_P, _I64, _VOID_P, _F32, _VOID_P, _I64, _I64],
    "silu_mul": [_VOID_P, _I64, _I64, _VOID_P, _I64],
    "decoder_layers": [_VOID_P, _VOID_P, _I64, _VOID_P, _F32, _VOID_P, _I64, _VOID_P, _VOID_P,
                       _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _VOID_P, _I64, _I64],
    # The stage contract's operations, which `decoder_layers` calls (native_attention.py).
    "append_kv": [_VOID_P, _I64, _VOID_P, _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _I64],
    "paged_attention": [_VOID_P, _I64, _I64, _I64, _I64, _F32, _VOID_P, _VOID_P, _I64, _VOID_P,
                        _I64, _VOID_P, _VOID_P, _I64, _VOID_P, _VOID_P, _I64],
    # native_quantized.c: the quantized projections (cpu_linear.py)
    "quantized_product": [_VOID_P, _VOID_P, _VOID_P, _I64, _I64, _I64, _I64, _I64, _VOID_P,
                          _I64, _I64, _VOID_P, _I64, _I64],
    "quantize_activations": [_VOID_P, _I64, _I64, _VOID_P, _VOID_P],
    "int4_tiles_bytes": [_I64, _I64, _I64],
    "pack_int4_tiles": [_VOID_P, _VOID_P, _VOID_P, _I64, _I64, _I64, _I64, _VOID_P],
    "dequantize_int4_tiles": [_VOID_P, _I64, _I64, _I64, _VOID_P],
    # native_dense.c: the float32 projections (cpu_linear.py)
    "dense_product": [_VOID_P, _I64, _I64, _VOID_P, _I64, _VOID_P, _I64],
}  # fmt: skip
_RESULTS = {"quantized_product": ctypes.c_int, "decoder_layers": ctypes.c_int,
            "paged_attention": ctypes.c_int, "int4_tiles_bytes": ctypes.c_int64,
            "compiler_version": ctypes.c_char_p, "quantized_isa": ctypes.c_char_p,
            "dense_isa": ctypes.c_char_p}  # fmt: skip


class NativeUnavailable(RuntimeError):
    """The C library cannot be built or loaded here; the message says why, on one line."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "decodespec"


def compiler() -> str:
    return os.environ.get("CC", "cc")


def _first_error(stderr: str) -> str:
    """The compiler's first error line (the one that says what is wrong), or its first line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no message"])[0]


def library_path() -> Path:
    """Where the library of these sources, these flags and this compiler lives."""
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = hashlib.sha256(sources + " ".join((compiler(), *CFLAGS)).encode()).hexdigest()[:16]
    return cache_dir() / f"native-{key}.so"


def build_library() -> Path:
    """The compiled `SOURCES` (`library_path`), built once per sources, flags and
    compiler.

    Raises:
        NativeUnavailable: no C compiler, the compile failed (its first error line
            attached), or the cache directory cannot be written.
    """
    target = library_path()
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: concurrent builds (test
        # workers) never load a half-written library.
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            try:
                result = subprocess.run(
                    [compiler(), *CFLAGS, "-o", str(built), *map(str, SOURCES), "-lm"],
                    capture_output=True,
                    text=True,
                )
            except FileNotFoundError as e:
                raise NativeUnavailable(f"no C compiler ({compiler()!r} not found)") from e
            except OSError as e:  # not executable, say
                raise NativeUnavailable(f"cannot run {compiler()!r}: {e.strerror or e}") from e
            if result.returncode != 0:
                raise NativeUnavailable(
                    f"{compiler()} failed on {' + '.join(s.name for s in SOURCES)}: "
                    f"{_first_error(result.stderr)}"
                )
            os.replace(built, target)
    except OSError as e:  # a read-only home, a cache path through a file, a full disk
        raise NativeUnavailable(f"cannot build in {target.parent}: {e.strerror or e}") from e
    return target


_LIBRARY: ctypes.CDLL | None = None
_FAILURE: str | None = None  # why the library could not be built or loaded, once tried


def _load() -> ctypes.CDLL:
    path = build_library()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:  # a noexec cache directory, a damaged file; dlerror names the path
        raise NativeUnavailable(f"cannot load {e}") from e
    for name in (*_SIGNATURES, *_RESULTS):
        getattr(lib, name).argtypes = _SIGNATURES.get(name, [])
        getattr(lib, name).restype = _RESULTS.get(name)
    return lib


def library() -> ctypes.CDLL:
    """The loaded C functions, built on first use.

    A failure is said on stderr in one line and remembered: later calls raise it
    again without another compile or another line.

    Raises:
        NativeUnavailable: as `build_library`, or the library does not load.
    """
    global _LIBRARY, _FAILURE
    if _LIBRARY is None:
        if _FAILURE is not None:
            raise NativeUnavailable(_FAILURE)
        try:
            _LIBRARY = _load()
        except NativeUnavailable as e:
            _FAILURE = " ".join(str(e).split())  # one line, for stderr and `status`
            print(f"decodespec: C library off ({_FAILURE}); running PyTorch's kernels",
                  file=sys.stderr)  # fmt: skip
            raise NativeUnavailable(_FAILURE) from e.__cause__
    return _LIBRARY


def disabled() -> bool:
    """`DECODESPEC_NATIVE=0`: every user of the library runs its PyTorch path."""
    return os.environ.get("DECODESPEC_NATIVE", "1") == "0"


def describe(lib: ctypes.CDLL) -> str:
    """The compiler that built `lib`, as the engine's path line names it: "C, cc 12.2.0"."""
    return f"C, {Path(compiler()).name} {lib.compiler_version().decode()}"
