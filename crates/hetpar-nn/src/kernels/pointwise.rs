//! Row-wise and element-wise kernels with their backward: RMSNorm (Zhang and Sennrich
//! 2019), LayerNorm (Ba et al. 2016), the exact GELU, rotary embedding in HF Llama's rotate-half form (Su et al. 2021) on
//! `[b, s, heads, d]`, and the SwiGLU product `silu(gate) * up` (Shazeer 2020). Each runs
//! one pass over its input where the unfused form ran four to eight tensor ops, each
//! writing a tensor.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Error, Layout, Shape, Tensor};

use super::linear::Matmul;
use super::written::{PART, written, written_pair};
use super::{
    CResult, LANES, Real, by_real, by_real_dtype, dot, gelu_backward_f32, gelu_backward_f32_lanes,
    normal_cdf_f32_fast_lanes, normal_cdf_f32_lanes, simd, slice, sum, sum_map, with_data,
};

/// The row width `h` of `x` `[.., h]`, checking that each of `params` is `[h]`.
fn row_width(op: &str, x: &Shape, params: &[&Shape]) -> CResult<usize> {
    let h = x.dims().last().copied().unwrap_or(0);
    match params.iter().find(|p| p.dims() != [h]) {
        Some(p) => Err(Error::Msg(format!("{op}: parameter {p:?} for rows of {x:?}"))),
        None if h == 0 => Err(Error::Msg(format!("{op}: empty rows in {x:?}"))),
        None => Ok(h),
    }
}

