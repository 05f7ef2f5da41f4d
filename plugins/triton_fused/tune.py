"""Tune the fused experts kernels' tile configs on this GPU and write them as JSON (see configs.py).

    python -m selector.plugins.triton_fused.tune --preset grid --out plugins/triton_fused/configs/NVIDIA_H200.json

For every (shape, token count) it tries each candidate BLOCK_M; for each, it times the gate_up GEMM and the
down GEMM separately over their candidate tiles (triton.testing.do_bench, median), and keeps the BLOCK_M whose
align + best gate_up + best down is fastest. Random inputs, uniform top-k routing with distinct experts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from . import configs as _configs
from . import kernels as _k

PRESETS: dict[str, list[tuple[int, int, int, int]]] = {
    # (E, H, I, k)
    "grid": [(60, 2048, 1408, 4), (128, 2048, 768, 8), (8, 4096, 14336, 2), (256, 7168, 2048, 8)],
    "qwen3": [(128, 2048, 768, 8)],
    "small": [(60, 2048, 1408, 4), (128, 2048, 768, 8)],
}
TOKEN_COUNTS = (1, 8, 64, 512, 4096, 16384)

# (BLOCK_N, BLOCK_K, num_warps, num_stages); BLOCK_N of the gated gate_up GEMM counts intermediate channels
# (the program reads twice as many weight rows).
_SMALL_M = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (64, 64, 4, 5), (128, 128, 4, 3)]
_LARGE_M = [
    (64, 64, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 8, 4),
    (128, 64, 8, 3),
    (64, 128, 8, 3),
    (128, 128, 8, 3),
    (256, 64, 8, 3),
    (256, 64, 8, 4),
]


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    pairs = max(1, num_tokens * top_k)
    per_expert = pairs / max(1, min(num_experts, pairs))
    if per_expert <= 8:
        return [16]
    if per_expert <= 24:
        return [16, 32]
    if per_expert <= 64:
        return [32, 64]
    if per_expert <= 192:
        return [64, 128]
    return [128, 64]


def gemm_candidates(block_m: int, n_out: int, gated: bool, elem: int = 2) -> list[dict[str, int]]:
    base = _SMALL_M if block_m <= 32 else _LARGE_M
    out = []
    for bn, bk, warps, stages in base:
        if gated and bn > 128:
            continue
        if bn > max(16, 2 * n_out):
            continue
        n_b = 2 if gated else 1
        if (block_m * bk + n_b * bn * bk) * elem * stages > 225 * 1024:
            continue
        out.append(
            {
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": 1 if block_m <= 32 else 8,
                "num_warps": warps,
                "num_stages": stages,
            }
        )
    return out


def _routing(num_tokens: int, top_k: int, num_experts: int, device, gen=None):
    scores = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    w, ids = torch.topk(scores, top_k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).float()


def _bench(fn, warmup_ms: float, rep_ms: float) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e-3


def tune_cell(
    w1: torch.Tensor,
    w2: torch.Tensor,
    num_tokens: int,
    top_k: int,
    *,
    gated: bool = True,
    warmup_ms: float = 5.0,
    rep_ms: float = 20.0,
    log=print,
) -> dict[str, Any]:
    """Best config for one shape (weights w1 [E, 2I, H], w2 [E, H, I]) and token count; with timings."""
    e, _, h = w1.shape
    i_dim = w2.shape[2]
    dev, dt = w1.device, w1.dtype
    elem = w1.element_size()
    x = torch.randn(num_tokens, h, device=dev, dtype=dt)
    ids, tw = _routing(num_tokens, top_k, e, dev)
    ids_flat, tw_flat = ids.reshape(-1), tw.reshape(-1)
    n_pairs = num_tokens * top_k
    inter = torch.randn(n_pairs, i_dim, device=dev, dtype=dt)
    y = torch.empty(n_pairs, h, device=dev, dtype=dt)
    prec = _k._dot_precision(dt)
    best: dict[str, Any] | None = None
    for bm in block_m_candidates(num_tokens, top_k, e):
        sorted_rows, block_expert = _k.align(ids_flat, e, bm)
        t_align = _bench(lambda: _k.align(ids_flat, e, bm), warmup_ms, rep_ms)
        parts: dict[str, tuple[float, dict[str, int]]] = {}
        for part in ("gate_up", "down"):
            n_out = i_dim if part == "gate_up" else h
            for cfg in gemm_candidates(bm, n_out, gated and part == "gate_up", elem):
                full = dict(cfg)
                if part == "gate_up":
                    fn = lambda: _k._launch_gemm(  # noqa: E731
                        x, w1, None, inter, sorted_rows, block_expert, None, num_valid=n_pairs, n_out=i_dim,
                        k_dim=h, a_div=top_k, block_m=bm, stride_wn=w1.stride(1), stride_wk=w1.stride(2),
                        up_offset=i_dim, gated=gated, interleaved=False, act=1, mul_w=False, cfg=full,
                        dot_prec=prec,
                    )  # fmt: skip
                else:
                    fn = lambda: _k._launch_gemm(  # noqa: E731
                        inter, w2, None, y, sorted_rows, block_expert, tw_flat, num_valid=n_pairs, n_out=h,
                        k_dim=i_dim, a_div=1, block_m=bm, stride_wn=w2.stride(1), stride_wk=w2.stride(2),
                        up_offset=0, gated=False, interleaved=False, act=0, mul_w=True, cfg=full, dot_prec=prec,
                    )  # fmt: skip
                try:
                    t = _bench(fn, warmup_ms, rep_ms)
                except Exception as exc:  # a config that does not compile or run here (resources)
                    log(f"    skip BM={bm} {part} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if part not in parts or t < parts[part][0]:
                    parts[part] = (t, cfg)
        if len(parts) < 2:
            continue
        total = t_align + parts["gate_up"][0] + parts["down"][0]
        log(
            f"  T={num_tokens} BM={bm}: align {t_align * 1e6:.1f}us gate_up {parts['gate_up'][0] * 1e6:.1f}us "
            f"{parts['gate_up'][1]} down {parts['down'][0] * 1e6:.1f}us {parts['down'][1]}"
        )
        if best is None or total < best["time_s"]:
            best = {
                "config": {"BLOCK_M": bm, "gate_up": parts["gate_up"][1], "down": parts["down"][1]},
                "time_s": total,
                "gate_up_s": parts["gate_up"][0],
                "down_s": parts["down"][0],
                "align_s": t_align,
            }
    if best is None:
        raise RuntimeError(f"no candidate config ran for T={num_tokens}")
    return best


def tune(
    shapes: Iterable[tuple[int, int, int, int]],
    token_counts: Iterable[int] = TOKEN_COUNTS,
    dtype: torch.dtype = torch.bfloat16,
    out_path: str | Path | None = None,
    *,
    warmup_ms: float = 5.0,
    rep_ms: float = 20.0,
    log=print,
) -> dict[str, Any]:
    """Tune every (shape, token count); merge into the JSON at out_path (if given) and return that document.

    shapes: (E, H, I, k) tuples. Weights are random, [E, 2I, H] and [E, H, I] (gated, not transposed).
    """
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    doc: dict[str, Any] = {"version": 1, "device": name, "dtype": str(dtype).replace("torch.", ""), "configs": {}}
    if out_path is not None and Path(out_path).exists():
        try:
            old = json.loads(Path(out_path).read_text())
            if old.get("device") == name:
                doc["configs"].update(old.get("configs", {}))
        except ValueError:
            pass
    timings: dict[str, dict[str, float]] = {}
    for e, h, i_dim, top_k in shapes:
        key = _configs.shape_key(e, h, i_dim, top_k)
        log(f"{key}")
        g = torch.Generator(device=dev).manual_seed(0)
        w1 = (torch.randn(e, 2 * i_dim, h, device=dev, dtype=dtype, generator=g) / math.sqrt(h)).contiguous()
        w2 = (torch.randn(e, h, i_dim, device=dev, dtype=dtype, generator=g) / math.sqrt(i_dim)).contiguous()
        entry = doc["configs"].setdefault(key, {})
        timings[key] = {}
        for t in token_counts:
            best = tune_cell(w1, w2, t, top_k, warmup_ms=warmup_ms, rep_ms=rep_ms, log=log)
            entry[str(t)] = best["config"]
            timings[key][str(t)] = best["time_s"]
            log(f"  T={t}: best {best['time_s'] * 1e6:.1f}us (GEMMs + align) {best['config']}")
        del w1, w2
        torch.cuda.empty_cache()
    doc["tuned_seconds"] = round(time.perf_counter() - t0, 1)
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    _configs.load_table.cache_clear()
    _configs._get_config_cached.cache_clear()
    log(f"tuning took {time.perf_counter() - t0:.1f}s")
    doc["_timings"] = timings
    return doc


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after writing the table, 1 when it cannot run here (one line; --debug: the traceback), 2 on bad flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="grid")
    p.add_argument("--shape", action="append", default=[], help="E,H,I,k (repeatable; added to the preset)")
    p.add_argument("--tokens", default=",".join(map(str, TOKEN_COUNTS)))
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--out", default=None, help="JSON path (default: configs/<GPU name>.json in the package)")
    p.add_argument("--rep-ms", type=float, default=20.0)
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    a = p.parse_args(argv)
    try:
        extra = [tuple(int(v) for v in s.split(",")) for s in a.shape]
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--shape takes E,H,I,k and --tokens a comma list, as integers; got {a.shape} and {a.tokens!r}")
    if any(len(s) != 4 or min(s) < 1 for s in extra) or not tokens or min(tokens) < 1:
        p.error("--shape takes four positive integers E,H,I,k and --tokens positive integers")
    if not torch.cuda.is_available():
        print("triton_fused tune: needs a CUDA GPU and none is visible (it times the kernel on the GPU the "
              "table is for); run it on that GPU's node", file=sys.stderr)
        return 1
    shapes = list(PRESETS[a.preset]) + extra
    try:
        out = a.out or str(_configs.CONFIG_DIR / _configs.config_file_name(torch.cuda.get_device_name()))
        tune(shapes, tokens, getattr(torch, a.dtype), out, rep_ms=a.rep_ms)
    except Exception as exc:  # one line with the fix; --debug shows where it came from
        if a.debug:
            raise
        print(f"triton_fused tune: {type(exc).__name__}: {' '.join(str(exc).split())} "
              "(rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
