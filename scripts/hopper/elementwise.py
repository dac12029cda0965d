#!/usr/bin/env python3
"""A transformer layer's element-wise work on one GPU at the planner's per-rank shapes, as
bytes of HBM traffic per token and hidden unit: the unit of the planner's
`elementwise_bytes` factor.

The planner (crates/hetpar-plan/src/cost.rs) charges a layer's element-wise work (norms,
residual adds, rotary embedding, the MLP activation) as `t * elementwise_bytes * hidden / tp`
bytes of HBM traffic in the forward pass on a rank with `t` local tokens under sequence
parallelism, and twice that in the backward. The factor is fitted; this script measures it.
It runs, forward and backward, exactly the element-wise part of one layer on one rank (the
GEMM and attention outputs are given as inputs, so no product is timed), once as PyTorch
runs it op by op (eager) and once fused by `torch.compile` (what a stack with fused
kernels, as Transformer Engine and Megatron's fusions are, approaches), and converts the
GPU kernel time (summed per kernel by the profiler, so that the host's launch overhead,
which the layer's products hide in a real step, is left out) into the factor's unit:

    bytes = (forward + backward) / 3 * bandwidth / (t * hidden / tp)

with `bandwidth` the GPU's datasheet HBM rate (H200: 4.8 TB/s; the planner's H100 table
uses the H100's 3.35 TB/s the same way), so the number carries over between the two chips
where the work is bandwidth-bound. It also prints the least traffic of the forward (each
input read once, each output written once) in the same unit.

Per rank under sequence parallelism: the norms and residual adds see `t / tp` tokens of the
full width; rotary embedding sees `t` tokens of the rank's `heads / tp` query and key heads;
the MLP activation `t` tokens of `ffn / tp`. The ViT rows (tp 1) use LayerNorm and GELU and
no rotary embedding.

    python3 scripts/hopper/elementwise.py --json out.jsonl

Needs PyTorch with CUDA (and Triton for `torch.compile`). `--quick` runs tiny shapes on the
CPU in f32, to check the script.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from common import Records, Timer

# (name, kind, hidden, heads, kv heads, head dim, ffn, tp, local tokens): the published
# rows' LLMs and encoders at the tp their layouts use (PUBLISHED.md; the 64K row's
# Llama-2-7B at cp 8 holds 8,192 of the 65,536 tokens).
SHAPES = [
    ("qwen2.5-14b 8k tp4", "llama", 5120, 40, 8, 128, 13824, 4, 8192),
    ("qwen2.5-14b 8k tp2", "llama", 5120, 40, 8, 128, 13824, 2, 8192),
    ("llama3-70b 8k tp8", "llama", 8192, 64, 8, 128, 28672, 8, 8192),
    ("llama2-7b 64k tp4 cp8", "llama", 4096, 32, 32, 128, 11008, 4, 8192),
    ("llama2-7b 16k tp2 cp2", "llama", 4096, 32, 32, 128, 11008, 2, 8192),
    ("vit-1b tp1, 8 images", "vit", 1536, 24, 24, 64, 6144, 1, 8192),
]
QUICK = [
    ("tiny llama tp2", "llama", 64, 4, 2, 16, 176, 2, 32),
    ("tiny vit", "vit", 48, 3, 3, 16, 192, 1, 32),
]
# Datasheet HBM bandwidth, GB/s, by device name fragment.
BANDWIDTH = {"H200": 4800.0, "H100": 3350.0}


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w.float()).to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def llama_elementwise(x, attn_out, q, k, gate_up, mlp_out, w1, w2, cos, sin):
    """A Llama layer's element-wise forward on one rank; the products are inputs."""
    n1 = rms_norm(x, w1)  # into the all-gather and the q/k/v product
    q2, k2 = rope(q, cos, sin), rope(k, cos, sin)  # into attention
    h1 = x + attn_out  # residual after the output projection's reduce-scatter
    n2 = rms_norm(h1, w2)  # into the MLP
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # into the down projection
    out = h1 + mlp_out  # residual after the MLP
    return n1, q2, k2, n2, act, out


def vit_elementwise(x, attn_out, fc1_out, mlp_out, w1, b1, w2, b2):
    """A ViT layer's element-wise forward (LayerNorm, GELU); the products are inputs."""
    h = x.shape[-1]
    n1 = F.layer_norm(x, (h,), w1, b1)
    h1 = x + attn_out
    n2 = F.layer_norm(h1, (h,), w2, b2)
    act = F.gelu(fc1_out)
    out = h1 + mlp_out
    return n1, n2, act, out


