//! Compute benchmarks on one rank: forward+backward throughput of a transformer layer and of
//! the models, with the model FLOPs they achieve, next to a plain matmul's rate.
//!
//! Training FLOPs per token (forward + backward = 3x forward; Megatron, Narayanan et al.
//! 2021), with `q` the query width, `kv` the key/value width, `s` the sequence length:
//! attention projections `6*(h*(q + 2*kv) + q*h)`; core attention `6*q*s` under a causal
//! mask (half the score matrix counts) and `12*q*s` bidirectional; SwiGLU MLP `18*h*ffn`,
//! GELU MLP `12*h*ffn`; logits `6*h*V`. A MoE layer counts `top_k` experts and the router.
//! Our fused attention skips the 64 x 64 blocks of keys after every query but computes the
//! blocks on the diagonal whole (56% of the score matrix at `s` 512), so causal layers do a
//! little more arithmetic than they are credited with: the convention of the published
//! numbers we compare to.

use std::sync::Arc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use hetpar_comm::Communicator;
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::kernels::attention::FlashAttention;
use crate::kernels::linear::Matmul;
use crate::layers::attention::CpPositions;
use crate::layers::linear::Build;
use crate::models::llama::{Llama, LlamaBatch, LlamaConfig};
use crate::models::vit::{Vit, VitConfig};
use crate::params::HasParams;

/// One measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct NnBench {
    /// What ran.
    pub name: String,
    /// Tokens per iteration.
    pub tokens: usize,
    /// Seconds per forward+backward (best of the timed iterations).
    pub seconds: f64,
    /// Model FLOPs per iteration.
    pub flops: f64,
}

impl NnBench {
    /// Tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }

    /// Achieved model GFLOP/s.
    pub fn gflops(&self) -> f64 {
        self.flops / self.seconds / 1e9
    }
}

/// GFLOP/s of an `n x n` by `n x n` matmul in `dtype` (best of `iters`).
pub fn matmul_gflops(n: usize, iters: usize, dtype: DType) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?.to_dtype(dtype)?;
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) + 1 {
        let t = Instant::now();
        let c = a.matmul(&b)?;
        c.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / best / 1e9)
}

/// The reference matmul rate: the best of `iters` square products at 512 and at 1024 (one
/// size or a few products alone move with the machine's noise), GFLOP/s.
pub fn matmul_peak_gflops(iters: usize, dtype: DType) -> Result<f64> {
    let mut best = 0.0f64;
    for n in [512, 1024] {
        best = best.max(matmul_gflops(n, iters, dtype)?);
    }
    Ok(best)
}

/// GFLOP/s of the bf16 product of two `n x n` f32 matrices ([`crate::kernels::bf16`],
/// what the linear layers run under `dtype = "bf16"`), on as many threads as candle's
/// matmuls, best of `iters`.
pub fn bf16_matmul_gflops(n: usize, iters: usize) -> f64 {
    bf16_square_gflops(n, iters, crate::kernels::threads())
}

/// [`bf16_matmul_gflops`] on `threads` threads.
fn bf16_square_gflops(n: usize, iters: usize, threads: usize) -> f64 {
    use crate::kernels::{bf16, gemm::View};
    let (a, b) = square_operands::<f32>(n);
    let mut c = vec![0f32; n * n];
    let v = View::rows(0, n, n, n);
    best_rate(n, iters, || {
        bf16::matmul_on(&mut c, v, &a, v, &b, v, false, 1.0, threads);
        std::hint::black_box(&mut c);
    })
}

/// Two `n x n` operands of smooth values.
fn square_operands<T: crate::kernels::Real>(n: usize) -> (Vec<T>, Vec<T>) {
    let a = (0..n * n).map(|i| T::from_f64((i as f64 * 0.37).sin())).collect();
    let b = (0..n * n).map(|i| T::from_f64((i as f64 * 0.11).cos())).collect();
    (a, b)
}

/// GFLOP/s of `product`, an `n x n` by `n x n` product, the best of `iters` after one more.
fn best_rate(n: usize, iters: usize, mut product: impl FnMut()) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) + 1 {
        let t = Instant::now();
        product();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (n as f64).powi(3) / best / 1e9
}

/// [`bf16_matmul_gflops`] as the reference rate: the best at 512 and at 1024.
pub fn bf16_peak_gflops(iters: usize) -> f64 {
    bf16_matmul_gflops(512, iters).max(bf16_matmul_gflops(1024, iters))
}

