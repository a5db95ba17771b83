"""The native decode kernels (gemv.c, moe.c, attn.c and mla.c over rows.h, rows_q4.h and attn.h; block.c, step.c;
sample.c, procs.c, logprobs.c: native_sample.py, native_run.py; pool.c): built once per machine with the system
C compiler, loaded with ctypes, and optional -- without a compiler, on a CPU without AVX-512 (their portable loops are
slower than torch's kernels; COLIBRI_NATIVE=force uses them anyway), or with COLIBRI_NATIVE=0, the model keeps
torch's kernels, with the same results up to f32 summation order.

Why a C file and not torch: torch's weight-only int8 kernel moves expert-sized matrices (0.5-2 MiB)
from RAM at a third of the machine's bandwidth, and its int4 kernel needs a private repacking that a
weight streamed from disk pays for on every cache miss. These kernels read the canonical layouts.

The library goes to $COLIBRI_CACHE (default ~/.cache/colibri)/kernels/, named by a hash of the
source, the compiler flags and the machine's CPU flags; `-march=native` is used (the code never asks
for AMX tile instructions). The kernels split their work over their own thread pool (pool.c says
why not OpenMP); `set_threads` sizes it, and the engine calls it with torch.set_num_threads.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("colibri")

_SRCS = [Path(__file__).with_name(n) for n in ("pool.c", "gemv.c", "moe.c", "route.c", "attn.c", "block.c",
                                                        "mla.c", "step.c", "sample.c", "procs.c", "logprobs.c",
                                                        "delta.c", "conv.c", "mamba.c", "mamba1.c", "lightning.c",
                                                        "kda.c", "msa.c", "kvq.c", "reuse.c")]
_HDRS = [Path(__file__).with_name(n) for n in ("common.h", "rows.h", "rows_q4.h", "attn.h", "vmath.h")]
# -ffp-contract=off: a * b + c is two roundings unless the code asks for an FMA, as in torch's f32 math
# (the int4 dequantization then gives quant.dequantize's bits).
_FLAGS = ["-O3", "-march=native", "-pthread", "-fPIC", "-shared", "-std=c11", "-fno-strict-aliasing",
          "-ffp-contract=off"]
_LIBS = ["-lm"]
# Rows (tokens) up to which a whole MoE layer runs in one native call (decode batches and short prompt
# chunks: each expert's weights are read once for all its rows, no Python loop over experts); beyond it
# the experts run one module at a time on torch's GEMMs. 64 measured best on the 0.44b int8/int4 models
# (prefill of 16-64 tokens 1.3-1.7x faster than at 8; /tmp scripts over generate_ids, noisy VM).
MOE_MAX_ROWS = 64
MAX_GROUPS = 64  # router groups coli_route keeps apart (route.c MAX_GROUPS)
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_error = ""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def _cache_dir() -> Path:
    root = os.environ.get("COLIBRI_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "colibri")
    return Path(root) / "kernels"


def _build(cc: str) -> Path:
    src = b"".join(p.read_bytes() for p in _SRCS + _HDRS)
    flags = _FLAGS + os.environ.get("COLIBRI_NATIVE_CFLAGS", "").split()  # e.g. -mno-avx512vnni
    key = hashlib.sha256(src + " ".join(flags).encode() + _cpu_flags().encode() + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"colibri-kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build to a temporary name and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *flags, *map(str, _SRCS), "-o", tmp, *_LIBS]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


class QW(ctypes.Structure):
    """coli_qw: one quantized weight's tensors (int8: q, scale; int4: q, scale, min)."""

    _fields_ = [("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("m", ctypes.c_void_p)]


class Tail(ctypes.Structure):
    """coli_tail (step.c): a model's bf16 embedding, final norm and quantized head for coli_decode_step."""

    _fields_ = [("embed", ctypes.c_void_p), ("vocab_in", ctypes.c_long), ("norm_w", ctypes.c_void_p),
                ("eps", ctypes.c_float), ("head", QW), ("scheme", ctypes.c_int), ("group", ctypes.c_int),
                ("vocab", ctypes.c_int), ("norm_b", ctypes.c_void_p), ("head_b", ctypes.c_void_p)]


# common.h coli_layer_hook: (layer, event, idx int64 [n], n, residual bf16 pointer, pred int64 [np], np) -> int
LAYER_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
                              ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int)
HOOK_ROUTED, HOOK_WAIT = 0, 1


class MoeLayer(ctypes.Structure):
    """coli_moe_layer (step.c): one resident routed-expert layer's constants for coli_decode_layers."""

    _fields_ = [("inter", ctypes.c_int), ("n_experts", ctypes.c_int), ("k", ctypes.c_int), ("norm", ctypes.c_int),
                ("scheme", ctypes.c_int), ("group", ctypes.c_int), ("router", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("scale", ctypes.c_float), ("shared", ctypes.c_void_p), ("kind", ctypes.c_int),
                ("act", ctypes.c_void_p), ("n_group", ctypes.c_int), ("topk_group", ctypes.c_int),
                ("out_w", ctypes.c_void_p), ("out_eps", ctypes.c_float),  # (AFMoE: the output's RMSNorm)
                ("hook", LAYER_HOOK), ("layer", ctypes.c_int), ("ahead", ctypes.c_int)]  # (engine/stream_hook.py)


# coli_route's rules (common.h): softmax top-k; sigmoid scores chosen with a bias (GLM-4.5, MiniMax-M2);
# softmax probabilities chosen with a bias, renormalised over max(sum, floor) (ERNIE-4.5); the top k of
# biased logits, softmax over those k (gpt-oss)
(ROUTE_SOFTMAX, ROUTE_SIGMOID, ROUTE_SOFTMAX_BIAS, ROUTE_TOPK_SOFTMAX, ROUTE_SPARSEMIXER,
 ROUTE_LOGIT_BIAS_SIGMOID) = range(6)
ACT_SILU, ACT_CLAMPED, ACT_GELU_TANH, ACT_RELU2 = 0, 1, 2, 3  # the routed experts' activation (common.h
# coli_expert_act; ACT_RELU2: no gate, gate_up holds the up rows alone)


class ExpertAct(ctypes.Structure):
    """coli_expert_act (common.h): the experts' activation (kind, alpha, limit) and per-expert bias tables."""

    _fields_ = [("kind", ctypes.c_int), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("gu_bias", ctypes.c_void_p), ("dn_bias", ctypes.c_void_p),
                ("input_scaled", ctypes.c_int)]  # Llama 4: coli_moe_block scales the expert's input by the score


class Mlp(ctypes.Structure):
    """coli_mlp (moe.c): a dense SwiGLU MLP's projections (a dense layer, a shared expert), optionally gated."""

    _fields_ = [("inter", ctypes.c_int), ("scheme", ctypes.c_int), ("group", ctypes.c_int), ("gated", ctypes.c_int),
                ("gate", QW), ("up", QW), ("down", QW), ("sgate", QW), ("act", ctypes.c_int),  # (ACT_SILU / GELU)
                ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]  # (ACT_CLAMPED's)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    returns_int = {  # name: argument types (None: left undeclared, no arguments)
        "coli_decode_layers": [i, p, p, i, p, p, p, p, n, n, i, p, p, n, p, p, p],
        "coli_decode_step": [p, p, i, p, p, i, p, p, p, n, n, i, p, p, n, p, p, p, p, i, p],
        "coli_route": [p, i, i, i, p, i, i, i, i, i, i, p, f, p, p],
        "coli_moe_block": [p, p, i, i, i, p, i, i, i, i, i, i, p, f, p, p, i, i, p, p, p, p, p, p, p, f],
        "coli_mlp_rows": [p, p, i, i, p], "coli_attn_block": [p, i, p, p, p, p, n, n, i, p, p, p, p],
        "coli_moe": [p, i, i, i, i, i, p, p, i, p, p, i, i, p, p, p], "coli_q8_gemm": [p, i, i, i, p, p, i, p],
        "coli_q4_gemm": [p, i, i, i, p, p, p, i, i, p], "coli_max_rows": None, "coli_simd": None,
        "coli_set_threads": [i], "coli_get_threads": None,
        "coli_attn_decode": [p, i, i, i, i, i, p, n, p, n, i, f, p, p, i],
        "coli_attn_rows": [i, p, i, i, i, i, i, p, n, p, n, p, f, p, p, i], "coli_rmsnorm": [p, i, n, i, p, f, p],
        "coli_kv_quantize": [p, i, n, i, i, p, n],
        "coli_layernorm": [p, i, n, i, p, p, f, p], "coli_rope": [p, i, i, i, i, i, p, p, p],
        "coli_q4_dequant": [p, p, p, i, i, i, i, p]}
    returns_nothing = {"coli_background_wait": [], "coli_gate_mul": [p, p, n],
                       "coli_softplus_gate_mul": [p, p, n, i, i, i]}
    for table, res in ((returns_int, i), (returns_nothing, None)):
        for name, args in table.items():
            fn = getattr(lib, name)
            if args is not None:
                fn.argtypes = args
            fn.restype = res


def lib() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, a failed build, a CPU without AVX-512 -- unless
    COLIBRI_NATIVE=force --, or COLIBRI_NATIVE=0). The first call builds; later calls are free."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            if os.environ.get("COLIBRI_NATIVE", "1") == "0":
                raise RuntimeError("disabled by COLIBRI_NATIVE=0")
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                raise RuntimeError("no C compiler found (cc/gcc)")
            so = _build(cc)
            lib_ = ctypes.CDLL(str(so))
            _declare(lib_)
            if not lib_.coli_simd() and os.environ.get("COLIBRI_NATIVE") != "force":
                raise RuntimeError("this CPU has no AVX-512: the kernels' portable loops are slower than torch's "
                                   "(COLIBRI_NATIVE=force uses them anyway)")
            lib_.coli_set_threads(torch.get_num_threads())
            _lib = lib_
            atexit.register(lib_.coli_background_wait)  # (before Python frees the weights it may be reading)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _error = str(e)
            log.info("native kernels unavailable (%s); using torch's", e)
        _tried = True
    return _lib


