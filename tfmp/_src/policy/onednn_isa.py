"""Which instruction set TensorFlow's oneDNN runs its matmuls with, as oneDNN itself reports it.

Report-only (`tfmp doctor`, the benchmark header): nothing a model computes depends on it.
oneDNN runs matmuls even where TensorFlow's oneDNN ops are off (`DeviceFacts.onednn`):
TensorFlow's own (Eigen) MatMul calls oneDNN's sgemm, and its bfloat16 MatMul converts to
float32 for it (TensorFlow 2.21 on a 2-core AMD EPYC Zen 3: ``gemm_api`` on f32 lines with
``TF_ENABLE_ONEDNN_OPTS`` unset, 0 or 1). A child process runs one small bfloat16 and one float32 ``MatMul`` with ``ONEDNN_VERBOSE=1``
and this process's environment (so the same ``TF_ENABLE_ONEDNN_OPTS``); `parse_verbose`
reads its lines: oneDNN's ``info,cpu,isa:`` line (the best ISA oneDNN may use on this CPU)
and each matmul's implementation (``brg_matmul:avx512_core_amx``, ``gemm:jit``,
``gemm_api``). The child calls TensorFlow's C API from its shared libraries (about a
second; ``import tensorflow`` takes 5-15 s on a loaded 2-core AMD EPYC Zen 3) and falls
back to ``import tensorflow`` where those libraries are not found.
Verbose format: oneDNN's docs, "Verbose Mode" (dev_guide_verbose); ISA names:
``src/cpu/x64/cpu_isa_traits.cpp``, ``get_isa_info``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import threading
from typing import Any, Dict, Mapping, Optional, Tuple

#: The ISAs named, slowest first: oneDNN's ``sse41`` ... ``avx512_core`` (AVX512),
#: ``avx512_core_bf16`` (AVX512_BF16: bfloat16 dot products) and ``avx512_core_amx`` (AMX tiles).
ISAS = ("sse41", "avx", "avx2", "avx512", "avx512_bf16", "amx")
#: How `OneDnnIsa.label` writes each value of `OneDnnIsa.isa`.
LABELS = {"sse41": "SSE4.1", "avx": "AVX", "avx2": "AVX2", "avx512": "AVX512",
          "avx512_bf16": "AVX512_BF16", "amx": "AMX", "off": "oneDNN off", "unknown": "unknown"}
#: (rows, inner, columns) of the child's matmul in each dtype; the inner sizes tell their lines apart.
SHAPES = {"bfloat16": (128, 256, 64), "float32": (128, 192, 64)}
#: Environment variables that change which kernels oneDNN picks (the cache key of `detect`).
ENV_KEYS = ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: Seconds the child may take before it counts as failed.
TIMEOUT_S = 120.0
#: The child's last line of output, printed once both matmuls ran.
DONE = "tfmp-onednn-isa-done"
#: The kinds of oneDNN primitive a TensorFlow matmul runs as.
_MATMUL_KINDS = ("matmul", "inner_product", "gemm_api")


@dataclasses.dataclass(frozen=True)
class OneDnnIsa:
    """What oneDNN reported for TensorFlow's matmuls in a child process.

    Attributes:
        isa: String. One of `ISAS` (the best used by a matmul), ``"off"`` (the child's
            matmuls ran, oneDNN printed nothing: TensorFlow's oneDNN kernels are off) or
            ``"unknown"`` (the child failed, or oneDNN named no ISA tfmp knows).
        cpu_isa: String. oneDNN's ``isa:`` info text, e.g. ``"Intel AVX2"``; empty when none.
        matmuls: Tuple of ``(dtype, implementation)`` string pairs, e.g. ``("bfloat16",
            "brg_matmul:avx512_core_amx on bf16")``: each of the child's matmuls as oneDNN
            ran it (implementation, then the source data type); empty when none was seen.
        source: String. ``"measured"``, or ``"failed: <why>"``.
    """

    isa: str
    cpu_isa: str = ""
    matmuls: Tuple[Tuple[str, str], ...] = ()
    source: str = "measured"

    @property
    def label(self) -> str:
        """String. `isa` as people write it: ``"AMX"``, ``"AVX512_BF16"``, ``"AVX2"``, ``"oneDNN off"``."""
        return LABELS[self.isa]

    def describe(self) -> str:
        """String. One line: the label, then what oneDNN said, e.g.
        ``"AVX2 (oneDNN: Intel AVX2; bfloat16 matmul gemm_api on f32, float32 matmul gemm_api on f32)"``.
        """
        if self.source != "measured":
            return f"unknown ({self.source})"
        if self.isa == "off":
            return "oneDNN off (TensorFlow's matmuls ran without oneDNN)"
        said = [f"oneDNN: {self.cpu_isa or 'no isa line'}"]
        said += [", ".join(f"{dtype} matmul {impl}" for dtype, impl in self.matmuls)] if self.matmuls else []
        return f"{self.label} ({'; '.join(said)})"

    def to_dict(self) -> Dict[str, Any]:
        """Returns ``{"isa", "label", "cpu_isa", "matmuls" (dict dtype -> implementation), "source"}``."""
        return {"isa": self.isa, "label": self.label, "cpu_isa": self.cpu_isa,
                "matmuls": dict(self.matmuls), "source": self.source}


def isa_of_info(text: str) -> str:
    """One of `ISAS` (or ``"unknown"``) for oneDNN's ``isa:`` text, e.g. ``"Intel AVX2"`` -> ``"avx2"``.

    AMX counts only with bfloat16 tiles ("Intel AMX with bfloat16 ..."); AVX-512 and
    AVX10 with bfloat16 are ``"avx512_bf16"`` ("Intel AVX2 with ... bfloat16 support" is
    AVX-NE-CONVERT, conversions only: ``"avx2"``).
    """
    if re.search(r"AMX with bfloat16", text):
        return "amx"
    wide = "AVX-512" in text or "AVX10" in text
    if wide:
        return "avx512_bf16" if "bfloat16" in text else "avx512"
    for needle, isa in (("AVX2", "avx2"), ("AVX", "avx"), ("SSE4.1", "sse41")):
        if needle in text:
            return isa
    return "unknown"


def isa_of_implementation(implementation: str) -> Optional[str]:
    """One of `ISAS` named by an implementation, e.g. ``"brg_matmul:avx512_core_amx"`` -> ``"amx"``; None when it names none (``"gemm:jit"``, ``"gemm_api"``)."""
    name = implementation.lower()
    if "amx" in name:
        return "amx"
    if re.search(r"avx512\w*(bf16|fp16)|avx10", name):
        return "avx512_bf16"
    for needle, isa in (("avx512", "avx512"), ("avx2", "avx2"), ("avx", "avx"), ("sse41", "sse41")):
        if needle in name:
            return isa
    return None


def _cap(isa: str, source_dtype: str) -> str:
    """The best ISA a matmul on `source_dtype` data can use when its implementation names none.

    oneDNN's JIT gemm follows the CPU's ISA, but float32 has no bfloat16 instructions
    and a gemm has no AMX tiles.
    """
    if isa not in ISAS:
        return isa
    ceiling = "avx512_bf16" if source_dtype == "bf16" else "avx512"
    return ISAS[min(ISAS.index(isa), ISAS.index(ceiling))]


def parse_verbose(text: str, finished: bool = True) -> OneDnnIsa:
    """Reads oneDNN's verbose lines (``ONEDNN_VERBOSE=1``) of the child's matmuls.

    Args:
        text: String. The child's standard output: oneDNN's ``onednn_verbose,...``
            lines (``dnnl_verbose`` and the older layout without ``v1,primitive`` too)
            among any others.
        finished: Bool. The child ran both matmuls (it printed `DONE`). When False
            and oneDNN printed nothing, the result is ``"unknown"``, not ``"off"``.

    Returns:
        `OneDnnIsa`: ``isa`` the best ISA over the matmul lines (an implementation
        naming none, such as ``gemm_api``, counts as the ``isa:`` line's ISA capped
        by `_cap`); with no matmul line, the ``isa:`` line's; ``"off"`` when oneDNN
        printed nothing in a finished child.
    """
    cpu_isa, found = "", []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if not fields[0].endswith("_verbose"):
            continue
        if "info" in fields and any(f.startswith("isa:") for f in fields):
            cpu_isa = line.split("isa:", 1)[1].strip()  # the text itself may hold commas
        elif "exec" in fields:
            at = fields.index("exec")
            kind, impl = (fields[at + 2:at + 4] + ["", ""])[:2]
            if kind in _MATMUL_KINDS:
                source = re.search(r"\bsrc[_:]([a-z0-9]+)", line)
                found.append((_dtype_of(line), impl or kind, source.group(1) if source else ""))
    if not cpu_isa and not found:
        return OneDnnIsa("off" if finished else "unknown", source="measured" if finished
                         else "failed: the child printed neither oneDNN's lines nor its end")
    from_info = isa_of_info(cpu_isa) if cpu_isa else "unknown"
    isas = [isa_of_implementation(impl) or _cap(from_info, src) for _, impl, src in found]
    known = [isa for isa in isas if isa in ISAS]
    best = max(known, key=ISAS.index) if known else (from_info if not found else "unknown")
    matmuls, seen = [], set()
    for dtype, impl, src in found:
        entry = (dtype, f"{impl} on {src}" if src else impl)
        if entry not in seen:
            seen.add(entry)
            matmuls.append(entry)
    return OneDnnIsa(best, cpu_isa, tuple(matmuls))


def _dtype_of(line: str) -> str:
    """Which of the child's matmuls (`SHAPES`) a verbose line is, by its inner size; ``"other"``."""
    for dtype, (_, inner, _) in SHAPES.items():
        if re.search(rf"x{inner}:{inner}x|ic{inner}oc", line):
            return dtype
    return "other"


#: The child: TensorFlow's C API from its shared libraries (no Python import of TensorFlow),
#: else ``import tensorflow`` without Keras (TensorFlow imports Keras only if it can).
_CHILD = r"""
import ctypes, importlib.util, os, sys
SHAPES = %(shapes)r
def by_c_api():
    root = os.path.dirname(importlib.util.find_spec("tensorflow").origin)
    names = {"darwin": ("libtensorflow_framework.2.dylib", "libtensorflow_cc.2.dylib")}.get(
        sys.platform, ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2"))
    libs = [ctypes.CDLL(os.path.join(root, n), mode=ctypes.RTLD_GLOBAL) for n in names]
    P, api = ctypes.c_void_p, libs[-1]
    def fn(name, res, *args):
        f = getattr(api, name); f.restype = res; f.argtypes = list(args); return f
    new_status = fn("TF_NewStatus", P); get_code = fn("TF_GetCode", ctypes.c_int, P)
    message = fn("TF_Message", ctypes.c_char_p, P)
    context = fn("TFE_NewContext", P, P, P); options = fn("TFE_NewContextOptions", P)
    allocate = fn("TF_AllocateTensor", P, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_size_t)
    data = fn("TF_TensorData", P, P); handle = fn("TFE_NewTensorHandle", P, P, P)
    new_op = fn("TFE_NewOp", P, P, ctypes.c_char_p, P); add_input = fn("TFE_OpAddInput", None, P, P, P)
    set_type = fn("TFE_OpSetAttrType", None, P, ctypes.c_char_p, ctypes.c_int)
    execute = fn("TFE_Execute", None, P, ctypes.POINTER(P), ctypes.POINTER(ctypes.c_int), P)
    resolve = fn("TFE_TensorHandleResolve", P, P, P)
    status = new_status()
    def check():
        if get_code(status):
            raise RuntimeError(message(status).decode())
    ctx = context(options(), status); check()
    def tensor(code, size, rows, cols):
        t = allocate(code, (ctypes.c_int64 * 2)(rows, cols), 2, rows * cols * size)
        ctypes.memset(data(t), 0, rows * cols * size)
        h = handle(t, status); check(); return h
    for code, size, dtype in ((14, 2, "bfloat16"), (1, 4, "float32")):  # TF_BFLOAT16, TF_FLOAT
        m, k, n = SHAPES[dtype]
        op = new_op(ctx, b"MatMul", status); check()
        add_input(op, tensor(code, size, m, k), status); add_input(op, tensor(code, size, k, n), status)
        check(); set_type(op, b"T", code)
        out, count = (P * 1)(), ctypes.c_int(1)
        execute(op, out, ctypes.byref(count), status); check()
        resolve(out[0], status); check()
def by_python():
    sys.modules["keras"] = None
    import tensorflow as tf
    for dtype in ("bfloat16", "float32"):
        m, k, n = SHAPES[dtype]
        tf.matmul(tf.zeros((m, k), dtype), tf.zeros((k, n), dtype)).numpy()
try:
    by_c_api()
except (OSError, AttributeError, RuntimeError, TypeError):
    by_python()
sys.stdout.flush()
print(%(done)r, flush=True)
"""


def start(env: Optional[Mapping[str, str]] = None) -> "subprocess.Popen[str]":
    """Starts the child (see the module docstring) and returns it; `finish` reads it.

    Args:
        env: Mapping or None. The child's environment; None copies this process's.
            ``ONEDNN_VERBOSE``/``DNNL_VERBOSE`` are set to 1, ``CUDA_VISIBLE_DEVICES`` to
            -1 (the matmuls run on the CPU; no GPU is initialized) and TensorFlow's C++
            logging is quietened.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.update(ONEDNN_VERBOSE="1", DNNL_VERBOSE="1", CUDA_VISIBLE_DEVICES="-1",
                     TF_CPP_MIN_LOG_LEVEL="3")
    code = _CHILD % {"shapes": SHAPES, "done": DONE}
    return subprocess.Popen([sys.executable, "-c", code], env=child_env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(child: "subprocess.Popen[str]", timeout_s: float = TIMEOUT_S) -> OneDnnIsa:
    """Waits for a child of `start` and parses its output; ``"unknown"`` when it failed or timed out."""
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        return OneDnnIsa("unknown", source=f"failed: the child took over {timeout_s:g} s")
    finished = DONE in out.splitlines()
    if child.returncode != 0 or not finished:
        last = (err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return OneDnnIsa("unknown", source=f"failed: {last[:200]}")
    return parse_verbose(out, finished=True)


_cache: Dict[Tuple[Optional[str], ...], OneDnnIsa] = {}
_pending: Dict[Tuple[Optional[str], ...], "subprocess.Popen[str]"] = {}
_cache_lock = threading.Lock()


def _env_key() -> Tuple[Optional[str], ...]:
    return tuple(os.environ.get(name) for name in ENV_KEYS)


def start_early() -> None:
    """Starts this process's reading now, for `detect` to finish: the command line calls it
    before importing TensorFlow, so the child runs beside that import."""
    key = _env_key()
    with _cache_lock:
        if key not in _cache and key not in _pending:
            _pending[key] = start()


def detect() -> OneDnnIsa:
    """This machine's `OneDnnIsa`, read once per process for each value of `ENV_KEYS`
    (report-only; a failed reading is not kept)."""
    key = _env_key()
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        child = _pending.pop(key, None)
    reading = finish(child if child is not None else start())
    if reading.source == "measured":
        with _cache_lock:
            _cache[key] = reading
    return reading
