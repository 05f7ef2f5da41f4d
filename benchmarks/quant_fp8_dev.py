"""Large-T FP8 experiments on the GPU: how fast can a block-scaled e4m3 grouped GEMM go here, and what limits ours.

    OUT=<dir> python3 benchmarks/quant_fp8_dev.py [--budget-s 200]
    TRITON_INTERPRET=1 python benchmarks/quant_fp8_dev.py --cpu-smoke   # correctness of the dev kernel only

Sections (one call, a short table last, everything in $OUT/quant_fp8_dev.json):
1. Rates: bf16 ``torch.mm`` and e4m3 ``torch._scaled_mm`` per tensor at 8192^3; at DeepSeek's GEMM sizes, e4m3
   per tensor and, where torch has it, with DeepSeek's block scales (1x128 activations, 128x128 weights).
2. The DeepSeek down GEMM as one dense problem (4096 rows, one expert), then T=4096 on the grid's shapes (the
   down GEMM, and gate_up as one plain GEMM of 2I rows): the shipped kernel (``ops.projection``) with its tuned
   tiles against the dev kernel's variants.

The dev kernel (``_dev_kernel``) is a grouped block-scaled GEMM over expert blocks whose activation rows are
stored in block order (``GATHER`` False: ``ops.quantize_rows(slots=...)``, as the shipped TMA path) or
gathered through the sorted pair index (as the shipped pointer path does). Variants: weights (and contiguous
activations) through TMA descriptors; LAG (each K tile's dot is scaled one step later, so the tensor cores can
run the next tile's dot while the CUDA cores scale this one); Triton's warp specialisation of the K loop.
Every variant is checked against a float64 reference before it is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the TMA variants are skipped
    TensorDescriptor = None

SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (256, 7168, 2048, 8),
          "mixtral-8x7b": (8, 4096, 14336, 2), "qwen1.5-moe-a2.7b": (60, 2048, 1408, 4)}  # fmt: skip


@triton.jit
def _dev_kernel(a_ptr, a_desc, as_ptr, w_ptr, w_desc, ws_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                num_rows, N, K, num_blocks_m, stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn,
                stride_om,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, GATHER: tl.constexpr,
                TMA_A: tl.constexpr, TMA_W: tl.constexpr, LAG: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    """out[r, n] = sum over K tiles of dot(A8[r], W8[e, n]) * as[r, kt] * ws[e, n // 128, kt], bf16 out."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BM + tl.arange(0, BM)
    if GATHER:
        rows = tl.load(sorted_ptr + offs_m)
        a_rows = tl.where(rows < num_rows, rows, 0).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_se
    if BN <= 128:  # the tile lies in one 128-row scale block
        s_rows = (pid_n * BN) // 128 + offs_n * 0
    else:
        s_rows = offs_n // 128
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    d_prev = tl.zeros([BM, BN], dtype=tl.float32)
    s_prev = tl.zeros([BM], dtype=tl.float32)
    ws_prev = tl.zeros([BN], dtype=tl.float32)
    for kt in tl.range(0, tl.cdiv(K, BK), warp_specialize=WS):
        k0 = kt * BK
        if TMA_A:
            a = a_desc.load([pid_m * BM, k0])
        else:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :])
        if TMA_W:
            b = w_desc.load([(expert * N + pid_n * BN).to(tl.int32), k0]).T
        else:
            b = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None])
        sa = tl.load(as_ptr + a_rows * stride_asm + kt)
        sw = tl.load(s_base + s_rows * stride_sn + kt)
        d = tl.dot(a, b)
        if LAG:
            acc += d_prev * s_prev[:, None] * ws_prev[None, :]
            d_prev = d
            s_prev = sa
            ws_prev = sw
        else:
            acc += d * sa[:, None] * sw[None, :]
    if LAG:
        acc += d_prev * s_prev[:, None] * ws_prev[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(tl.bfloat16))