def available() -> bool:
    return lib() is not None


def why_unavailable() -> str:
    lib()
    return _error


def int8_activations() -> bool:
    """Whether bf16 steps quantize activations to int8 (the VNNI paths; docs/QUANT.md, "Decode numerics")."""
    return available() and bool(_lib.coli_simd() & 2)


# common.h's stage timers (compiled in with COLIBRI_NATIVE_CFLAGS=-DCOLI_PROF), in its enum's order.
PROF_STAGES = ("rmsnorm in", "q/k/v", "rope + kv write", "attention", "o_proj", "rmsnorm post", "routing",
               "expert inputs", "gate_up", "silu-glu", "down", "weighted sum", "norm + head")


def prof_counters() -> tuple[dict[str, float], int] | None:
    """{stage: seconds} and the one-call steps counted since the last call (then zeroed), or None when
    the kernels were built without -DCOLI_PROF or are not in use."""
    if _lib is None:
        return None
    try:
        arr = (ctypes.c_long * (len(PROF_STAGES) + 1)).in_dll(_lib, "coli_prof")
    except ValueError:
        return None
    out = {name: arr[i] / 1e9 for i, name in enumerate(PROF_STAGES)}
    steps = arr[len(PROF_STAGES)]
    for i in range(len(PROF_STAGES) + 1):
        arr[i] = 0
    return out, steps


