#!/usr/bin/env python3
"""A transformer layer's GEMMs on one GPU at the planner's per-rank shapes, against the
rate the planner's cost model gives them.

The planner (crates/hetpar-plan/src/cost.rs) runs a layer's GEMMs at
`peak * gemm * w / (w + gemm_half_width)`, `w = hidden / tp`: narrow tensor-parallel shards
below peak. This script times the four products of a layer (q/k/v, output projection, MLP
in and out) for `tokens` rows on one rank of `tp`, each forward (`x W`), input gradient
(`dy W^T`) and weight gradient (`x^T dy`), in bf16 through PyTorch (cuBLAS), and prints the
measured rate next to the model's:

    python3 scripts/hopper/gemm.py --json out.jsonl

Needs PyTorch with CUDA. Shapes are the published rows' models (PUBLISHED.md, the issue's
1B ViT and Llama-2-7B) at the tp their layouts use. `--quick` runs two of them on 64 rows
on the CPU in f32, to check the script.
"""

import argparse
import sys

import torch

from common import Records, Timer

# (name, hidden, heads, kv heads, ffn, swiglu)
MODELS = {
    "vit-1b": (1536, 24, 24, 6144, False),
    "llama2-7b": (4096, 32, 32, 11008, True),
    "qwen2.5-14b": (5120, 40, 8, 13824, True),
    "llama3-70b": (8192, 64, 8, 28672, True),
}
RUNS = [
    ("vit-1b", 1), ("vit-1b", 2), ("vit-1b", 4), ("vit-1b", 8),
    ("llama2-7b", 1), ("llama2-7b", 2), ("llama2-7b", 4), ("llama2-7b", 8),
    ("qwen2.5-14b", 2), ("qwen2.5-14b", 4), ("qwen2.5-14b", 8),
    ("llama3-70b", 8),
]
# The planner's built-in H100 factors (crates/hetpar-plan/src/hardware.rs).
PEAK, GEMM, HALF_WIDTH = 989.0, 0.847, 103.0


def products(model, tp):
    """(k, n) of each forward product of one layer on one rank of `tp`."""
    h, heads, kv, ffn, swiglu = MODELS[model]
    d = h // heads
    return [
        (h, (heads + 2 * kv) * d // tp),  # q, k, v
        (heads * d // tp, h),  # output projection
        (h, (2 if swiglu else 1) * ffn // tp),  # MLP in (gate and up)
        (ffn // tp, h),  # MLP out
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="rows per rank (the microbatch)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="also write JSON lines here")
    ap.add_argument("--quick", action="store_true", help="64 rows, two runs, on the CPU")
    args = ap.parse_args()
    if args.quick:
        dev, dt, t, runs = "cpu", torch.float32, 64, RUNS[:2]
    else:
        dev, dt, t, runs = "cuda", torch.bfloat16, args.tokens, RUNS
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    timer = Timer(dev, warm=3, reps=2 if args.quick else args.reps)
    records = Records(args.json)
    for model, tp in runs:
        mats = []
        flops = 0.0
        for k, n in products(model, tp):
            x = torch.randn(t, k, device=dev, dtype=dt)
            w = torch.randn(k, n, device=dev, dtype=dt)
            dy = torch.randn(t, n, device=dev, dtype=dt)
            mats.append((x, w, dy))
            flops += 3 * 2.0 * t * k * n

        def layer():
            for x, w, dy in mats:
                x @ w
                dy @ w.t()
                x.t() @ dy

        secs = timer(layer)
        width = MODELS[model][0] / tp
        records.emit({
            "model": model, "tp": tp, "tokens": t, "width": width, "ms": 1e3 * secs,
            "tflops": flops / secs / 1e12, "of_peak": flops / secs / 1e12 / PEAK,
            "model_of_peak": GEMM * width / (width + HALF_WIDTH),
        })
        del mats
        if dev == "cuda":
            torch.cuda.empty_cache()

    records.table(
        ["model", "tp", "width (hidden / tp)", "ms per layer", "TFLOP/s", f"of {PEAK:.0f}",
         "planner's"], 1,
        lambda r: [r["model"], str(r["tp"]), f"{r['width']:.0f}", f"{r['ms']:.2f}",
                   f"{r['tflops']:.0f}", f"{r['of_peak']:.2f}", f"{r['model_of_peak']:.2f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