/// GFLOP/s of `n x n` products on this thread alone (best of `iters`): in bf16 (f32
/// operands rounded, f32 sums) or in `dtype`.
fn one_thread_gflops(n: usize, iters: usize, dtype: DType, bf16: bool) -> Result<f64> {
    fn native<T: crate::kernels::Real>(n: usize, iters: usize) -> f64 {
        use crate::kernels::gemm::{View, matmul_on};
        let (a, b) = square_operands::<T>(n);
        let mut c = vec![T::ZERO; n * n];
        let v = View::rows(0, n, n, n);
        best_rate(n, iters, || {
            matmul_on(&mut c, v, &a, v, &b, v, false, T::ONE, 1);
            std::hint::black_box(&mut c);
        })
    }
    match (dtype, bf16) {
        (DType::F32, true) => Ok(bf16_square_gflops(n, iters, 1)),
        (DType::F32, false) => Ok(native::<f32>(n, iters)),
        (DType::F64, false) => Ok(native::<f64>(n, iters)),
        (other, _) => Err(NnError::Input(format!(
            "no reference matmul rate in {other:?}{}",
            if bf16 { " with bf16 products" } else { "" }
        ))),
    }
}

/// The reference rate of a job whose ranks compute on `cores` cores at once: as many
/// threads, each multiplying on its own at the same time (the best of `iters` 512^3 and
/// 1024^3 products each), their rates summed, GFLOP/s. Unlike [`matmul_peak_gflops`] it
/// does not follow candle's thread count, which the ranks' own threads do not use.
pub fn peak_on_cores(cores: usize, iters: usize, dtype: DType, how: Matmul) -> Result<f64> {
    let bf16 = how == Matmul::Bf16;
    std::thread::scope(|s| {
        let each: Vec<_> = (0..cores.max(1))
            .map(|_| {
                s.spawn(move || -> Result<f64> {
                    Ok(one_thread_gflops(512, iters, dtype, bf16)?
                        .max(one_thread_gflops(1024, iters, dtype, bf16)?))
                })
            })
            .collect();
        each.into_iter()
            .map(|h| h.join().map_err(|_| NnError::Input("a matmul thread panicked".into()))?)
            .sum()
    })
}

/// Row counts at which `bench nn` times the linear layers' forward product: the MoE
/// experts of the bench model see about 128 rows each, a small microbatch a few hundred.
pub const LINEAR_ROWS: [usize; 5] = [32, 64, 128, 256, 512];

/// GFLOP/s of the linear layers' forward product `x @ w^T` (the fused op they run, with
/// `how`'s products) for `x` `[rows, inner]` and `w` `[out, inner]` in `dtype`, best of
/// `iters`.
pub fn linear_gflops(
    (rows, inner, out): (usize, usize, usize),
    iters: usize,
    dtype: DType,
    how: Matmul,
) -> Result<f64> {
    let x = Tensor::randn(0f32, 1.0, (rows, inner), &Device::Cpu)?.to_dtype(dtype)?;
    let w = Tensor::randn(0f32, 1.0, (out, inner), &Device::Cpu)?.to_dtype(dtype)?;
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) + 1 {
        let t = Instant::now();
        std::hint::black_box(crate::kernels::linear::linear_as(how, &x, &w)?);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (rows * inner * out) as f64 / best / 1e9)
}

/// GFLOP/s of the linear layers' two backward products for `x` `[rows, inner]`, `w` `[out,
/// inner]` and the output's gradient `dy` `[rows, out]` in `dtype` (the kernels their
/// backward runs, with `how`'s products), each the best of `iters` after a warm-up: `(dx =
/// dy w, dw = dy^T x)`. At a few rows these are the products an MoE expert's backward is
/// made of.
pub fn linear_backward_gflops(
    dims: (usize, usize, usize),
    iters: usize,
    dtype: DType,
    how: Matmul,
) -> Result<(f64, f64)> {
    match dtype {
        DType::F32 => linear_backward_rates::<f32>(dims, iters, how),
        DType::F64 => linear_backward_rates::<f64>(dims, iters, how),
        other => Err(NnError::Input(format!(
            "the linear backward's products run in f32 and f64, not {other:?}"
        ))),
    }
}