def background_wait() -> None:
    """Stop the kernels' background work (a decode step's read-ahead of the next step's first weights,
    kernels/step.c) and return once it is over: call it before freeing or moving weights it may read."""
    if _lib is not None:
        _lib.coli_background_wait()


def set_threads(n: int) -> None:
    """Threads each native kernel call uses (the calling thread included)."""
    if lib() is not None:
        _lib.coli_set_threads(int(n))


def get_threads() -> int:
    return _lib.coli_get_threads() if lib() is not None else 1


def max_rows() -> int:
    lb = lib()
    return lb.coli_max_rows() if lb is not None else 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def q8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] f32/bf16 contiguous, q int8 [N, K], scale f32 [N] -> [T, N] in x's dtype."""
    T, K = x.shape
    N = q.shape[0]
    y = torch.empty(T, N, dtype=x.dtype)
    rc = _lib.coli_q8_gemm(_ptr(x), int(x.dtype == torch.bfloat16), T, K, _ptr(q), _ptr(scale), N, _ptr(y))
    if rc != 0:
        raise RuntimeError(f"coli_q8_gemm failed ({rc})")
    return y


def q4_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [T, K] f32/bf16 contiguous, q uint8 [N, K/2], scale/min f16 [N, K/g] -> [T, N] in x's dtype."""
    T, K = x.shape
    N = q.shape[0]
    y = torch.empty(T, N, dtype=x.dtype)
    rc = _lib.coli_q4_gemm(_ptr(x), int(x.dtype == torch.bfloat16), T, K, _ptr(q), _ptr(scale), _ptr(mn),
                           group_size, N, _ptr(y))
    if rc != 0:
        raise RuntimeError(f"coli_q4_gemm failed ({rc})")
    return y


