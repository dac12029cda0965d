#!/usr/bin/env python3
"""Side-by-side CPU compute benchmark: `hetpar bench nn` next to the same shapes in PyTorch.

Runs both on one core (RAYON_NUM_THREADS=1 for hetpar, torch.set_num_threads(1) here), in
rounds within one run, keeps each row's best time, and prints a Markdown table with both
columns and their ratio. Within a round each model row runs on both sides back to back
(`hetpar bench nn --only ROW`, then the PyTorch model, the first side alternating by round),
so a pair is measured seconds apart; the table adds the median and range of the pairs'
ratios, which a VM whose speed drifts over minutes moves far less than the ratio of two
bests taken minutes apart (`--pairs N`: N pairs per row and round, for a steadier median
where the speed also moves from one pair to the next). PyTorch is optional and never used
by CI:

    python3 -m venv /tmp/torch && /tmp/torch/bin/pip install torch numpy
    cargo build --release -p hetpar
    /tmp/torch/bin/python scripts/peer-bench/compare.py --hetpar target/release/hetpar

The PyTorch models mirror crates/hetpar-nn/src/bench.rs and crates/hetpar/src/bench_cmd.rs:
a Llama layer (hidden 512, 8 heads / 2 KV heads, SwiGLU 1408, RMSNorm, RoPE, causal SDPA)
on 1 x 512 tokens, its MoE variant (8 experts of 704, top-2, load-balancing loss), the
4-layer models (vocabulary 4096) on 2 x 256 tokens with the mean cross-entropy, and the
ViT (224 px, 16 px patches, hidden 384, 6 heads, MLP 1536, exact GELU, LayerNorm) with the
LLaVA projector to 512 on 4 images; each timed as forward + backward of the same loss. The
next row is the optimizer alone: one AdamW update of 4M parameters (weight decay 0.1),
hetpar's in-place kernel against the fastest of `torch.optim.AdamW`'s CPU implementations;
the last rows time the linear layers' forward product alone (`x @ w^T`, the MoE expert's
704 x 512 weight) at 32 to 512 rows, hetpar's fused op against `F.linear`, then its two
backward products (`dx = dy w`, `dw = dy^T x`, the kernels hetpar's backward runs) against
`dy @ w` and `dy.t() @ x`; and the
attention core alone (`softmax(q k^T / sqrt(d)) v`, forward + backward of the output's
sum) on the ViT's, the layer's and the model's shapes, hetpar's fused kernel against
`F.scaled_dot_product_attention`.

In bf16 (`--dtype bf16`, or `--bf16` for a second table after the first) both keep f32
weights and activations and multiply in bf16: hetpar's `bench nn --dtype bf16` (bf16
products in the linear layers and the attention core), PyTorch's f32 models under
`torch.autocast("cpu", dtype=torch.bfloat16)`, its mixed-precision mode (which runs SDPA in
bf16 too); the matmul row is each one's bf16 product, the attention rows hetpar's core with
bf16 products against SDPA under autocast, and the AdamW row stays f32.

A model row's share of hetpar's matmul rate comes two ways: its best rate over the best of
every matmul rate the run measured (`of hetpar's matmul`: a maximum over dozens of samples,
which this VM's noise pushes up), and, paired, each `bench nn --only ROW` run's rate over
the matmul rate that same run measured seconds before (`of its run's matmul`, median and
range over the pairs), which the machine's drift moves far less.
"""

import contextlib

import argparse
import re
import statistics
import subprocess
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

H, HEADS, KV, FFN, VOCAB, THETA, EPS = 512, 8, 2, 1408, 4096, 10_000.0, 1e-5