fn linear_backward_rates<T: crate::kernels::Real>(
    (rows, inner, out): (usize, usize, usize),
    iters: usize,
    how: Matmul,
) -> Result<(f64, f64)> {
    use crate::kernels::linear::{input_grad, weight_grad_of};
    let data = |r, c| {
        Tensor::randn(0f32, 1.0, (r, c), &Device::Cpu)?
            .to_dtype(<T as candle_core::WithDType>::DTYPE)?
            .flatten_all()?
            .to_vec1()
    };
    let (x, w, dy): (Vec<T>, Vec<T>, Vec<T>) =
        (data(rows, inner)?, data(out, inner)?, data(rows, out)?);
    let dims = (rows, inner, out);
    let dx = time(iters, || {
        std::hint::black_box(input_grad(how, &w, &dy, dims)?);
        Ok(())
    })?;
    let dw = time(iters, || {
        std::hint::black_box(weight_grad_of(how, &x, &dy, dims)?);
        Ok(())
    })?;
    let gflop = 2.0 * (rows * inner * out) as f64 / 1e9;
    Ok((gflop / dx, gflop / dw))
}

/// GFLOP/s of a bidirectional attention core (`softmax(q k^T / sqrt(d)) v` over `heads`
/// heads of `s x d`, the fused kernel the layers run) in `dtype`, forward only, best of
/// `iters`: `4 * heads * s^2 * d` FLOPs.
pub fn attention_gflops(
    s: usize,
    d: usize,
    heads: usize,
    iters: usize,
    dtype: DType,
) -> Result<f64> {
    let make = || Tensor::randn(0f32, 1.0, (1, s, heads, d), &Device::Cpu)?.to_dtype(dtype);
    let (q, k, v) = (make()?, make()?, make()?);
    let pos = Arc::new((0..s).collect::<Vec<_>>());
    let scale = 1.0 / (d as f64).sqrt();
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) + 1 {
        let t = Instant::now();
        let out =
            FlashAttention::new(pos.clone(), pos.clone(), false, scale, false).apply(&q, &k, &v)?;
        out.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(4.0 * heads as f64 * (s * s * d) as f64 / best / 1e9)
}

/// An attention core's shape: `batch` sequences of `seq` positions, `heads` query heads
/// sharing `kv_heads` key/value heads of `dim`, causal or bidirectional.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Positions per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dim.
    pub dim: usize,
    /// Under the causal mask.
    pub causal: bool,
}

impl std::fmt::Display for AttentionShape {
    /// `BxS:HQ/HKV:D`, `c` at the end if causal.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = if self.causal { "c" } else { "" };
        let AttentionShape { batch, seq, heads, kv_heads, dim, .. } = *self;
        write!(f, "{batch}x{seq}:{heads}/{kv_heads}:{dim}{c}")
    }
}

/// The attention cores of the `bench nn` rows: the ViT's (4 images of 196 patches, 6
/// heads), the layer's (512 positions, 8 query heads on 2 key/value heads, causal) and the
/// model's (2 x 256, causal).
pub const ATTENTION_SHAPES: [AttentionShape; 3] = [
    AttentionShape { batch: 4, seq: 196, heads: 6, kv_heads: 6, dim: 64, causal: false },
    AttentionShape { batch: 1, seq: 512, heads: 8, kv_heads: 2, dim: 64, causal: true },
    AttentionShape { batch: 2, seq: 256, heads: 8, kv_heads: 2, dim: 64, causal: true },
];

/// Seconds of the fused attention kernel's forward and backward (of the output's sum, the
/// gradients of `q`, `k` and `v`) on `shape` in `dtype`, its products multiplying as
/// `matmul` says, best of `iters`.
pub fn attention_seconds(
    shape: AttentionShape,
    iters: usize,
    dtype: DType,
    matmul: Matmul,
) -> Result<f64> {
    let AttentionShape { batch, seq, heads, kv_heads, dim, causal } = shape;
    let make = |h: usize, name: &str| -> Result<Var> {
        Ok(Var::from_tensor(&random(&[batch, seq, h, dim], dtype, name)?)?)
    };
    let (q, k, v) = (make(heads, "q")?, make(kv_heads, "k")?, make(kv_heads, "v")?);
    let pos = Arc::new((0..seq).collect::<Vec<_>>());
    let scale = 1.0 / (dim as f64).sqrt();
    let step = || -> Result<()> {
        let out = FlashAttention::new(pos.clone(), pos.clone(), causal, scale, false)
            .with_matmul(matmul)
            .apply(&q, &k, &v)?;
        std::hint::black_box(out.sum_all()?.backward()?);
        Ok(())
    };
    time(iters, step)
}