/// `x / sqrt(mean(x^2) + eps) * weight` over the last dim: `x` `[.., h]`, `weight` `[h]`.
#[derive(Clone, Debug)]
pub struct RmsNormOp {
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNormOp {
    #[inline(always)]
    pub(crate) fn forward<T: Real>(&self, x: &[T], w: &[T], h: usize) -> Vec<T> {
        written(
            x.len(),
            h,
            #[inline(always)]
            |start, row| {
                let xr = &x[start..start + row.len()];
                let r = self.inv_rms(xr, h);
                row.map2(xr, w, |xv, wv| xv * r * wv)
            },
        )
    }

    #[inline(always)]
    fn inv_rms<T: Real>(&self, xr: &[T], h: usize) -> T {
        T::ONE / (dot(xr, xr) / T::from_f64(h as f64) + T::from_f64(self.eps)).sqrt()
    }

    /// `dx = r (g - xhat mean(g xhat))` with `g = dy w`, `xhat = r x`; `dw = sum dy xhat`.
    #[inline(always)]
    pub(crate) fn backward<T: Real>(
        &self,
        x: &[T],
        w: &[T],
        dy: &[T],
        h: usize,
    ) -> (Vec<T>, Vec<T>) {
        let mut dw = vec![T::ZERO; h];
        let mut g = vec![T::ZERO; h];
        let mut xhat = vec![T::ZERO; h];
        let hf = T::from_f64(h as f64);
        let dx = written(
            x.len(),
            h,
            #[inline(always)]
            |start, row| {
                let (xr, dyr) = (&x[start..start + h], &dy[start..start + h]);
                let r = self.inv_rms(xr, h);
                for j in 0..h {
                    xhat[j] = xr[j] * r;
                    g[j] = dyr[j] * w[j];
                    dw[j] += dyr[j] * xhat[j];
                }
                let c = dot(&g, &xhat) / hf;
                row.map2(&g, &xhat, |gj, xj| r * (gj - xj * c))
            },
        );
        (dx, dw)
    }
}

impl CustomOp2 for RmsNormOp {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let h = row_width("rms-norm", l1.shape(), &[l2.shape()])?;
        by_real!(s1, "rms-norm", |T| {
            let (x, w) = (slice::<T>(s1, l1, "rms-norm")?, slice::<T>(s2, l2, "rms-norm")?);
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    self.forward(x, w, h)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let h = row_width("rms-norm", x.shape(), &[w.shape()])?;
        let grad = grad.contiguous()?;
        fn run<T: Real>(
            op: &RmsNormOp,
            x: &Tensor,
            w: &Tensor,
            grad: &Tensor,
            h: usize,
        ) -> CResult<(Tensor, Tensor)> {
            let (dx, dw) = with_data::<T, _>(x, "rms-norm", |xd| {
                with_data::<T, _>(w, "rms-norm", |wd| {
                    with_data::<T, _>(grad, "rms-norm", |gd| {
                        Ok(simd::fast!(op.backward(xd, wd, gd, h)))
                    })
                })
            })?;
            Ok((Tensor::from_vec(dx, x.shape(), x.device())?, Tensor::from_vec(dw, h, x.device())?))
        }
        let (dx, dw) = by_real_dtype!(x.dtype(), "rms-norm", |T| run::<T>(self, x, w, &grad, h))?;
        Ok((Some(dx), Some(dw)))
    }
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dim: `x` `[.., h]`,
/// `weight` and `bias` `[h]`.
#[derive(Clone, Debug)]
pub struct LayerNormOp {
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNormOp {
    /// Mean and `1 / sqrt(var + eps)` of a row.
    #[inline(always)]
    fn stats<T: Real>(&self, xr: &[T], hf: T) -> (T, T) {
        let mean = sum(xr) / hf;
        let var = sum_map(xr, |x| (x - mean) * (x - mean)) / hf;
        (mean, T::ONE / (var + T::from_f64(self.eps)).sqrt())
    }

    #[inline(always)]
    pub(crate) fn forward<T: Real>(&self, x: &[T], w: &[T], b: &[T], h: usize) -> Vec<T> {
        let hf = T::from_f64(h as f64);
        written(
            x.len(),
            h,
            #[inline(always)]
            |start, row| {
                let xr = &x[start..start + row.len()];
                let (mean, r) = self.stats(xr, hf);
                row.map3(xr, w, b, |xv, wv, bv| (xv - mean) * r * wv + bv)
            },
        )
    }

    /// `dx = r (g - mean(g) - xhat mean(g xhat))` with `g = dy w`; `dw = sum dy xhat`,
    /// `db = sum dy`.
    #[inline(always)]
    pub(crate) fn backward<T: Real>(&self, x: &[T], w: &[T], dy: &[T], h: usize) -> [Vec<T>; 3] {
        let hf = T::from_f64(h as f64);
        let (mut dw, mut db) = (vec![T::ZERO; h], vec![T::ZERO; h]);
        let (mut g, mut xhat) = (vec![T::ZERO; h], vec![T::ZERO; h]);
        let dx = written(
            x.len(),
            h,
            #[inline(always)]
            |start, row| {
                let (xr, dyr) = (&x[start..start + h], &dy[start..start + h]);
                let (mean, r) = self.stats(xr, hf);
                for j in 0..h {
                    xhat[j] = (xr[j] - mean) * r;
                    g[j] = dyr[j] * w[j];
                    dw[j] += dyr[j] * xhat[j];
                    db[j] += dyr[j];
                }
                let (mg, mgx) = (sum(&g) / hf, dot(&g, &xhat) / hf);
                row.map2(&g, &xhat, |gj, xj| r * (gj - mg - xj * mgx))
            },
        );
        [dx, dw, db]
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let h = row_width("layer-norm", l1.shape(), &[l2.shape(), l3.shape()])?;
        by_real!(s1, "layer-norm", |T| {
            let x = slice::<T>(s1, l1, "layer-norm")?;
            let (w, b) = (slice::<T>(s2, l2, "layer-norm")?, slice::<T>(s3, l3, "layer-norm")?);
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    self.forward(x, w, b, h)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let h = row_width("layer-norm", x.shape(), &[w.shape(), b.shape()])?;
        let grad = grad.contiguous()?;
        fn run<T: Real>(
            op: &LayerNormOp,
            x: &Tensor,
            w: &Tensor,
            grad: &Tensor,
            h: usize,
        ) -> CResult<[Tensor; 3]> {
            let [dx, dw, db] = with_data::<T, _>(x, "layer-norm", |xd| {
                with_data::<T, _>(w, "layer-norm", |wd| {
                    with_data::<T, _>(grad, "layer-norm", |gd| {
                        Ok(simd::fast!(op.backward(xd, wd, gd, h)))
                    })
                })
            })?;
            let dev = x.device();
            Ok([
                Tensor::from_vec(dx, x.shape(), dev)?,
                Tensor::from_vec(dw, h, dev)?,
                Tensor::from_vec(db, h, dev)?,
            ])
        }
        let [dx, dw, db] =
            by_real_dtype!(x.dtype(), "layer-norm", |T| run::<T>(self, x, w, &grad, h))?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The exact GELU `x Phi(x) = x (1 + erf(x / sqrt 2)) / 2` (Hendrycks and Gimpel 2016),
/// and its backward `dy (Phi(x) + x phi(x))` (candle's own `gelu_erf` backward rounds
/// `1 / sqrt(2 pi)` to six digits).
/// - In f32, `Phi` is [`super::normal_cdf_f32`] and the backward
///   [`super::gelu_backward_f32`]: for `|x| <= 3.5` each a polynomial evaluated in f64, the
///   CDF correctly rounded but within 1e-10 of a tie, the backward within half an ulp plus
///   6e-13 of `|dy|`; beyond, `Phi` within two ulp and the backward reading `Phi` off the
///   forward's output as `y / x`, with one `exp` for `phi`.
/// - In f64, `Phi` is through candle's `erf`, and the backward reads `Phi` off the output.
/// - Under bf16 products (`how`), `Phi` and `exp` are evaluated in f32
///   ([`super::normal_cdf_f32_fast`], [`super::exp_f32_fast`]: within 8 ulp and one), the
///   backward from the output.
#[derive(Clone, Copy, Debug, Default)]
pub struct GeluOp {
    /// How the step's products multiply: [`Matmul::Bf16`] takes the f32-evaluated forms.
    pub how: Matmul,
}

/// The standard normal CDF of the element type.
pub(crate) trait NormalCdf: Real {
    fn cdf(self) -> Self;

    /// `x Phi(x)` of every element of `x`, `Phi` as a step whose products multiply `how`
    /// takes it (the f32-evaluated form under bf16 products, in f32).
    #[inline(always)]
    fn gelu(x: &[Self], _how: Matmul) -> Vec<Self> {
        written(x.len(), x.len(), |_, all| all.map(x, |v| v * v.cdf()))
    }

    /// The GELU's backward `dy (Phi(x) + x phi(x))` of every element, from the forward's
    /// output `y` ([`gelu_backward_from_output`]).
    #[inline(always)]
    fn gelu_backward(x: &[Self], y: &[Self], dy: &[Self], how: Matmul) -> Vec<Self> {
        gelu_backward_from_output(x, y, dy, how)
    }
}

/// `dy (Phi(x) + x phi(x))`, `Phi(x)` as `y / x` from the forward's output `y`, `phi`
/// through [`Real::exp_in_place_as`].
#[inline(always)]
fn gelu_backward_from_output<T: Real>(x: &[T], y: &[T], dy: &[T], how: Matmul) -> Vec<T> {
    let (half, pdf) = (T::from_f64(0.5), T::from_f64(1.0 / (2.0 * std::f64::consts::PI).sqrt()));
    let tiny = T::from_f64(1e-30);
    // The exponentials into a scratch part ([`Real::exp_in_place_as`]: LANES at a time in
    // f32), then the rest.
    let mut e = [T::ZERO; PART];
    written(
        x.len(),
        PART,
        #[inline(always)]
        |start, part| {
            let n = part.len();
            let (x, y, dy) = (&x[start..start + n], &y[start..start + n], &dy[start..start + n]);
            let e = &mut e[..n];
            for (e, &v) in e.iter_mut().zip(x) {
                *e = -(v * v) * half;
            }
            T::exp_in_place_as(e, how);
            part.map4([x, y, dy, &*e], |v, u, g, e| {
                let cdf = if v.larger(-v) < tiny { half } else { u / v };
                g * (cdf + v * pdf * e)
            })
        },
    )
}

impl NormalCdf for f32 {
    #[inline(always)]
    fn cdf(self) -> f32 {
        super::normal_cdf_f32(self)
    }

    /// The CDF [`LANES`] elements at a time through [`normal_cdf_f32_lanes`] (the same
    /// bits), or [`normal_cdf_f32_fast_lanes`] under bf16 products, into a scratch part of
    /// [`PART`], then the products.
    #[inline(always)]
    fn gelu(x: &[f32], how: Matmul) -> Vec<f32> {
        let mut cdf = [0.0f32; PART];
        written(
            x.len(),
            PART,
            #[inline(always)]
            |start, part| {
                let (xs, cdf) = (&x[start..start + part.len()], &mut cdf[..part.len()]);
                let (mut cc, xc) = (cdf.chunks_exact_mut(LANES), xs.chunks_exact(LANES));
                let xr = xc.remainder();
                for (c, xs) in (&mut cc).zip(xc) {
                    let xs: &[f32; LANES] = xs.try_into().expect("chunks of LANES");
                    c.copy_from_slice(&match how {
                        Matmul::Native => normal_cdf_f32_lanes(*xs),
                        Matmul::Bf16 => normal_cdf_f32_fast_lanes(*xs),
                    });
                }
                for (c, &v) in cc.into_remainder().iter_mut().zip(xr) {
                    *c = match how {
                        Matmul::Native => v.cdf(),
                        Matmul::Bf16 => super::normal_cdf_f32_fast(v),
                    };
                }
                part.map2(xs, cdf, |v, c| v * c)
            },
        )
    }

    /// [`gelu_backward_f32_lanes`] [`LANES`] elements at a time (the tail one at a time, the
    /// same bits); under bf16 products the form from the output, its `phi` evaluated in f32.
    #[inline(always)]
    fn gelu_backward(x: &[f32], y: &[f32], dy: &[f32], how: Matmul) -> Vec<f32> {
        if how == Matmul::Bf16 {
            return gelu_backward_from_output(x, y, dy, how);
        }
        written(
            x.len(),
            PART,
            #[inline(always)]
            |start, part| {
                let n = part.len();
                let (x, y, dy) =
                    (&x[start..start + n], &y[start..start + n], &dy[start..start + n]);
                // Closures inline, or they would run on the baseline target (see `written`).
                #[inline(always)]
                fn lanes(s: &[f32]) -> [f32; LANES] {
                    s.try_into().expect("LANES")
                }
                part.lanes(
                    #[inline(always)]
                    |i| {
                        let at = i..i + LANES;
                        let (xs, ys, gs) = (&x[at.clone()], &y[at.clone()], &dy[at]);
                        gelu_backward_f32_lanes(lanes(xs), lanes(ys), lanes(gs))
                    },
                    #[inline(always)]
                    |i| gelu_backward_f32(x[i], y[i], dy[i]),
                )
            },
        )
    }
}

impl NormalCdf for f64 {
    fn cdf(self) -> f64 {
        0.5 * (1.0 + candle_core::cpu::erf::erf_f64(self * std::f64::consts::FRAC_1_SQRT_2))
    }
}

impl GeluOp {
    #[inline(always)]
    pub(crate) fn forward<T: NormalCdf>(x: &[T], how: Matmul) -> Vec<T> {
        T::gelu(x, how)
    }

    /// `dy (Phi(x) + x phi(x))` ([`NormalCdf::gelu_backward`]).
    #[inline(always)]
    pub(crate) fn backward<T: NormalCdf>(x: &[T], y: &[T], dy: &[T], how: Matmul) -> Vec<T> {
        T::gelu_backward(x, y, dy, how)
    }
}

impl CustomOp1 for GeluOp {
    fn name(&self) -> &'static str {
        "gelu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> CResult<(CpuStorage, Shape)> {
        by_real!(s1, "gelu", |T| {
            let x = slice::<T>(s1, l1, "gelu")?;
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    Self::forward(x, self.how)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let grad = grad.contiguous()?;
        fn run<T: NormalCdf>(
            x: &Tensor,
            y: &Tensor,
            grad: &Tensor,
            how: Matmul,
        ) -> CResult<Tensor> {
            let op = "gelu";
            let dx = with_data::<T, _>(x, op, |xd| {
                with_data::<T, _>(y, op, |yd| {
                    with_data::<T, _>(grad, op, |gd| {
                        Ok(simd::fast!(GeluOp::backward(xd, yd, gd, how)))
                    })
                })
            })?;
            Tensor::from_vec(dx, x.shape(), x.device())
        }
        Ok(Some(by_real_dtype!(x.dtype(), "gelu", |T| run::<T>(x, res, &grad, self.how))?))
    }
}

/// `LayerNorm(x) * weight + bias` through the fused op.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> CResult<Tensor> {
    x.contiguous()?.apply_op3(&weight.contiguous()?, &bias.contiguous()?, LayerNormOp { eps })
}

/// The exact GELU through the fused op.
pub fn gelu(x: &Tensor) -> CResult<Tensor> {
    gelu_as(Matmul::Native, x)
}

/// [`gelu`] in a step whose products multiply `how` (under [`Matmul::Bf16`], `Phi` and
/// `exp` evaluated in f32: [`GeluOp`]).
pub fn gelu_as(how: Matmul, x: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op1(GeluOp { how })
}

/// Rotation tables of a list of positions: `cos` and `sin` of `position * inv_freq[j]`,
/// `[positions, half]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTables {
    /// Half the head dim.
    pub half: usize,
    /// Cosines.
    pub cos: Vec<f64>,
    /// Sines.
    pub sin: Vec<f64>,
}

/// Rotates `x` `[b, s, heads, 2 * half]` by the angles of its `s` positions (the inverse
/// rotation is the backward).
#[derive(Clone, Debug)]
pub struct RopeOp {
    /// The tables, one row per position of `x`'s dim 1.
    pub tables: Arc<RopeTables>,
    /// Rotate by the negated angles.
    pub inverse: bool,
}

impl RopeOp {
    /// `x` `[.., s, heads, 2 * half]` rotated by the angles of its `s` positions.
    #[inline(always)]
    pub(crate) fn rotate<T: Real>(&self, x: &[T], s: usize, heads: usize) -> Vec<T> {
        let half = self.tables.half;
        let sign = if self.inverse { -T::ONE } else { T::ONE };
        let cos: Vec<T> = self.tables.cos.iter().map(|&c| T::from_f64(c)).collect();
        let sin: Vec<T> = self.tables.sin.iter().map(|&c| T::from_f64(c) * sign).collect();
        let mut out = vec![T::ZERO; x.len()];
        for (r, (xr, yr)) in
            x.chunks_exact(2 * half).zip(out.chunks_exact_mut(2 * half)).enumerate()
        {
            let p = (r / heads) % s;
            let (c, sn) = (&cos[p * half..(p + 1) * half], &sin[p * half..(p + 1) * half]);
            let (x1, x2) = xr.split_at(half);
            let (y1, y2) = yr.split_at_mut(half);
            for j in 0..half {
                y1[j] = x1[j] * c[j] - x2[j] * sn[j];
                y2[j] = x2[j] * c[j] + x1[j] * sn[j];
            }
        }
        out
    }
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (_, s, heads, d) = l1.shape().dims4()?;
        let t = &self.tables;
        if d != 2 * t.half || t.cos.len() != s * t.half || t.sin.len() != s * t.half {
            return Err(Error::Msg(format!(
                "rope: tables of {} positions x {} for input {:?}",
                t.cos.len() / t.half.max(1),
                t.half,
                l1.shape()
            )));
        }
        by_real!(s1, "rope", |T| {
            let x = slice::<T>(s1, l1, "rope")?;
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    self.rotate(x, s, heads)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let back = RopeOp { tables: self.tables.clone(), inverse: !self.inverse };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// `silu(gate) * up`, element-wise over equal shapes. Under bf16 products (`how`) the
/// sigmoid's exponentials are evaluated in f32 ([`super::exp_f32_fast`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct SwiGluOp {
    /// How the step's products multiply: [`Matmul::Bf16`] takes the f32-evaluated `exp`.
    pub how: Matmul,
}

/// `sigmoid(x) = 1 / (1 + e^-x)` of every element of `x` into `out`, the exponentials
/// [`LANES`] at a time ([`Real::exp_in_place_as`]: the same bits as one at a time).
#[inline(always)]
fn sigmoid_into<T: Real>(x: &[T], out: &mut [T], how: Matmul) {
    for (o, x) in out.iter_mut().zip(x) {
        *o = -*x;
    }
    T::exp_in_place_as(out, how);
    for o in out.iter_mut() {
        *o = T::ONE / (T::ONE + *o);
    }
}

impl SwiGluOp {
    #[inline(always)]
    pub(crate) fn forward<T: Real>(g: &[T], u: &[T], how: Matmul) -> Vec<T> {
        let mut sg = [T::ZERO; PART];
        written(
            g.len(),
            PART,
            #[inline(always)]
            |start, part| {
                let n = part.len();
                let (g, u, sg) = (&g[start..start + n], &u[start..start + n], &mut sg[..n]);
                sigmoid_into(g, sg, how);
                part.map3(g, u, sg, |g, u, s| g * s * u)
            },
        )
    }

    /// `dg = dh u sig(g) (1 + g (1 - sig(g)))`, `du = dh silu(g)`.
    #[inline(always)]
    pub(crate) fn backward<T: Real>(g: &[T], u: &[T], dh: &[T], how: Matmul) -> (Vec<T>, Vec<T>) {
        let mut sg = [T::ZERO; PART];
        written_pair(
            g.len(),
            PART,
            #[inline(always)]
            |start, dg, du| {
                let n = dg.len();
                let (g, u, dh, sg) = (
                    &g[start..start + n],
                    &u[start..start + n],
                    &dh[start..start + n],
                    &mut sg[..n],
                );
                sigmoid_into(g, sg, how);
                dg.map4_pair(du, [g, u, dh, sg], |g, u, dh, s| {
                    (dh * u * s * (T::ONE + g * (T::ONE - s)), dh * g * s)
                })
            },
        )
    }
}

impl CustomOp2 for SwiGluOp {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            return Err(Error::Msg(format!("swiglu: gate {:?}, up {:?}", l1.shape(), l2.shape())));
        }
        by_real!(s1, "swiglu", |T| {
            let (g, u) = (slice::<T>(s1, l1, "swiglu")?, slice::<T>(s2, l2, "swiglu")?);
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    Self::forward(g, u, self.how)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        fn run<T: Real>(
            g: &Tensor,
            u: &Tensor,
            grad: &Tensor,
            how: Matmul,
        ) -> CResult<(Tensor, Tensor)> {
            let (dg, du) = with_data::<T, _>(g, "swiglu", |gd| {
                with_data::<T, _>(u, "swiglu", |ud| {
                    with_data::<T, _>(grad, "swiglu", |hd| {
                        Ok(simd::fast!(SwiGluOp::backward(gd, ud, hd, how)))
                    })
                })
            })?;
            Ok((
                Tensor::from_vec(dg, g.shape(), g.device())?,
                Tensor::from_vec(du, u.shape(), u.device())?,
            ))
        }
        let (dg, du) = by_real_dtype!(g.dtype(), "swiglu", |T| run::<T>(g, u, &grad, self.how))?;
        Ok((Some(dg), Some(du)))
    }
}

/// `x + bias` over rows: `x` `[.., n]`, `bias` `[n]`. Its backward sums the gradient's rows
/// into the bias gradient in one pass (a broadcast add's backward reduces across rows with
/// a strided sum).
#[derive(Clone, Copy, Debug)]
pub struct BiasAddOp;

impl BiasAddOp {
    /// `y + b` on every row of `y`, in place (the same sum as [`Self::forward`]).
    #[inline(always)]
    pub(crate) fn add_rows<T: Real>(y: &mut [T], b: &[T]) {
        if b.is_empty() {
            return;
        }
        for yr in y.chunks_exact_mut(b.len()) {
            for (v, &bv) in yr.iter_mut().zip(b) {
                *v += bv;
            }
        }
    }

    #[inline(always)]
    fn forward<T: Real>(x: &[T], b: &[T], n: usize) -> Vec<T> {
        written(
            x.len(),
            n,
            #[inline(always)]
            |start, row| {
                let xr = &x[start..start + row.len()];
                row.map2(xr, b, |xv, bv| xv + bv)
            },
        )
    }

    /// The column sums of `g` `[.., n]`: the bias gradient.
    #[inline(always)]
    pub(crate) fn bias_grad<T: Real>(g: &[T], n: usize) -> Vec<T> {
        let mut db = vec![T::ZERO; n];
        if n == 0 {
            return db;
        }
        for gr in g.chunks_exact(n) {
            for (d, &gv) in db.iter_mut().zip(gr) {
                *d += gv;
            }
        }
        db
    }
}

impl CustomOp2 for BiasAddOp {
    fn name(&self) -> &'static str {
        "bias-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let n = row_width("bias-add", l1.shape(), &[l2.shape()])?;
        by_real!(s1, "bias-add", |T| {
            let (x, b) = (slice::<T>(s1, l1, "bias-add")?, slice::<T>(s2, l2, "bias-add")?);
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(simd::fast!({
                    Self::forward(x, b, n)
                })),
                l1.shape().clone(),
            ))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let n = row_width("bias-add", x.shape(), &[b.shape()])?;
        let grad = grad.contiguous()?;
        fn run<T: Real>(grad: &Tensor, n: usize) -> CResult<Tensor> {
            let db = with_data::<T, _>(grad, "bias-add", |g| {
                Ok(simd::fast!(BiasAddOp::bias_grad(g, n)))
            })?;
            Tensor::from_vec(db, n, grad.device())
        }
        let db = by_real_dtype!(x.dtype(), "bias-add", |T| run::<T>(&grad, n))?;
        Ok((Some(grad), Some(db)))
    }
}

/// `x + bias` over the rows of `x` through the fused op.
pub fn bias_add(x: &Tensor, bias: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(&bias.contiguous()?, BiasAddOp)
}

/// `RMSNorm(x) * weight` through the fused op (`x` made contiguous).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(&weight.contiguous()?, RmsNormOp { eps })
}

/// `silu(gate) * up` through the fused op.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    swiglu_as(Matmul::Native, gate, up)
}

/// [`swiglu`] in a step whose products multiply `how` (under [`Matmul::Bf16`], the
/// sigmoid's `exp` evaluated in f32: [`SwiGluOp`]).
pub fn swiglu_as(how: Matmul, gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGluOp { how })
}

/// Rotates `x` `[b, s, heads, d]` by `tables` (one row per position of dim 1).
pub fn rope(x: &Tensor, tables: &Arc<RopeTables>) -> CResult<Tensor> {
    x.contiguous()?.apply_op1(RopeOp { tables: tables.clone(), inverse: false })
}