def qw(m) -> tuple[int, int, int]:
    """A native QLinear's (q, scale, min) pointers, for `MoeTables`."""
    mn = getattr(m, "min", None)
    return m.qweight.data_ptr(), m.scale.data_ptr(), mn.data_ptr() if mn is not None else 0


class MoeTables:
    """A layer's expert pointer tables for coli_moe (gate_up and down per expert id), kept across
    steps: a resident layer fills each entry once; a cached layer sets one entry per delivered expert
    and clears it after its call (a cache slot's memory is only valid until the next expert)."""

    def __init__(self, n_experts: int, act: tuple[int, float, float] = (ACT_SILU, 0.0, 0.0),
                 input_scaled: bool = False):
        self.n = n_experts
        self.gu, self.dn = (QW * n_experts)(), (QW * n_experts)()
        self.gub, self.dnb = (ctypes.c_void_p * n_experts)(), (ctypes.c_void_p * n_experts)()  # bf16 biases
        self.act = ExpertAct(*act, ctypes.addressof(self.gub), ctypes.addressof(self.dnb), int(input_scaled))
        self.owner: list[tuple[int, int] | None] = [None] * n_experts  # (id(gate_up), id(down)) per entry
        self.scheme, self.group_size = "", 0  # of a table holding a whole layer (Experts.native_tables)
        self.biased = False  # some entry has a bias (then the kernel gets `act`, as for another activation)
        self.live = False  # entries come and go (a cache's table): `act` always, whatever they hold now
        self._made: dict[tuple[int, int], tuple] = {}  # (id(gate_up), id(down)) -> (the modules, their entries)

    def set(self, e: int, gate_up, down) -> None:
        key = (id(gate_up), id(down))
        if self.owner[e] != key:
            # (a cache slot keeps its modules and their buffers: their entries are made once per slot)
            got = self._made.get(key)
            if got is None or got[0] is not gate_up or got[1] is not down:
                if len(self._made) > 4 * self.n:  # (modules rebuilt: forget the old ones)
                    self._made.clear()
                bu, bd = getattr(gate_up, "bias", None), getattr(down, "bias", None)
                got = self._made[key] = (gate_up, down, QW(*qw(gate_up)), QW(*qw(down)),
                                         *(None if b is None else b.data_ptr() for b in (bu, bd)))
                self.biased = self.biased or bu is not None or bd is not None
            _, _, self.gu[e], self.dn[e], self.gub[e], self.dnb[e] = got
            self.owner[e] = key

    def clear(self, e: int) -> None:
        self.gu[e], self.dn[e] = QW(), QW()
        self.gub[e] = self.dnb[e] = None
        self.owner[e] = None

    def act_ptr(self):
        """What the kernels get for `act`: None for plain SiLU-GLU without biases (the common case)."""
        plain = not (self.biased or self.live) and self.act.kind == ACT_SILU and not self.act.input_scaled
        return None if plain else ctypes.byref(self.act)


