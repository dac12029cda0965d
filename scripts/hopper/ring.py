#!/usr/bin/env python3
"""Attention-core rates on one GPU at the planner's long-context shapes, whole and as ring
attention's per-rank work (context parallelism as Transformer Engine's p2p CP runs it).

The planner (crates/hetpar-plan/src/cost.rs) prices the attention core at a fraction of
peak, slowed under context parallelism by a fitted factor that it attributes to ring
attention's partial kernels and online-softmax merges. This script measures that
attribution on a real GPU, compute only (no second rank, no transfer):

- whole: one causal (or bidirectional) attention over a sequence, forward and backward,
  through PyTorch's scaled_dot_product_attention on each fused backend that takes it;
- ring: one rank's share of a load-balanced causal ring of `cp` ranks over a sequence of
  `seq`: the rank holds two chunks of `seq / (2 cp)` tokens; step 0 is causal attention of
  its queries over its own keys; each of the `cp - 1` later steps is a bidirectional block
  of either all its queries over the first half of the arriving keys or the second half of
  its queries over all of them (same FLOPs); after each step the output is merged in fp32
  by the log-sum-exp correction (two exps, a multiply-add over the output); in the
  backward each step's block gradient is added into fp32 query and key/value gradient
  buffers. Both kinds of rank (all steps of one block shape) are timed.

FLOPs follow the planner's convention: forward `4 * q_len * kv_len * heads * head_dim`,
halved for a causal square block; the backward counted as twice the forward. Rates are
TFLOP/s on this GPU. Needs PyTorch with CUDA; prints JSON lines and a Markdown table.

    python3 scripts/hopper/ring.py --json out.jsonl

`--quick` runs tiny shapes on the CPU through the math backend, to check the script.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import Records, Timer

# (name, heads per GPU, head dim, sequence, cp, causal, batch): the rows of
# crates/hetpar-plan/src/validation.rs at their published layouts (heads / tp).
SHAPES = [
    ("vit-1b images (tp1)", 24, 64, 1024, 1, False, 16),
    ("14b 8k (tp4)", 10, 128, 8192, 1, True, 1),
    ("70b 8k (tp8)", 8, 128, 8192, 1, True, 1),
    ("7b 16k (tp2 cp2)", 16, 128, 16384, 2, True, 1),
    ("14b 32k (tp8 cp2)", 5, 128, 32768, 2, True, 1),
    ("14b 32k (tp4 cp2)", 10, 128, 32768, 2, True, 1),
    ("7b 64k (tp4 cp8)", 8, 128, 65536, 8, True, 1),
    ("7b 64k (tp2 cp8)", 16, 128, 65536, 8, True, 1),
]
QUICK = [
    ("tiny bidirectional", 2, 16, 64, 1, False, 2),
    ("tiny causal", 2, 16, 128, 1, True, 1),
    ("tiny ring", 2, 16, 128, 4, True, 1),
]
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "math": SDPBackend.MATH,
}


def tensors(batch, heads, length, dim, device, dtype):
    return torch.randn(batch, heads, length, dim, device=device, dtype=dtype, requires_grad=True)


def block_flops(batch, heads, dim, q_len, kv_len, causal):
    f = 4.0 * batch * heads * dim * q_len * kv_len
    return f / 2 if causal else f


def whole(timer, backend, batch, heads, dim, seq, causal, device, dtype):
    """Forward and backward seconds of one attention over `seq`."""
    q, k, v = (tensors(batch, heads, seq, dim, device, dtype) for _ in range(3))
    with sdpa_kernel(backend):
        fwd = timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        g = torch.randn_like(o)
        bwd = timer(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
    return fwd, bwd


def ring(timer, backend, batch, heads, dim, seq, cp, device, dtype, kind):
    """Forward and backward seconds of one rank's share of a load-balanced causal ring.

    `kind` 0: every later step is all queries over half the keys; 1: half the queries over
    all the keys.
    """
    n = seq // cp
    half = n // 2
    q, k, v = (tensors(batch, heads, n, dim, device, dtype) for _ in range(3))
    # Keys and values arriving from the other ranks (the same buffers each step: compute
    # only).
    kr, vr = (tensors(batch, heads, n, dim, device, dtype) for _ in range(2))
    if kind == 0:
        step_q, step_k, step_v = q, kr[:, :, :half], vr[:, :, :half]
    else:
        step_q, step_k, step_v = q[:, :, half:], kr, vr
    rows = step_q.shape[2]
    lse = torch.zeros(batch, heads, n, device=device, dtype=torch.float32)
    out = torch.zeros(batch, heads, n, dim, device=device, dtype=torch.float32)

    def merge(o_step, lse_step, lo):
        # Online-softmax merge of a step's output into the fp32 running output.
        cur = lse[:, :, lo:]
        new = torch.logaddexp(cur, lse_step)
        out[:, :, lo:].mul_(torch.exp(cur - new).unsqueeze(-1)).add_(
            o_step.float() * torch.exp(lse_step - new).unsqueeze(-1)
        )
        lse[:, :, lo:] = new

    lo = 0 if kind == 0 else half
    lse_step = torch.zeros(batch, heads, rows, device=device, dtype=torch.float32)

    with sdpa_kernel(backend):

        def forward():
            o0 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.copy_(o0)
            for _ in range(cp - 1):
                o = F.scaled_dot_product_attention(step_q, step_k, step_v)
                merge(o, lse_step, lo)

        fwd = timer(forward)
        o0 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o1 = F.scaled_dot_product_attention(step_q, step_k, step_v)
        g0, g1 = torch.randn_like(o0), torch.randn_like(o1)
        dq = torch.zeros(batch, heads, n, dim, device=device, dtype=torch.float32)
        dkv = torch.zeros(2, batch, heads, n, dim, device=device, dtype=torch.float32)

        def backward():
            gq, gk, gv = torch.autograd.grad(o0, (q, k, v), g0, retain_graph=True)
            dq.copy_(gq)
            dkv[0].copy_(gk)
            dkv[1].copy_(gv)
            for _ in range(cp - 1):
                gq, gk, gv = torch.autograd.grad(
                    o1, (step_q, step_k, step_v), g1, retain_graph=True
                )
                dq[:, :, lo:].add_(gq)
                dkv[0, :, :, : gk.shape[2]].add_(gk)
                dkv[1, :, :, : gv.shape[2]].add_(gv)

        bwd = timer(backward)
    return fwd, bwd


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (math)")
    ap.add_argument("--json", help="also write JSON lines here")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    shapes = QUICK if args.quick else SHAPES
    backends = ["math"] if args.quick else ["cudnn", "flash"]
    timer = Timer(device, warm=2 if args.quick else 3, reps=2 if args.quick else args.reps)
    if device == "cuda":
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    records = Records(args.json)
    emit = records.emit

    for name, heads, dim, seq, cp, causal, batch in shapes:
        for bname in backends:
            backend = BACKENDS[bname]
            base = {"shape": name, "backend": bname, "heads": heads, "dim": dim, "seq": seq}
            try:
                fwd, bwd = whole(timer, backend, batch, heads, dim, seq, causal, device, dtype)
                f = block_flops(batch, heads, dim, seq, seq, causal)
                emit({**base, "kind": "whole", "fwd_s": fwd, "bwd_s": bwd,
                      "fwd_tflops": f / fwd / 1e12, "train_tflops": 3 * f / (fwd + bwd) / 1e12})
            except Exception as e:  # a backend that refuses the shape
                emit({**base, "kind": "whole", "error": str(e).splitlines()[0][:200]})
            if cp > 1:
                n = seq // cp
                f = block_flops(batch, heads, dim, n, n, True) + (cp - 1) * block_flops(
                    batch, heads, dim, n, n // 2, False
                )
                for kind in (0, 1):
                    try:
                        fwd, bwd = ring(timer, backend, batch, heads, dim, seq, cp, device,
                                        dtype, kind)
                        emit({**base, "kind": f"ring cp{cp} " + ("q x half kv", "half q x kv")[kind],
                              "fwd_s": fwd, "bwd_s": bwd, "fwd_tflops": f / fwd / 1e12,
                              "train_tflops": 3 * f / (fwd + bwd) / 1e12})
                    except Exception as e:
                        emit({**base, "kind": f"ring cp{cp} kind {kind}",
                              "error": str(e).splitlines()[0][:200]})
            if device == "cuda":
                torch.cuda.empty_cache()

    records.table(
        ["shape", "backend", "run", "fwd ms", "bwd ms", "bwd/fwd", "fwd TFLOP/s",
         "train TFLOP/s"], 3,
        lambda r: [r["shape"], r["backend"], r["kind"], f"{1e3 * r['fwd_s']:.2f}",
                   f"{1e3 * r['bwd_s']:.2f}", f"{r['bwd_s'] / r['fwd_s']:.2f}",
                   f"{r['fwd_tflops']:.0f}", f"{r['train_tflops']:.0f}"],
        keys=("shape", "backend", "kind"), failed="refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
