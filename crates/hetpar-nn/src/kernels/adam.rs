//! AdamW's update in place (Loshchilov and Hutter 2019), three passes over a parameter's
//! elements: the first moment, the second moment, then the weights. Written with candle ops
//! the same update is fourteen element-wise tensor ops, each allocating its result; here
//! no tensor is allocated. Every element is computed by the same f32 or f64 operations in
//! the same order as that composition (each scalar taken to the element type first, `x *
//! c + 0` where candle's affine map adds zero), so the results are the same bits.

use candle_core::{CpuStorage, Error, InplaceOp2, InplaceOp3, Layout, Tensor};

use super::{CResult, Real, simd, slice};

/// The constants of one update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Factor on the gradient (the clip factor).
    pub scale: f64,
    /// Bias corrections `1 - beta1^t` and `1 - beta2^t`.
    pub bc1: f64,
    pub bc2: f64,
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay of this parameter (0 for biases and norm scales).
    pub decay: f64,
}

/// `m = beta1 m + (1 - beta1) g` (`first`) or `v = beta2 v + (1 - beta2) g^2`, `g` the
/// scaled gradient.
#[derive(Clone, Copy, Debug)]
struct Moment {
    step: AdamStep,
    second: bool,
}

/// `w = (1 - lr decay) w - lr (m / bc1) / (sqrt(v / bc2) + eps)`.
#[derive(Clone, Copy, Debug)]
struct Apply(AdamStep);

/// An in-place pass over a parameter's elements: `dst` written, `srcs` read, all of one
/// length.
trait Pass {
    fn run<T: Real>(&self, dst: &mut [T], srcs: &[&[T]]);
}

/// Runs `pass` on the contiguous f32 or f64 elements of `dst` and `srcs`, compiled for
/// AVX-512 where the CPU has it.
fn dispatch(
    op: &str,
    pass: &impl Pass,
    dst: &mut CpuStorage,
    l: &Layout,
    srcs: &[(&CpuStorage, &Layout)],
) -> CResult<()> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::Msg(format!("{op} needs a contiguous parameter")))?;
    fn go<T: Real>(
        op: &str,
        pass: &impl Pass,
        dst: &mut [T],
        srcs: &[(&CpuStorage, &Layout)],
    ) -> CResult<()> {
        let s = srcs.iter().map(|(s, l)| slice::<T>(s, l, op)).collect::<CResult<Vec<_>>>()?;
        if let Some(x) = s.iter().find(|x| x.len() != dst.len()) {
            return Err(Error::Msg(format!(
                "{op}: an input of {} elements for a parameter of {}",
                x.len(),
                dst.len()
            )));
        }
        simd::fast(|| pass.run(dst, &s));
        Ok(())
    }
    match dst {
        CpuStorage::F32(d) => go(op, pass, &mut d[a..b], srcs),
        CpuStorage::F64(d) => go(op, pass, &mut d[a..b], srcs),
        other => Err(Error::Msg(format!(
            "{op} runs in f32 and f64, not {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ))),
    }
}

impl Pass for Moment {
    #[inline(always)]
    fn run<T: Real>(&self, m: &mut [T], srcs: &[&[T]]) {
        let s = self.step;
        let (scale, zero) = (T::from_f64(s.scale), T::ZERO);
        let (beta, rest) =
            if self.second { (s.beta2, 1.0 - s.beta2) } else { (s.beta1, 1.0 - s.beta1) };
        let (beta, rest) = (T::from_f64(beta), T::from_f64(rest));
        for (m, &gr) in m.iter_mut().zip(srcs[0]) {
            let g = gr * scale + zero;
            let g = if self.second { g * g } else { g };
            *m = (*m * beta + zero) + (g * rest + zero);
        }
    }
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adam-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<()> {
        dispatch("adam-moment", self, s1, l1, &[(s2, l2)])
    }
}

impl Pass for Apply {
    #[inline(always)]
    fn run<T: Real>(&self, w: &mut [T], srcs: &[&[T]]) {
        let s = self.0;
        let zero = T::ZERO;
        let (c1, c2) = (T::from_f64(1.0 / s.bc1), T::from_f64(1.0 / s.bc2));
        let (one, eps) = (T::ONE, T::from_f64(s.eps));
        let (keep, lr) = (T::from_f64(1.0 - s.lr * s.decay), T::from_f64(s.lr));
        for ((w, &m), &v) in w.iter_mut().zip(srcs[0]).zip(srcs[1]) {
            let denom = (v * c2 + zero).sqrt() * one + eps;
            let step = (m * c1 + zero) / denom;
            *w = (*w * keep + zero) - (step * lr + zero);
        }
    }
}

impl InplaceOp3 for Apply {
    fn name(&self) -> &'static str {
        "adam-apply"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<()> {
        dispatch("adam-apply", self, s1, l1, &[(s2, l2), (s3, l3)])
    }
}

/// One AdamW update of `w` from its gradient `g`, with its moments `m` and `v`, all in
/// place (`m`, `v` and `w` are written; `g` is read). All four are contiguous, of one
/// shape and one element type.
pub fn adamw_step(w: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, step: AdamStep) -> CResult<()> {
    for (name, t) in [("gradient", g), ("first moment", m), ("second moment", v)] {
        if t.shape() != w.shape() {
            return Err(Error::Msg(format!(
                "adamw: {name} {:?} for a parameter {:?}",
                t.shape(),
                w.shape()
            )));
        }
    }
    let g = g.contiguous()?;
    m.inplace_op2(&g, &Moment { step, second: false })?;
    v.inplace_op2(&g, &Moment { step, second: true })?;
    w.inplace_op3(m, v, &Apply(step))
}