def random_weights(e: int, n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=dev)
    for j in range(e):
        w[j] = (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
    s = torch.rand(e, n // 128, k // 128, device=dev) * 1e-3 + 1e-3
    return w, s


class Problem:
    """A grouped GEMM: `pairs` activation rows routed to experts, in block order for the dev kernel."""

    def __init__(self, ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bm: int) -> None:
        self.e, self.n, self.k = w.shape
        self.ids, self.w, self.ws, self.bm = ids, w, ws, bm
        from selector.plugins.quant_kernels import ops

        self.xq, self.xs = ops.quantize_rows(x, 128)  # pair order (the gathering variants)
        routing = ops.route("grouped", ids, self.e, {"BLOCK_M": bm, "ROUTE": "sorted"})
        self.sorted_rows, self.block_expert = routing[0], routing[1]
        self.aq, self.as_ = ops.quantize_rows(x, 128, slots=routing, a_div=1)  # block order, as the shipped path
        self.out = torch.empty(self.aq.shape[0], self.n, dtype=torch.bfloat16, device=x.device)

    def flops(self) -> float:
        return 2.0 * self.ids.numel() * self.n * self.k

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        """float64 result of the given pair rows (dequantised operands)."""
        a = self.xq[rows].double() * self.xs[rows].double().repeat_interleave(128, 1)
        out = torch.empty(rows.numel(), self.n, dtype=torch.float64, device=a.device)
        for j, r in enumerate(rows.tolist()):
            e = int(self.ids[r])
            w = self.w[e].double() * self.ws[e].double().repeat_interleave(128, 0).repeat_interleave(128, 1)
            out[j] = w @ a[j]
        return out

    def dev_fn(self, bn: int, warps: int, stages: int, gather: bool, tma_a: bool, tma_w: bool, lag: bool, ws: bool,
               group_m: int = 8):  # fmt: skip
        a_src = self.xq if gather else self.aq
        as_src = self.xs if gather else self.as_
        a_desc = w_desc = a_src
        if tma_a:
            a_desc = TensorDescriptor.from_tensor(self.aq, [self.bm, 128])
        if tma_w:
            w_desc = TensorDescriptor.from_tensor(self.w.view(self.e * self.n, self.k), [bn, 128])
        nb = self.block_expert.numel()
        grid = (nb * triton.cdiv(self.n, bn),)

        def run():
            _dev_kernel[grid](a_src, a_desc, as_src, self.w, w_desc, self.ws, self.out, self.sorted_rows,
                              self.block_expert, self.ids.numel(), self.n, self.k, nb, a_src.stride(0),
                              as_src.stride(0), self.w.stride(0), self.w.stride(1), self.ws.stride(0),
                              self.ws.stride(1), self.out.stride(0), BM=self.bm, BN=bn, BK=128, GROUP_M=group_m,
                              GATHER=gather, TMA_A=tma_a, TMA_W=tma_w, LAG=lag, WS=ws, num_warps=warps,
                              num_stages=stages)  # fmt: skip
            return self.out

        return run

    def check_dev(self, fn, samples: int = 24) -> float:
        """Max relative error (Frobenius, per row) of the dev output against float64 on sampled pairs."""
        out = fn()
        used = self.block_expert.repeat_interleave(self.bm) >= 0  # unused blocks' slots hold anything
        pos = torch.nonzero(used & (self.sorted_rows >= 0) & (self.sorted_rows < self.ids.numel())).flatten()
        pick = pos[torch.randperm(pos.numel(), device=pos.device)[:samples]]
        ref = self.reference(self.sorted_rows[pick].long())
        got = out[pick].double()
        return float(((got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-30)).max())


def timeit(fn) -> float:  # noqa: ANN001
    return float(triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")) * 1e-3


def shipped_fn(prob: Problem, config: dict):
    from selector.plugins.quant_kernels import ops

    routing = ops.route("grouped", prob.ids, prob.e, {"BLOCK_M": prob.bm, "ROUTE": "sorted"})
    return lambda: ops.projection("grouped", prob.xq, prob.w, prob.ws, routing, prob.ids.numel(), a_div=1,
                                  num_experts=prob.e, fp4=False, ue8m0=False, block_n=128, block_k=128,
                                  config=config, a_scale=prob.xs, out_dtype=torch.bfloat16)  # fmt: skip


VARIANTS = [  # (name, gather, tma_a, tma_w, lag, ws)
    ("ptr", False, False, False, False, False),
    ("gather", True, False, False, False, False),
    ("ptr+lag", False, False, False, True, False),
    ("tmaW", False, False, True, False, False),
    ("tmaA+W", False, True, True, False, False),
    ("tmaA+W+lag", False, True, True, True, False),
    ("gather+tmaW", True, False, True, False, False),
    ("gather+tmaW+lag", True, False, True, True, False),
    ("tmaA+W+ws", False, True, True, False, True),
]
TILES = [(64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3)]  # (BM, BN, warps, stages)


def run_problem(tag: str, prob_for_bm, shipped_cfgs: list[dict], results: list, deadline: float, log) -> None:  # noqa: ANN001
    best = {}
    for cfg in shipped_cfgs:
        if time.perf_counter() > deadline:
            return
        prob = prob_for_bm(cfg["BLOCK_M"])
        try:
            fn = shipped_fn(prob, cfg)
            t = timeit(fn)
            rec = {"problem": tag, "kernel": "shipped", "config": cfg, "time_us": t * 1e6,
                   "tflops": prob.flops() / t / 1e12}  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            rec = {"problem": tag, "kernel": "shipped", "config": cfg, "error": f"{type(exc).__name__}: {exc}"[:300]}
        results.append(rec)
        log(json.dumps(rec))
    for bm, bn, warps, stages in TILES:
        prob = prob_for_bm(bm)
        for name, gather, tma_a, tma_w, lag, ws in VARIANTS:
            if time.perf_counter() > deadline:
                return
            if (tma_a or tma_w) and TensorDescriptor is None:
                continue
            rec = {"problem": tag, "kernel": "dev", "variant": name, "BM": bm, "BN": bn, "warps": warps,
                   "stages": stages}  # fmt: skip
            try:
                fn = prob.dev_fn(bn, warps, stages, gather, tma_a, tma_w, lag, ws)
                rec["rel_err"] = prob.check_dev(fn)
                if rec["rel_err"] > 0.02:
                    raise AssertionError(f"rel err {rec['rel_err']:.3g}")
                t = timeit(fn)
                rec.update(time_us=t * 1e6, tflops=prob.flops() / t / 1e12)
            except Exception as exc:  # noqa: BLE001
                rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
            results.append(rec)
            log(json.dumps(rec))
            if "tflops" in rec and rec["tflops"] > best.get(name, (0,))[0]:
                best[name] = (rec["tflops"], rec)


def rates(dev: torch.device, log) -> dict:  # noqa: ANN001
    out = {}
    m = n = k = 8192
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    out["bf16_mm_8192"] = 2 * m * n * k / timeit(lambda: a @ b.T) / 1e12
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev)
    out["fp8_scaled_mm_tensorwise_8192"] = 2 * m * n * k / timeit(
        lambda: torch._scaled_mm(a8, b8.T, one, one, out_dtype=torch.bfloat16)) / 1e12
    for mm, nn, kk in ((4096, 7168, 2048), (4096, 4096, 7168)):
        a8 = torch.randn(mm, kk, device=dev).to(torch.float8_e4m3fn)
        b8 = torch.randn(nn, kk, device=dev).to(torch.float8_e4m3fn)
        key = f"{mm}x{nn}x{kk}"
        out[f"fp8_tensorwise_{key}"] = 2 * mm * nn * kk / timeit(
            lambda: torch._scaled_mm(a8, b8.T, one, one, out_dtype=torch.bfloat16)) / 1e12
        try:  # DeepSeek's scaling: 1x128 activation groups, 128x128 weight blocks
            sa = torch.rand(mm, kk // 128, device=dev) + 0.5
            sb = torch.rand(kk // 128, nn // 128, device=dev) + 0.5
            fn = lambda: torch._scaled_mm(a8, b8.T, sa, sb.T.contiguous().T, out_dtype=torch.bfloat16)
            fn()
            out[f"fp8_blockwise_{key}"] = 2 * mm * nn * kk / timeit(fn) / 1e12
        except Exception as exc:  # noqa: BLE001
            out[f"fp8_blockwise_{key}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    log(json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-s", type=float, default=200.0)
    p.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args(argv)
    out_dir = Path(os.environ.get("OUT", "/tmp/quant_fp8_dev"))
    out_dir.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_lines.append(msg)

    if a.cpu_smoke:  # the interpreter: every non-TMA variant on a tiny problem
        dev = torch.device("cpu")
        torch.manual_seed(0)
        w, ws = random_weights(3, 256, 256, dev)
        ids = torch.randint(0, 3, (40,))
        prob = Problem(ids, torch.randn(40, 256), w, ws, 16)
        for name, gather, tma_a, tma_w, lag, wspec in VARIANTS:
            for bn in (64, 256):
                err = prob.check_dev(prob.dev_fn(bn, 4, 2, gather, tma_a, tma_w, lag, wspec), samples=40)
                log(f"{name} BN={bn}: rel err {err:.2e}")
                assert err < 0.02, (name, bn, err)
        return 0

    dev = torch.device("cuda")
    deadline = time.perf_counter() + a.budget_s
    results: list = []
    doc = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    try:
        doc["rates_tflops"] = rates(dev, log)
    except Exception:  # noqa: BLE001
        doc["rates_error"] = traceback.format_exc()[-600:]
    torch.manual_seed(0)
    # one expert, 4096 rows: the DeepSeek down and gate_up GEMMs as plain dense problems
    for n, k in ((7168, 2048),):
        w, ws = random_weights(1, n, k, dev)
        x = torch.randn(4096, k, device=dev)
        ids = torch.zeros(4096, dtype=torch.int64, device=dev)
        probs = {}
        run_problem(f"dense 4096x{n}x{k}", lambda bm: probs.setdefault(bm, Problem(ids, x, w, ws, bm)),
                    [{"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "GROUP_M": 8},
                     {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "GROUP_M": 8}],
                    results, deadline, log)  # fmt: skip
        probs.clear()
    from selector.plugins.quant_kernels import configs as C

    table = C.load_table(torch.cuda.get_device_name())
    for shape in a.shapes.split(","):
        e, h, i, k = SHAPES[shape]
        t = a.tokens
        ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices.reshape(-1)
        tuned = C.lookup(table, C.shape_key(False, e, h, i, k), t) or {}
        for part, (n, kk) in (("down", (h, i)), ("gate_up_plain", (2 * i, h))):
            w, ws = random_weights(e, n, kk, dev)
            x = torch.randn(ids.numel(), kk, device=dev)
            cfg = {"BLOCK_M": tuned.get("BLOCK_M") or 64, **tuned.get("down" if part == "down" else "gate_up", {})}
            cfg.pop("SPLIT_K", None)
            probs = {}
            run_problem(f"{shape} T={t} {part}", lambda bm: probs.setdefault(bm, Problem(ids, x, w, ws, bm)),
                        [cfg, {**cfg, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8}], results, deadline, log)
            probs.clear()
            torch.cuda.empty_cache()
    doc["results"] = results
    (out_dir / "quant_fp8_dev.json").write_text(json.dumps(doc, indent=1))
    # short table: per problem, the shipped best and each variant's best
    print("\nproblem | kernel/variant | best TFLOP/s | tile")
    for prob in dict.fromkeys(r["problem"] for r in results):
        rows = [r for r in results if r["problem"] == prob and "tflops" in r]
        for name in dict.fromkeys(r.get("variant", "shipped") for r in rows):
            b = max((r for r in rows if r.get("variant", "shipped") == name), key=lambda r: r["tflops"])
            tile = b.get("config") or f"BM{b['BM']} BN{b['BN']} w{b['warps']} s{b['stages']}"
            print(f"{prob} | {name} | {b['tflops']:.0f} ({b['time_us']:.0f} us) | {tile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