def inputs(kind, hidden, heads, kv, dim, ffn, tp, tokens, device, dtype):
    """The element-wise inputs of one rank, leaves that take gradients."""
    def t(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    sp = tokens // tp  # sequence-parallel rows of the full width
    if kind == "llama":
        pos = torch.arange(tokens, device=device, dtype=torch.float32)
        freq = 1e4 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
        ang = torch.outer(pos, freq).repeat(1, 2).unsqueeze(1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        return (t(sp, hidden), t(sp, hidden), t(tokens, heads // tp, dim),
                t(tokens, kv // tp, dim), t(tokens, 2 * ffn // tp), t(sp, hidden),
                t(hidden), t(hidden), cos, sin)
    return (t(sp, hidden), t(sp, hidden), t(tokens, ffn // tp), t(sp, hidden),
            t(hidden), t(hidden), t(hidden), t(hidden))


def least_forward_bytes(args, outs):
    """Every tensor of `args` read once and every output written once (the caller passes
    the inputs of two or more dimensions: the norms' weights are left out)."""
    return sum(a.numel() * a.element_size() for a in args) + sum(
        o.numel() * o.element_size() for o in outs
    )


def kernel_seconds(device, fn, warm, reps):
    """Mean GPU kernel time of `fn` over `reps` calls after `warm` calls: the device time
    of every kernel it launches, summed (CUPTI, through the profiler), so that the host's
    launch overhead, which a layer's products hide in a real step, is not counted. On the
    CPU, wall time."""
    if device != "cuda":
        return Timer(device, warm, reps)(fn)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(
        getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        for e in prof.key_averages()
    )
    return total_us / 1e6 / reps


def measure(fn, args, device, warm, reps):
    """Forward and backward seconds of `fn` over `args` (gradients for every output), as
    kernel time and as wall time per call."""
    leaves = [a for a in args if a.requires_grad]
    outs = fn(*args)
    grads = [torch.randn_like(o) for o in outs]

    def forward():
        return fn(*args)

    def backward():
        return torch.autograd.grad(outs, leaves, grads, retain_graph=True)

    fwd = kernel_seconds(device, forward, warm, reps)
    bwd = kernel_seconds(device, backward, warm, reps)
    timer = Timer(device, warm, reps)
    wall = timer(forward) + timer(backward)
    return fwd, bwd, wall, outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (f32)")
    ap.add_argument("--json", help="also write JSON lines here")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--bandwidth-gbps", type=float,
                    help="datasheet HBM bandwidth, GB/s (default: by GPU name, H100 or H200)")
    args = ap.parse_args()
    device = "cpu" if args.quick else "cuda"
    dtype = torch.float32 if args.quick else torch.bfloat16
    shapes = QUICK if args.quick else SHAPES
    warm, reps = (2, 2) if args.quick else (3, args.reps)
    bandwidth = args.bandwidth_gbps or 3350.0
    if device == "cuda":
        name = torch.cuda.get_device_name()
        if not args.bandwidth_gbps:
            known = [v for k, v in BANDWIDTH.items() if k in name]
            if not known:
                ap.error(f"no datasheet bandwidth known for {name!r}: pass --bandwidth-gbps")
            bandwidth = known[0]
        print(f"# {name}, torch {torch.__version__}, datasheet HBM {bandwidth:.0f} GB/s",
              flush=True)
    records = Records(args.json)
    emit = records.emit

    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    for name, kind, hidden, heads, kv, dim, ffn, tp, tokens in shapes:
        fn = llama_elementwise if kind == "llama" else vit_elementwise
        x = inputs(kind, hidden, heads, kv, dim, ffn, tp, tokens, device, dtype)
        unit = tokens * hidden / tp  # the factor's denominator: local tokens x hidden / tp
        for mode in modes:
            f = fn if mode == "eager" else torch.compile(fn, dynamic=False)
            t_compile = time.perf_counter()
            try:
                fwd, bwd, wall, outs = measure(f, x, device, warm, reps)
            except Exception as e:  # no compiler on this machine, say
                emit({"shape": name, "mode": mode, "error": str(e).splitlines()[0][:200]})
                continue
            least = least_forward_bytes([a for a in x if a.dim() > 1], outs)
            emit({
                "shape": name, "mode": mode, "tp": tp, "tokens": tokens, "hidden": hidden,
                "fwd_s": fwd, "bwd_s": bwd, "wall_fwd_bwd_s": wall,
                "bytes": (fwd + bwd) / 3 * bandwidth * 1e9 / unit,
                "fwd_bytes": fwd * bandwidth * 1e9 / unit,
                "least_fwd_bytes": least / unit,
                "wall_s": time.perf_counter() - t_compile,
            })
        if device == "cuda":
            torch.cuda.empty_cache()
    records.table(
        ["shape", "run", "fwd ms", "bwd ms", "bwd/fwd", "bytes per token-hidden (fwd+bwd)/3",
         "forward alone", "least forward", "wall fwd+bwd ms"], 2,
        lambda r: [r["shape"], r["mode"], f"{1e3 * r['fwd_s']:.3f}", f"{1e3 * r['bwd_s']:.3f}",
                   f"{r['bwd_s'] / r['fwd_s']:.2f}", f"{r['bytes']:.0f}",
                   f"{r['fwd_bytes']:.0f}", f"{r['least_fwd_bytes']:.0f}",
                   f"{1e3 * r['wall_fwd_bwd_s']:.3f}"],
        keys=("shape", "mode"))


if __name__ == "__main__":
    main()