def moe(tables: MoeTables, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, intermediate: int,
        scheme: str, group_size: int, ys: torch.Tensor, combine: bool = True) -> torch.Tensor | None:
    """coli_moe: the slots whose expert has an entry in `tables` (the kernel skips the others).
    x [T, H] f32/bf16 contiguous, idx [T, k] int64, weights [T, k] f32, ys [T*k, H] f32 scratch that
    keeps the slots' outputs between calls -> [T, H] in x's dtype when `combine`, else None."""
    T, H = x.shape
    y = torch.empty(T, H, dtype=x.dtype) if combine else None
    rc = _lib.coli_moe(x.data_ptr(), int(x.dtype == torch.bfloat16), T, H, intermediate, idx.shape[1],
                       idx.data_ptr(), weights.data_ptr(), tables.n, tables.gu, tables.dn,
                       8 if scheme == "int8" else 4, group_size, ys.data_ptr(), None if y is None else y.data_ptr(),
                       tables.act_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_moe failed ({rc})")
    return y


def route(x: torch.Tensor, w: torch.Tensor, k: int, norm: bool, bias: torch.Tensor | None = None, scale: float = 1.0,
          kind: int | None = None, groups: tuple[int, int] = (1, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """coli_route: top-k routing of x [T, H] (bf16/f32 contiguous) by w f32 [E, H] contiguous -> (idx int64
    [T, k], weights f32 [T, k]), largest first. ROUTE_SOFTMAX (the kind without `bias`): softmax, renormalised
    when `norm`; ROUTE_SIGMOID (the kind with `bias`, f32 [E] contiguous): sigmoid scores chosen by score +
    bias, weighted by the scores (renormalised when `norm`) times `scale`; ROUTE_SOFTMAX_BIAS: softmax
    probabilities chosen by probability + bias, weighted by the probabilities over max(their sum, `scale`) when
    `norm`, else times `scale`;
    ROUTE_LOGIT_BIAS_SIGMOID: chosen by logit + bias, weighted by sigmoid(logit) (renormalised when `norm`). groups
    (n_group, topk_group): the choice limited to the best topk_group of n_group groups first (ROUTE_SOFTMAX: a
    group's best probability; ROUTE_SIGMOID: the sum of its two best score + bias)."""
    T, H = x.shape
    kind = (ROUTE_SOFTMAX if bias is None else ROUTE_SIGMOID) if kind is None else kind
    idx = torch.empty(T, k, dtype=torch.int64)
    wts = torch.empty(T, k, dtype=torch.float32)
    rc = _lib.coli_route(x.data_ptr(), int(x.dtype == torch.bfloat16), T, H, w.data_ptr(), w.shape[0], k, int(norm),
                         kind, *groups, None if bias is None else bias.data_ptr(), scale, idx.data_ptr(),
                         wts.data_ptr())
    if rc != 0:
        raise RuntimeError("router: non-finite logits" if rc == -5 else f"coli_route failed ({rc})")
    return idx, wts


def bias_ok(m) -> bool:
    """A QLinear's bias is one the kernels add (as its own forward does, bf16 + bf16): none, or bf16 on the CPU."""
    b = m.bias
    return b is None or (b.dtype == torch.bfloat16 and b.device.type == "cpu" and b.is_contiguous() and b.dim() == 1)


def mlp(m: Mlp, x: torch.Tensor) -> torch.Tensor:
    """coli_mlp_rows: the MLP `m` of x [T, H] bf16 contiguous -> [T, H] bf16."""
    T, H = x.shape
    y = torch.empty(T, H, dtype=torch.bfloat16)
    rc = _lib.coli_mlp_rows(ctypes.byref(m), x.data_ptr(), T, H, y.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_mlp_rows failed ({rc})")
    return y


def moe_block(tables: MoeTables, x: torch.Tensor, h: torch.Tensor, router: torch.Tensor, k: int, norm: bool,
              intermediate: int, scheme: str, group_size: int, bias: torch.Tensor | None = None, scale: float = 1.0,
              kind: int | None = None, shared: Mlp | None = None, groups: tuple[int, int] = (1, 1),
              out_norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """coli_moe_block: route x [T, H] bf16 (the normed rows) as `route` does, run a resident layer's
    experts (every entry of `tables` set) as `moe` does, plus the `shared` MLP as `mlp` does, RMS-norm that with
    `out_norm` (f32 weights, eps) if given, add to h [T, H] bf16 -> (h_out, idx, weights)."""
    T, H = x.shape
    kind = (ROUTE_SOFTMAX if bias is None else ROUTE_SIGMOID) if kind is None else kind
    idx = torch.empty(T, k, dtype=torch.int64)
    wts = torch.empty(T, k, dtype=torch.float32)
    ys = torch.empty(T * k, H, dtype=torch.float32)
    h_out = torch.empty_like(h)
    rc = _lib.coli_moe_block(x.data_ptr(), h.data_ptr(), T, H, intermediate, router.data_ptr(), router.shape[0], k,
                             int(norm), kind, *groups, None if bias is None else bias.data_ptr(), scale, tables.gu,
                             tables.dn,
                             8 if scheme == "int8" else 4, group_size,
                             idx.data_ptr(), wts.data_ptr(), ys.data_ptr(), h_out.data_ptr(),
                             None if shared is None else ctypes.byref(shared), tables.act_ptr(),
                             *((None, 0.0) if out_norm is None else (out_norm[0].data_ptr(), out_norm[1])))
    if rc != 0:
        raise RuntimeError("router: non-finite logits" if rc == -5 else f"coli_moe_block failed ({rc})")
    return h_out, idx, wts


def _routes(L: int, T: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a one-call step writes each layer's routes into: idx int64, weights f32 [L, T, k]."""
    return torch.empty(L, T, k, dtype=torch.int64), torch.empty(L, T, k, dtype=torch.float32)


class HookFailed(RuntimeError):
    """A layer hook failed inside a native call (its own error is the hook's to raise)."""


def _step_failed(name: str, rc: int, failed: ctypes.c_int) -> RuntimeError:
    if rc == COLI_HOOK_FAILED:
        return HookFailed(f"{name}: the hook of layer {failed.value} failed")
    return RuntimeError(f"layer {failed.value}: router: non-finite logits" if rc == -5
                        else f"{name} failed ({rc}) in layer {failed.value}")


COLI_MISS = -7  # common.h: a route to an expert a cached layer's table lacks
COLI_HOOK_FAILED = -8  # common.h: a layer's hook returned a failure


def decode_layers(attn, moe, h: torch.Tensor, pos, kc, vc, ks: int, vs: int, rope: tuple[int, int, int],
                  k: int, partial: bool = False, first: int = 0,
                  kvt: int = 0) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """coli_decode_layers: every block of a model whose layers all take the fused blocks. attn/moe: ctypes
    arrays of native_block.AttnLayer / MoeLayer [L]; h [T, hidden] bf16 contiguous, replaced in place by the last
    block's output; pos ctypes int [T]; kc/vc ctypes pointer arrays [L * T] (layer l's row t at l * T + t); rope
    the rotary tables (cos pointer, sin pointer, rows: f32 [rows, rot], row p position p's) ->
    (idx int64 [L, T, k], weights f32 [L, T, k], None). From layer `first` on only (h its input; the rows
    of the layers before it not written); with `partial`, a layer routed to an expert its table lacks stops
    the call with h that layer's input: (idx, weights, that layer), the rows from `first` up to it valid. kvt: the
    caches' row types (attn_block's), the same in every layer."""
    L, T = len(attn), h.shape[0]
    idx, wts = _routes(L, T, k)
    failed = ctypes.c_int(-1)
    ptr = ctypes.sizeof(ctypes.c_void_p)
    rc = _lib.coli_decode_layers(L - first, ctypes.byref(attn, first * ctypes.sizeof(attn._type_)),
                                 ctypes.byref(moe, first * ctypes.sizeof(MoeLayer)), T, h.data_ptr(), pos,
                                 ctypes.byref(kc, first * T * ptr), ctypes.byref(vc, first * T * ptr), ks, vs, kvt,
                                 *rope, idx[first:].data_ptr(), wts[first:].data_ptr(), ctypes.byref(failed))
    if rc == COLI_MISS and partial:
        return idx, wts, first + failed.value
    if rc != 0:
        failed.value += first
        raise _step_failed("coli_decode_layers", rc, failed)
    return idx, wts, None


def decode_step(tail, tokens: torch.Tensor, attn, moe, pos, kc, vc, ks: int, vs: int, rope: tuple[int, int, int],
                k: int, rows: torch.Tensor, kvt: int = 0,
                partial: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """coli_decode_step: embedding, every block (as decode_layers), final norm and head for `rows` (int64
    [R], contiguous) of the step's tokens (int64 [T], contiguous) -> (logits f32 [R, V], idx, weights); with
    `partial`, None where a layer was routed to an expert its table lacks."""
    idx, wts = _routes(len(attn), tokens.shape[0], k)
    logits = torch.empty(rows.shape[0], tail.vocab, dtype=torch.float32)
    failed = ctypes.c_int(-1)
    rc = _lib.coli_decode_step(ctypes.byref(tail), tokens.data_ptr(), len(attn), attn, moe, tokens.shape[0], pos, kc,
                               vc, ks, vs, kvt, *rope, idx.data_ptr(), wts.data_ptr(), ctypes.byref(failed),
                               rows.data_ptr(), rows.shape[0], logits.data_ptr())
    if rc == -6:
        raise IndexError(f"token id out of range (vocabulary of {tail.vocab_in})")
    if rc == COLI_MISS and partial:
        return None
    if rc != 0:
        raise _step_failed("coli_decode_step", rc, failed)
    return logits, idx, wts


def layernorm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] bf16/f32, w and b [H] f32 -> LayerNorm(x) * w + b, in x's dtype (one rounding)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.coli_layernorm(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // x.shape[-1], x.shape[-1],
                        w.data_ptr(), b.data_ptr(), eps, out.data_ptr())
    return out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] bf16/f32, w [H] f32 -> w * x / rms(x), in x's dtype (one rounding)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _lib.coli_rmsnorm(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // x.shape[-1], x.shape[-1],
                      w.data_ptr(), eps, out.data_ptr())
    return out


def gate_mul(x: torch.Tensor, g: torch.Tensor, softplus_heads: int = 0) -> torch.Tensor:
    """x * sigmoid(g) for bf16 tensors of one shape, or x [T, H*D] * softplus(g) (`softplus_heads` H; g [T, H]: a gate a
    head, or like x), each factor rounded to bf16 as torch's ops: a new tensor."""
    out, g = x.contiguous().clone(), g.contiguous()
    if softplus_heads:
        _lib.coli_softplus_gate_mul(out.data_ptr(), g.data_ptr(), x.shape[0], softplus_heads,
                                    x.shape[1] // softplus_heads, int(g.shape[1] == softplus_heads))
    else:
        _lib.coli_gate_mul(out.data_ptr(), g.data_ptr(), out.numel())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """x [T, nh, D] bf16/f32; cos/sin f32 [T, rot] contiguous -> x with its first `rot` channels of every
    head rotated (rotate-half convention), in x's dtype."""
    x = x.contiguous()
    T, nh, D = x.shape
    out = torch.empty_like(x)
    _lib.coli_rope(x.data_ptr(), int(x.dtype == torch.bfloat16), T, nh, D, rot, cos.data_ptr(), sin.data_ptr(),
                   out.data_ptr())
    return out


def q4_dequant(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """Canonical int4 rows (q uint8 [R, K/2], scale/min f16 [R, K/g], contiguous) -> [R, K] in dtype
    (f32 or bf16): q * scale + min in f32, rounded once -- quant.dequantize's bits, in one pass."""
    R, K = q.shape[0], q.shape[1] * 2
    out = torch.empty(R, K, dtype=dtype)
    rc = _lib.coli_q4_dequant(q.data_ptr(), scale.data_ptr(), mn.data_ptr(), R, K, group_size,
                              int(dtype == torch.bfloat16), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"coli_q4_dequant failed ({rc})")
    return out