def rope_tables(s, d, dtype):
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rotate(x, cos, sin):
    # x [b, heads, s, d], rotate-half (HF Llama).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SwiGlu(nn.Module):
    def __init__(self, ffn):
        super().__init__()
        self.gate = nn.Linear(H, ffn, bias=False)
        self.up = nn.Linear(H, ffn, bias=False)
        self.down = nn.Linear(ffn, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Moe(nn.Module):
    """Mixtral-style top-k routing, no token dropped, Switch load-balancing loss."""

    def __init__(self, experts=8, ffn=704, top_k=2, coef=0.01):
        super().__init__()
        self.router = nn.Linear(H, experts, bias=False)
        self.experts = nn.ModuleList(SwiGlu(ffn) for _ in range(experts))
        self.top_k, self.coef = top_k, coef

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, H)
        probs = F.softmax(self.router(x), dim=-1)
        gates, picked = probs.topk(self.top_k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        e_count = len(self.experts)
        for e, expert in enumerate(self.experts):
            tok, slot = (picked == e).nonzero(as_tuple=True)
            if tok.numel():
                # (under autocast the expert's product is bf16; the sum keeps `out`'s type)
                out.index_add_(0, tok, (expert(x[tok]) * gates[tok, slot, None]).to(out.dtype))
        f = torch.bincount(picked.flatten(), minlength=e_count).to(x.dtype) / picked.numel()
        aux = self.coef * e_count * (f * probs.mean(0)).sum()
        return out.reshape(shape), aux


class LlamaLayer(nn.Module):
    def __init__(self, moe):
        super().__init__()
        d = H // HEADS
        self.n1, self.n2 = nn.RMSNorm(H, eps=EPS), nn.RMSNorm(H, eps=EPS)
        self.q = nn.Linear(H, HEADS * d, bias=False)
        self.k = nn.Linear(H, KV * d, bias=False)
        self.v = nn.Linear(H, KV * d, bias=False)
        self.o = nn.Linear(HEADS * d, H, bias=False)
        self.ffn = Moe() if moe else SwiGlu(FFN)
        self.moe = moe

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = H // HEADS
        h = self.n1(x)
        q = self.q(h).view(b, s, HEADS, d).transpose(1, 2)
        k = self.k(h).view(b, s, KV, d).transpose(1, 2)
        v = self.v(h).view(b, s, KV, d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, H))
        y = self.ffn(self.n2(x))
        if self.moe:
            y, aux = y
        else:
            aux = x.new_zeros(())
        return x + y, aux


class Llama(nn.Module):
    def __init__(self, moe, layers=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(LlamaLayer(moe) for _ in range(layers))
        self.norm = nn.RMSNorm(H, eps=EPS)
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, tokens, targets, cos, sin):
        x = self.embed(tokens)
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x, cos, sin)
            aux = aux + a
        logits = self.head(self.norm(x)).reshape(-1, VOCAB)
        return F.cross_entropy(logits, targets.reshape(-1)) + aux


