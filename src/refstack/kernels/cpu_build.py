"""Build and load the native kernels (``cpu_kernels.c``, ``cpu_bf16.c``, ``cpu_attention.c``, ``cpu_int8.c``,
``cpu_common.h``):
compiled on first use, cached per source, compiler and CPU.

The source is compiled with the system C compiler (``$CC``, else ``cc``) with
``-O3 -march=native -fopenmp`` into ``$REFSTACK_KERNEL_CACHE`` (default
``~/.cache/refstack/kernels``), the way Triton builds its launcher stub.  Without a
compiler the kernels are unavailable and refstack runs its torch path; ``load()``
raises ``NativeKernelsUnavailable`` with the reason.

torch must be imported first (``refstack.kernels.cpu_kernels`` does): the library
links ``libgomp.so.1``, and the loader then reuses the OpenMP runtime torch already
loaded, so the kernels share torch's threads rather than starting a second pool that
would compete with it for the cores.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).parent
SOURCES = (_HERE / "cpu_kernels.c", _HERE / "cpu_bf16.c", _HERE / "cpu_attention.c", _HERE / "cpu_int8.c")
HEADERS = (_HERE / "cpu_common.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300
BLOCK_COLS = 32  # columns per packed weight block; checked against the library at load


class NativeKernelsUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def _cpu_id() -> str:
    # -march=native code is only valid on the CPU it was built for: a cache shared
    # between machines (a network home directory) must not hand one machine's build
    # to another.
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("REFSTACK_KERNEL_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "refstack" / "kernels"


def _umask() -> int:
    # Read, not set-and-restore: os.umask() would change it for every thread meanwhile.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise NativeKernelsUnavailable(f"no C compiler: {cc!r} is not on PATH (set $CC to use another)")
    return cc


def build(out_dir: Path | None = None) -> Path:
    """The shared library's path, compiling it unless this source/compiler/CPU build is cached."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeKernelsUnavailable(f"C compiler {cc!r} does not run: {exc}") from None
    texts = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, cc, version, *FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key}.so"
    if target.is_file():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Build under a temporary name, then rename: processes building at once (test
        # workers, a server and a bench) each see either nothing or a whole file.
        fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=out_dir)
    except OSError as exc:
        raise NativeKernelsUnavailable(f"cannot write the kernel cache {out_dir}: {exc.strerror}") from None
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise NativeKernelsUnavailable(f"{cc} failed to build the kernels (exit {proc.returncode}): " + " | ".join(tail))
        # mkstemp made the file 0600: give it the usual permissions (umask applied), so
        # a cache shared between users holds a library every one of them can load.
        os.chmod(tmp, 0o755 & ~_umask())
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise NativeKernelsUnavailable(f"{cc} took over {BUILD_TIMEOUT_S} s to build the kernels") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, cint, f32, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_double
    signatures = {
        "refstack_block_cols": [],
        "refstack_bf16_dot_native": [],
        "refstack_gemm": [ptr, i64, i64, i64, ptr, i64, ptr, i64, cint],
        "refstack_moe_experts": [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, cint],
        "refstack_rms_norm": [ptr, ptr, i64, i64, ptr, f32, ptr, ptr, cint],
        "refstack_moe_dispatch": [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, cint],
        "refstack_moe_combine": [ptr, i64, ptr, ptr, i64, i64, i64, ptr, cint, cint],
        "refstack_moe_route": [ptr, i64, i64, i64, ptr, ptr],
        "refstack_ep_dispatch": [ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, cint, i64, f64],
        "refstack_ep_combine": [ptr, i64, ptr, ptr, i64, i64, i64, ptr, cint, cint, i64, f64],
        "refstack_attn_decode_block": [ptr, i64, i64, ptr, ptr, cint, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64,
                                       i64, f32, ptr, ptr, cint],
        "refstack_gqa_decode": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, cint],
        # The same two over a cache of any storage type (kv_type, K scales, V scales after the cache).
        "refstack_attn_decode_block_kv": [ptr, i64, i64, ptr, ptr, cint, i64, i64, i64, ptr, ptr, i64, ptr, ptr, cint, ptr,
                                          ptr, ptr, ptr, i64, i64, f32, ptr, ptr, cint],
        "refstack_gqa_decode_kv": [ptr, ptr, ptr, ptr, ptr, cint, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr,
                                   cint],
        "refstack_kda_prepare": [ptr, i64, ptr, i64, ptr, ptr, f32, f32, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, cint],
        "refstack_kda_decode_block": [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, f32, f32, ptr, i64, i64, i64, f32, ptr, f32,
                                      ptr, cint, ptr, ptr, ptr, cint],
        "refstack_rope": [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr, ptr],
        "refstack_gemm_bf16": [ptr, i64, i64, i64, ptr, i64, ptr, i64, cint],
        "refstack_moe_experts_bf16": [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, cint],
        "refstack_kda_scan": [ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr, cint],
        "refstack_kda_scan_varlen": [ptr, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, f32, ptr,
                                     cint],
        # cpu_int8.c: W8A8 (refstack.model.quant)
        "refstack_int8_dot_native": [],
        "refstack_int8_force_portable": [cint],
        "refstack_pack_header_bytes": [],
        "refstack_gemm_w8a8": [ptr, i64, i64, i64, ptr, i64, ptr, i64, cint],
        "refstack_gemm_tagged": [ptr, i64, i64, i64, ptr, i64, ptr, i64, cint],
        "refstack_int8_mm": [ptr, i64, i64, ptr, i64, ptr, cint],
        "refstack_int8_quantize": [ptr, i64, i64, ptr, ptr, ptr],
        "refstack_moe_experts_w8a8": [ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, cint],
        "refstack_mark_log_set": [ptr],  # span marks (refstack.model.decode_trace)
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, cint
    for name, argtypes in {"refstack_ep_cross_bytes": [ptr, i64, i64, i64, i64, i64],
                           "refstack_ep_wait": [i64, f64]}.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, i64


@functools.cache
def _load_once() -> ctypes.CDLL | NativeKernelsUnavailable:
    # A failure is remembered too: "auto" callers ask once per model, and a missing
    # compiler does not appear mid-process.
    try:
        path = build()
    except NativeKernelsUnavailable as exc:
        return exc
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as exc:
        return NativeKernelsUnavailable(f"cannot load {path}: {exc}")
    if lib.refstack_block_cols() != BLOCK_COLS:
        return NativeKernelsUnavailable(f"{path} packs {lib.refstack_block_cols()} columns per block, expected {BLOCK_COLS}")
    return lib


@functools.cache
def load_holding_gil() -> ctypes.PyDLL:
    """The same library through a second handle whose calls keep the GIL (``ctypes.PyDLL``).

    ``load()``'s ``CDLL`` releases the GIL for every call, so other Python threads run
    while a kernel works; a call through this handle holds it throughout, as a C++
    extension that never drops the GIL does.  The process maps the library once (the
    loader refcounts it): only the calling convention differs, so which handle a call
    goes through is chosen per call (the ``ep_release_gil`` knob)."""
    lib = load()
    held = ctypes.PyDLL(lib._name)
    _declare(held)
    return held


def load() -> ctypes.CDLL:
    """The loaded library (built on the first call); raises ``NativeKernelsUnavailable``."""
    lib = _load_once()
    if isinstance(lib, NativeKernelsUnavailable):
        raise NativeKernelsUnavailable(str(lib))
    return lib


def available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """None when the kernels load, else why not (one line)."""
    lib = _load_once()
    return str(lib) if isinstance(lib, NativeKernelsUnavailable) else None