/// Training FLOPs per token of one decoder layer of `cfg` at sequence length `s`.
pub fn llama_layer_flops(cfg: &LlamaConfig, s: usize) -> f64 {
    let (h, d) = (cfg.hidden as f64, (cfg.hidden / cfg.heads) as f64);
    let (q, kv) = (cfg.heads as f64 * d, cfg.kv_heads as f64 * d);
    let attn = 6.0 * (h * (q + 2.0 * kv) + q * h) + 6.0 * q * s as f64;
    let mlp = if cfg.experts > 0 {
        18.0 * h * cfg.ffn as f64 * cfg.top_k as f64 + 6.0 * h * cfg.experts as f64
    } else {
        18.0 * h * cfg.ffn as f64
    };
    attn + mlp
}

/// Training FLOPs per token of the whole LLM.
pub fn llama_flops(cfg: &LlamaConfig, s: usize) -> f64 {
    cfg.layers as f64 * llama_layer_flops(cfg, s) + 6.0 * cfg.hidden as f64 * cfg.vocab as f64
}

/// Training FLOPs per patch of the ViT with its projector. The patch embedding counts its
/// forward and its weight's gradient: the pixels take no gradient (neither here nor in
/// PyTorch).
pub fn vit_flops(cfg: &VitConfig) -> f64 {
    let (h, s, p) = (cfg.hidden as f64, cfg.patches() as f64, cfg.patch_size as f64);
    let layer = 6.0 * 4.0 * h * h + 12.0 * h * s + 12.0 * h * cfg.ffn as f64;
    let out = cfg.out_hidden as f64;
    cfg.layers as f64 * layer + 4.0 * 3.0 * p * p * h + 6.0 * (h * out + out * out)
}

fn one_rank(comm: &dyn Communicator) -> Result<Arc<ParallelCtx>> {
    let l = ModuleLayout::new("bench", Span::new(0, 1), LayoutSpec::default())
        .map_err(|e| NnError::Input(e.to_string()))?;
    ParallelCtx::new(comm, &l)
}

/// Reads every parameter's gradient once, as a training step does: the fused linear
/// layers leave their weights' gradients in the parameters' sinks.
fn take_grads(model: &impl HasParams, store: &GradStore) -> Result<()> {
    for p in model.params() {
        std::hint::black_box(p.take_grad(store)?);
    }
    Ok(())
}

fn time(iters: usize, mut step: impl FnMut() -> Result<()>) -> Result<f64> {
    step()?;
    let mut best = f64::INFINITY;
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        step()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// One decoder layer of `cfg` (`cfg.layers` ignored) on `batch x seq` tokens.
pub fn bench_llama_layer(
    comm: &dyn Communicator,
    cfg: LlamaConfig,
    batch: usize,
    seq: usize,
    iters: usize,
    dtype: DType,
    matmul: Matmul,
) -> Result<NnBench> {
    let b = Build::new(one_rank(comm)?, 1, dtype).with_matmul(matmul);
    let model = Llama::stage(&b, cfg, 0..1, false, false)?;
    let x = random(&[batch, seq, cfg.hidden], dtype, "bench-input")?;
    let positions = CpPositions::single(seq);
    let seconds = time(iters, || {
        let (y, aux) = model.layers(&x, &positions)?;
        take_grads(&model, &(y.sum_all()? + aux)?.backward()?)
    })?;
    let kind = if cfg.experts > 0 { "MoE" } else { "dense" };
    Ok(NnBench {
        name: format!("llama layer ({kind}, h {} ffn {} s {seq})", cfg.hidden, cfg.ffn),
        tokens: batch * seq,
        seconds,
        flops: llama_layer_flops(&cfg, seq) * (batch * seq) as f64,
    })
}

/// The whole LLM with its loss on `batch x seq` tokens.
pub fn bench_llama(
    comm: &dyn Communicator,
    cfg: LlamaConfig,
    batch: usize,
    seq: usize,
    iters: usize,
    dtype: DType,
    matmul: Matmul,
) -> Result<NnBench> {
    let b = Build::new(one_rank(comm)?, 1, dtype).with_matmul(matmul);
    let model = Llama::new(&b, cfg)?;
    let n = batch * seq;
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 7919) % cfg.vocab) as u32).collect();
    let targets: Vec<i64> = (0..n).map(|i| ((i * 104_729) % cfg.vocab) as i64).collect();
    let input = LlamaBatch {
        tokens,
        batch,
        positions: CpPositions::single(seq),
        boundary: None,
        targets: Arc::new(targets),
    };
    let seconds = time(iters, || {
        let out = model.forward(&input)?;
        take_grads(&model, &((out.loss_sum / n as f64)? + out.aux)?.backward()?)
    })?;
    let kind = if cfg.experts > 0 {
        format!("MoE {}x top-{}", cfg.experts, cfg.top_k)
    } else {
        "dense".into()
    };
    Ok(NnBench {
        name: format!("llama model ({kind}, {} layers, h {}, s {seq})", cfg.layers, cfg.hidden),
        tokens: n,
        seconds,
        flops: llama_flops(&cfg, seq) * n as f64,
    })
}