class VitLayer(nn.Module):
    def __init__(self, h=384, heads=6, ffn=1536):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=1e-6), nn.LayerNorm(h, eps=1e-6)
        self.qkv = nn.ModuleList(nn.Linear(h, h) for _ in range(3))
        self.out = nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, ffn), nn.Linear(ffn, h)
        self.heads = heads

    def forward(self, x):
        n, s, h = x.shape
        y = self.ln1(x)
        q, k, v = (p(y).view(n, s, self.heads, -1).transpose(1, 2) for p in self.qkv)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(a.transpose(1, 2).reshape(n, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Vit(nn.Module):
    def __init__(self, size=224, patch=16, h=384, layers=4, out=512):
        super().__init__()
        self.patch, self.g = patch, size // patch
        self.embed = nn.Linear(3 * patch * patch, h)
        self.pos = nn.Parameter(torch.randn(self.g * self.g, h) * 0.02)
        self.layers = nn.ModuleList(VitLayer(h) for _ in range(layers))
        self.post = nn.LayerNorm(h, eps=1e-6)
        self.proj1, self.proj2 = nn.Linear(h, out), nn.Linear(out, out)

    def forward(self, pixels):
        n, p, g = pixels.shape[0], self.patch, self.g
        patches = pixels.reshape(n, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, -1)
        x = self.embed(patches) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.proj2(F.gelu(self.proj1(self.post(x))))


def best(iters, step):
    step()
    t = float("inf")
    for _ in range(max(iters, 1)):
        start = time.perf_counter()
        step()
        t = min(t, time.perf_counter() - start)
    return t


def torch_row(key, iters, dtype, autocast=False):
    """Seconds per forward+backward of row `key` (hetpar's --only names); with `autocast`,
    each forward under CPU autocast to bf16 (the backward follows its casts)."""
    torch.manual_seed(0)
    mixed = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    d = H // HEADS

    def layer(moe):
        m = LlamaLayer(moe).to(dtype)
        x = torch.randn(1, 512, H, dtype=dtype)
        cos, sin = rope_tables(512, d, dtype)

        def step():
            m.zero_grad(set_to_none=True)
            with mixed():
                y, aux = m(x, cos, sin)
                loss = y.float().sum() + aux.float()
            loss.backward()

        return best(iters, step)

    def model(moe):
        m = Llama(moe).to(dtype)
        n = 2 * 256
        tokens = torch.tensor([(i * 7919) % VOCAB for i in range(n)]).reshape(2, 256)
        targets = torch.tensor([(i * 104_729) % VOCAB for i in range(n)]).reshape(2, 256)
        cos, sin = rope_tables(256, d, dtype)

        def step():
            m.zero_grad(set_to_none=True)
            with mixed():
                loss = m(tokens, targets, cos, sin).float()
            loss.backward()

        return best(iters, step)

    def vit():
        m = Vit().to(dtype)
        pixels = torch.randn(4, 3, 224, 224, dtype=dtype)

        def step():
            m.zero_grad(set_to_none=True)
            with mixed():
                loss = m(pixels).float().sum()
            loss.backward()

        return best(iters, step)

    return {
        "layer": lambda: layer(False),
        "moe-layer": lambda: layer(True),
        "model": lambda: model(False),
        "moe-model": lambda: model(True),
        "vit": vit,
    }[key]()


def torch_matmul(iters, dtype):
    rate = 0.0
    for n in (512, 1024):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        rate = max(rate, 2 * n**3 / best(10 * iters, lambda: a @ b) / 1e9)
    return rate


KEYS = ["layer", "moe-layer", "model", "moe-model", "vit"]


def hetpar_run(binary, iters, dtype, only):
    """Runs `hetpar bench nn --only ONLY`; returns (matmul GFLOP/s, {key: (name, seconds,
    GFLOP/s)} for the model rows of `only`, and, where `only` asks for them, (AdamW
    parameters, seconds), ((out, in) of the linear row's weight, {rows: GFLOP/s}, {rows:
    (dx GFLOP/s, dw GFLOP/s)}) and {attention shape: seconds}). Output without the lines asked for (a binary from before
    they existed) is refused."""
    env = {"RAYON_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [binary, "bench", "nn", "--iters", str(iters), "--dtype", dtype, "--only", ",".join(only)],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    peak = float(re.search(r"^matmul \(best.*?: ([\d.]+) GFLOP/s", out, re.M).group(1))
    keys = [k for k in KEYS if k in only]
    rows = re.findall(r"^(\S.*?\))\s+([\d.]+)ms\s+\d+\s+([\d.]+)", out, re.M)
    adamw = re.search(r"^adamw update of (\d+) \S+ parameters: ([\d.]+) ms", out, re.M)
    linear = re.search(r"^linear forward x @ w\^T \(w (\d+) x (\d+)\) \S+, GFLOP/s by rows: (.*)$", out, re.M)
    backward = re.search(r"^linear backward dx = dy w, dw = dy\^T x \(w \d+ x \d+\) \S+, "
                         r"GFLOP/s by rows \(dx/dw\): (.*)$", out, re.M)
    attention = re.search(r"^attention core forward\+backward \S+, ms by shape: (.*)$", out, re.M)
    if (len(rows) != len(keys) or ("adamw" in only and not adamw)
            or ("linear" in only and not (linear and backward)) or ("attention" in only and not attention)):
        sys.exit(f"unexpected `hetpar bench nn` output:\n{out}")
    rows = {k: (n, float(t) / 1e3, float(g)) for k, (n, t, g) in zip(keys, rows)}
    adam = (int(adamw.group(1)), float(adamw.group(2)) / 1e3) if adamw else None
    lin = None
    if linear:
        shape = (int(linear.group(1)), int(linear.group(2)))
        fwd = {int(r): float(g) for r, g in re.findall(r"(\d+): ([\d.]+)", linear.group(3))}
        bwd = {int(r): (float(dx), float(dw))
               for r, dx, dw in re.findall(r"(\d+): ([\d.]+)/([\d.]+)", backward.group(1))}
        lin = (shape, fwd, bwd)
    attn = {}
    if attention:
        attn = {shape: float(ms) / 1e3
                for shape, ms in re.findall(r"(\d+x\d+:\d+/\d+:\d+c?) ([\d.]+)", attention.group(1))}
    return peak, rows, adam, lin, attn


def torch_attention(shape, iters, dtype, autocast=False):
    """Seconds of `F.scaled_dot_product_attention` forward + backward of the output's sum
    for a shape of hetpar's `attention` line: `BxS:HQ/HKV:D`, `c` at the end if causal
    (PyTorch's layout `[b, heads, s, d]`); under autocast on f32 tensors (SDPA in bf16)."""
    m = re.fullmatch(r"(\d+)x(\d+):(\d+)/(\d+):(\d+)(c?)", shape)
    b, s, hq, hkv, d = (int(g) for g in m.groups()[:5])
    causal = m.group(6) == "c"
    q = torch.randn(b, hq, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=dtype, requires_grad=True)

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def step():
        q.grad = k.grad = v.grad = None
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
        out.sum().backward()

    return best(10 * iters, step)


def torch_linear(shape, rows, iters, dtype, autocast=False):
    """GFLOP/s of `F.linear(x, w)` (forward only, no autograd) for `x` `[rows, in]` and `w`
    `[out, in]`, as hetpar's `linear` line times its fused product."""
    out, inner = shape
    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(out, inner, dtype=dtype)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def step():
        with torch.no_grad(), ctx:
            F.linear(x, w)

    return 2 * rows * inner * out / best(20 * iters, step) / 1e9


def torch_linear_backward(shape, rows, iters, dtype, autocast=False):
    """GFLOP/s of the linear backward's two products alone, `(dy @ w, dy.t() @ x)`, for `x`
    `[rows, in]`, `w` `[out, in]` and `dy` `[rows, out]`, as hetpar's `linear backward`
    line times its kernels."""
    out, inner = shape
    x, w = torch.randn(rows, inner, dtype=dtype), torch.randn(out, inner, dtype=dtype)
    dy = torch.randn(rows, out, dtype=dtype)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def dx():
        with torch.no_grad(), ctx:
            dy @ w

    def dw():
        with torch.no_grad(), ctx:
            dy.t() @ x

    flops = 2 * rows * inner * out
    return flops / best(20 * iters, dx) / 1e9, flops / best(20 * iters, dw) / 1e9


def torch_adamw(n, iters, dtype):
    """Seconds of one `torch.optim.AdamW` step over `n` parameters, the fastest of its CPU
    implementations (the per-tensor loop, `foreach` and `fused`)."""
    w = torch.nn.Parameter(torch.randn(n, dtype=dtype))
    w.grad = torch.randn(n, dtype=dtype)
    times = []
    for kind in ({}, {"foreach": True}, {"fused": True}):
        opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kind)
        times.append(best(3 * iters, opt.step))
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hetpar", default="target/release/hetpar", help="the hetpar binary")
    ap.add_argument("--iters", type=int, default=3, help="timed iterations per row and round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds (best kept); in each, every model row runs on both sides back to back")
    ap.add_argument("--pairs", type=int, default=1,
                    help="back-to-back pairs of each model row per round (the paired ratio's median "
                         "is over rounds x pairs; this VM's speed moves a pair's ratio by a few percent)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f64", "bf16"])
    ap.add_argument("--bf16", action="store_true",
                    help="after the table in --dtype, the same table in bf16")
    a = ap.parse_args()
    if a.rounds < 1 or a.pairs < 1 or a.iters < 1:
        ap.error("--rounds, --pairs and --iters must be at least 1")
    torch.set_num_threads(1)
    for dtype in [a.dtype] + (["bf16"] if a.bf16 and a.dtype != "bf16" else []):
        table(a, dtype)
        print()


def table(a, dtype):
    """One table: every row in `dtype` (bf16: f32 weights, bf16 products), both sides."""
    bf16 = dtype == "bf16"
    tdtype = torch.float64 if dtype == "f64" else torch.float32
    mm_dtype = torch.bfloat16 if bf16 else tdtype
    het, pt, het_mm, pt_mm = {}, {}, 0.0, 0.0
    het_adam, pt_adam = (0, float("inf")), float("inf")
    het_lin, pt_lin, lin_shape = {}, {}, None
    het_back, pt_back = {}, {}
    het_attn, pt_attn = {}, {}
    ratios = {k: [] for k in KEYS}
    # Each hetpar run's row rate over the matmul rate that run measured.
    shares = {k: [] for k in KEYS}
    for r in range(a.rounds):
        print(f"round {r + 1}/{a.rounds}: the short rows, hetpar then PyTorch {torch.__version__} ...",
              file=sys.stderr, flush=True)
        peak, _, adam, (lin_shape, lin, back), attn = hetpar_run(
            a.hetpar, a.iters, dtype, ["adamw", "linear", "attention"])
        for shape, t in attn.items():
            het_attn[shape] = min(het_attn.get(shape, t), t)
        for n, g in lin.items():
            het_lin[n] = max(het_lin.get(n, 0.0), g)
        for n, g in back.items():
            het_back[n] = tuple(max(u, v) for u, v in zip(het_back.get(n, (0.0, 0.0)), g))
        het_adam = (adam[0], min(het_adam[1], adam[1]))
        het_mm = max(het_mm, peak)
        pt_mm = max(pt_mm, torch_matmul(a.iters, mm_dtype))
        pt_adam = min(pt_adam, torch_adamw(het_adam[0], a.iters, tdtype))
        for n in het_lin:
            pt_lin[n] = max(pt_lin.get(n, 0.0), torch_linear(lin_shape, n, a.iters, tdtype, bf16))
        for n in het_back:
            g = torch_linear_backward(lin_shape, n, a.iters, tdtype, bf16)
            pt_back[n] = tuple(max(u, v) for u, v in zip(pt_back.get(n, (0.0, 0.0)), g))
        for shape in het_attn:
            t = torch_attention(shape, a.iters, tdtype, bf16)
            pt_attn[shape] = min(pt_attn.get(shape, t), t)
        # Each model row as a pair measured back to back (seconds apart, where whole rounds
        # are minutes apart: this machine's speed drifts over minutes), the side that goes
        # first alternating by round.
        for k in KEYS:
            print(f"round {r + 1}/{a.rounds}: {k}, both", file=sys.stderr, flush=True)
            for p in range(a.pairs):
                pair = {}
                # The side that goes first alternates by pair and by round.
                for side in (["hetpar", "torch"] if (r + p) % 2 == 0 else ["torch", "hetpar"]):
                    if side == "hetpar":
                        peak, rows, _, _, _ = hetpar_run(a.hetpar, a.iters, dtype, [k])
                        het_mm = max(het_mm, peak)
                        shares[k].append(rows[k][2] / peak)
                        pair[side] = rows[k][1]
                        het[k] = rows[k] if k not in het or rows[k][1] < het[k][1] else het[k]
                    else:
                        pair[side] = torch_row(k, a.iters, tdtype, autocast=bf16)
                        pt[k] = min(pt.get(k, pair[side]), pair[side])
                ratios[k].append(pair["hetpar"] / pair["torch"])
    what = "bf16 products, f32 weights (PyTorch: autocast)" if bf16 else dtype
    print(f"one core, {what}, best of {a.rounds} alternating rounds ({a.rounds * a.pairs} pairs for "
          f"the model rows) x {a.iters} iterations; "
          f"PyTorch {torch.__version__}; the model rows' pairs ({a.pairs} a round) measured back "
          f"to back, the ratio of "
          f"each pair's times as median (lowest-highest)")
    print()
    print("| what (forward+backward) | hetpar | PyTorch | hetpar / PyTorch | paired ratio | "
          "hetpar GFLOP/s | of hetpar's matmul | of its run's matmul |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| matmul rate (best of 512^3, 1024^3) | {het_mm:.1f} GFLOP/s | {pt_mm:.1f} GFLOP/s | "
          f"{pt_mm / het_mm:.2f} (time) | | | | |")
    for k in KEYS:
        name, t, g = het[k]
        rs, ss = sorted(ratios[k]), sorted(shares[k])
        paired = f"{statistics.median(rs):.2f} ({rs[0]:.2f}-{rs[-1]:.2f})"
        share = f"{100 * statistics.median(ss):.0f}% ({100 * ss[0]:.0f}-{100 * ss[-1]:.0f}%)"
        print(f"| {name} | {t * 1e3:.1f} ms | {pt[k] * 1e3:.1f} ms | {t / pt[k]:.2f} | {paired} | {g:.1f} | "
              f"{100 * g / het_mm:.0f}% | {share} |")
    n, t = het_adam
    print(f"| AdamW update of {n} parameters (no forward or backward) | {t * 1e3:.2f} ms | "
          f"{pt_adam * 1e3:.2f} ms | {t / pt_adam:.2f} | | | | |")
    out, inner = lin_shape
    for n in sorted(het_lin):
        h, p = het_lin[n], pt_lin[n]
        print(f"| linear forward alone, {n} x {inner} by {out} x {inner} (no backward) | {h:.1f} GFLOP/s | "
              f"{p:.1f} GFLOP/s | {p / h:.2f} (time) | | {h:.1f} | {100 * h / het_mm:.0f}% | |")
    for i, what in enumerate([f"dx = dy w ({{n}} x {out} by {out} x {inner})",
                              f"dw = dy^T x ({out} x {{n}} by {{n}} x {inner})"]):
        for n in sorted(het_back):
            h, p = het_back[n][i], pt_back[n][i]
            print(f"| linear backward alone, {what.format(n=n)} | {h:.1f} GFLOP/s | "
                  f"{p:.1f} GFLOP/s | {p / h:.2f} (time) | | {h:.1f} | {100 * h / het_mm:.0f}% | |")
    for shape in het_attn:
        h, p = het_attn[shape], pt_attn[shape]
        note = ", bf16 products on both sides" if bf16 else ""
        print(f"| attention core alone, {shape} (batch x seq : heads / kv heads : head dim, c causal{note}) | "
              f"{h * 1e3:.2f} ms | {p * 1e3:.2f} ms | {h / p:.2f} | | | | |")


if __name__ == "__main__":
    main()
