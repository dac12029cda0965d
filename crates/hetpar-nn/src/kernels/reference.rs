//! The unfused compositions of candle tensor ops that the kernels replace, kept as the
//! references the kernel tests hold them to (and readable statements of what each kernel
//! computes).

use candle_core::{D, Device, Tensor};

use super::CResult;
use super::adam::AdamStep;
use super::pointwise::RopeTables;
use crate::layers::attention::softmax;

/// `[b, kv, s, d]` to `[b, kv * rep, s, d]`, each K/V head serving `rep` query heads.
pub fn repeat_kv(x: &Tensor, rep: usize) -> CResult<Tensor> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let (b, kv, s, d) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, kv, rep, s, d))?.contiguous()?.reshape((b, kv * rep, s, d))
}

/// Masked scores `[b, heads, s_q, s_k]` of `q` `[b, s_q, heads, d]` against `k`
/// `[b, s_k, kv_heads, d]`, and the values with their heads repeated, head-major.
fn scores(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: (&[usize], &[usize]),
    causal: bool,
    scale: f64,
) -> CResult<(Tensor, Tensor)> {
    let rep = q.dim(2)? / k.dim(2)?;
    let heads = |t: &Tensor| t.transpose(1, 2)?.contiguous();
    let (q, k, v) = (heads(q)?, repeat_kv(&heads(k)?, rep)?, repeat_kv(&heads(v)?, rep)?);
    let s = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?;
    if !causal {
        return Ok((s, v));
    }
    let (q_pos, k_pos) = pos;
    let m: Vec<f64> = q_pos
        .iter()
        .flat_map(|&q| k_pos.iter().map(move |&k| if k <= q { 0.0 } else { f64::NEG_INFINITY }))
        .collect();
    let m = Tensor::from_vec(m, (q_pos.len(), k_pos.len()), &Device::Cpu)?.to_dtype(s.dtype())?;
    Ok((s.broadcast_add(&m)?, v))
}

/// `softmax(scale * q k^T + mask) v`, `[b, s_q, heads, d]`, with the full score matrix.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: (&[usize], &[usize]),
    causal: bool,
    scale: f64,
) -> CResult<Tensor> {
    let (s, v) = scores(q, k, v, pos, causal, scale)?;
    softmax(&s)?.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// [`attention`] and the log-sum-exp of each row's scores, `[b, s_q, heads, 1]`.
pub fn attention_lse(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: (&[usize], &[usize]),
    causal: bool,
    scale: f64,
) -> CResult<(Tensor, Tensor)> {
    let (s, vr) = scores(q, k, v, pos, causal, scale)?;
    let m = s.max_keepdim(D::Minus1)?.detach();
    let lse = (s.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
    let out = softmax(&s)?.matmul(&vr)?.transpose(1, 2)?.contiguous()?;
    Ok((out, lse.transpose(1, 2)?.contiguous()?))
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dim.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> CResult<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(weight)
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dim.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> CResult<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    centered.broadcast_div(&(var + eps)?.sqrt()?)?.broadcast_mul(weight)?.broadcast_add(bias)
}

/// The exact GELU `x (1 + erf(x / sqrt 2)) / 2`, through candle's `erf` (whose backward is
/// exact, unlike that of its fused `gelu_erf`).
pub fn gelu(x: &Tensor) -> CResult<Tensor> {
    (x * 0.5)? * ((x * std::f64::consts::FRAC_1_SQRT_2)?.erf()? + 1.0)?
}

/// Rotate-half RoPE of `x` `[b, s, heads, d]` by `tables` (one row per position).
pub fn rope(x: &Tensor, tables: &RopeTables) -> CResult<Tensor> {
    let d = x.dim(D::Minus1)?;
    let s = x.dim(1)?;
    let table = |v: &[f64]| {
        Tensor::from_vec(v.to_vec(), (1, s, 1, tables.half), &Device::Cpu)?.to_dtype(x.dtype())
    };
    let (cos, sin) = (table(&tables.cos)?, table(&tables.sin)?);
    let (x1, x2) = (x.narrow(D::Minus1, 0, d / 2)?, x.narrow(D::Minus1, d / 2, d / 2)?);
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[a, b], D::Minus1)
}

/// `x [.., in] @ w^T` with `w [out, in]`, as a reshape, a transpose and a matmul.
pub fn linear(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    let dims = x.dims().to_vec();
    let (rows, inner) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
    let y = x.reshape((rows, inner))?.matmul(&w.t()?)?;
    let mut out = dims;
    *out.last_mut().expect("a feature dim") = w.dims()[0];
    y.reshape(out)
}

/// `x + bias` broadcast over the rows of `x`.
pub fn bias_add(x: &Tensor, bias: &Tensor) -> CResult<Tensor> {
    x.broadcast_add(bias)
}

/// Per-row cross-entropy `logsumexp(row) - row[target]` of `logits` `[n, vocab]`, 0 where
/// the target is negative.
pub fn cross_entropy(logits: &Tensor, targets: &[i64]) -> CResult<Tensor> {
    let m = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits.broadcast_sub(&m)?.exp()?.sum_keepdim(D::Minus1)?.log()? + m)?;
    let idx: Vec<u32> = targets.iter().map(|&t| t.max(0) as u32).collect();
    let idx = Tensor::from_vec(idx, (targets.len(), 1), &Device::Cpu)?;
    let keep: Vec<f64> = targets.iter().map(|&t| if t < 0 { 0.0 } else { 1.0 }).collect();
    let keep = Tensor::from_vec(keep, targets.len(), &Device::Cpu)?.to_dtype(logits.dtype())?;
    (lse - logits.gather(&idx, 1)?)?.squeeze(1)? * keep
}

/// `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.silu()? * up
}

/// One AdamW update as element-wise tensor ops: the new weights and moments of `w` from its
/// gradient `g` and moments `m`, `v`.
pub fn adamw(
    w: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &AdamStep,
) -> CResult<(Tensor, Tensor, Tensor)> {
    let g = g.affine(s.scale, 0.0)?;
    let m = ((m * s.beta1)? + (&g * (1.0 - s.beta1))?)?;
    let v = ((v * s.beta2)? + (g.sqr()? * (1.0 - s.beta2))?)?;
    let denom = ((&v / s.bc2)?.sqrt()? + s.eps)?;
    let step = ((&m / s.bc1)? / denom)?;
    let w = (w.affine(1.0 - s.lr * s.decay, 0.0)? - (step * s.lr)?)?;
    Ok((w, m, v))
}