/// The ViT with its projector on `images` images.
pub fn bench_vit(
    comm: &dyn Communicator,
    cfg: VitConfig,
    images: usize,
    iters: usize,
    dtype: DType,
    matmul: Matmul,
) -> Result<NnBench> {
    let b = Build::new(one_rank(comm)?, 1, dtype).with_matmul(matmul);
    let vit = Vit::new(&b, cfg)?;
    let pixels = random(&[images, 3, cfg.image_size, cfg.image_size], dtype, "bench-input")?;
    let seconds = time(iters, || take_grads(&vit, &vit.forward(&pixels)?.sum_all()?.backward()?))?;
    let n = images * cfg.patches();
    Ok(NnBench {
        name: format!(
            "vit + projector ({} layers, h {}, {} patches)",
            cfg.layers,
            cfg.hidden,
            cfg.patches()
        ),
        tokens: n,
        seconds,
        flops: vit_flops(&cfg) * n as f64,
    })
}

/// Standard normal values of `shape` in `dtype`, the stream named `name`.
fn random(shape: &[usize], dtype: DType, name: &str) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let value = Init::Normal(1.0).values(3, name);
    let v: Vec<f64> = (0..n).map(|i| value(i as u64)).collect();
    Ok(Tensor::from_vec(v, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// Seconds of one AdamW update of `n` parameters in `dtype`, best of `iters`: the fused
/// in-place kernel ([`crate::kernels::adam::adamw_step`]) and the same update as
/// element-wise tensor ops ([`crate::kernels::reference::adamw`]).
pub fn bench_adamw(n: usize, iters: usize, dtype: DType) -> Result<(f64, f64)> {
    use crate::kernels::adam::{AdamStep, adamw_step};
    let step = AdamStep {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        scale: 1.0,
        bc1: 0.1,
        bc2: 0.001,
        lr: 1e-3,
        decay: 0.1,
    };
    let (w, g) = (random(&[n], dtype, "bench-input")?, random(&[n], dtype, "bench-input")?);
    let (m, v) = (Tensor::zeros(n, dtype, &Device::Cpu)?, Tensor::zeros(n, dtype, &Device::Cpu)?);
    let fused = time(iters, || {
        adamw_step(&w, &g, &m, &v, step)?;
        Ok(())
    })?;
    let composed = time(iters, || {
        let (w2, m2, v2) = crate::kernels::reference::adamw(&w, &g, &m, &v, &step)?;
        w2.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        drop((m2, v2));
        Ok(())
    })?;
    Ok((fused, composed))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// The training's reference rate runs in each element type it is asked for, on several
    /// threads at once, and refuses bf16 products of f64 and the other element types.
    #[test]
    fn the_reference_rate_covers_the_element_types_and_refuses_the_rest() {
        for (dtype, how) in
            [(DType::F32, Matmul::Native), (DType::F64, Matmul::Native), (DType::F32, Matmul::Bf16)]
        {
            let rate = peak_on_cores(2, 1, dtype, how).unwrap();
            assert!(rate.is_finite() && rate > 0.0, "{dtype:?} {how:?}: {rate}");
        }
        assert!(peak_on_cores(1, 1, DType::F64, Matmul::Bf16).is_err());
        let e = peak_on_cores(1, 1, DType::F16, Matmul::Native).unwrap_err();
        assert!(e.to_string().contains("F16"), "{e}");
    }
}
