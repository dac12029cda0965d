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

/// The contiguous elements of `dst` as f32 or f64 with `srcs` of the same type and length,
/// handed to `f32_run` or `f64_run`.
fn dispatch(
    op: &str,
    dst: &mut CpuStorage,
    l: &Layout,
    srcs: &[(&CpuStorage, &Layout)],
    f32_run: impl FnOnce(&mut [f32], &[&[f32]]),
    f64_run: impl FnOnce(&mut [f64], &[&[f64]]),
) -> CResult<()> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::Msg(format!("{op} needs a contiguous parameter")))?;
    fn inputs<'a, T: Real>(
        op: &str,
        n: usize,
        srcs: &[(&'a CpuStorage, &Layout)],
    ) -> CResult<Vec<&'a [T]>> {
        let s = srcs.iter().map(|(s, l)| slice::<T>(s, l, op)).collect::<CResult<Vec<_>>>()?;
        if s.iter().any(|x| x.len() != n) {
            return Err(Error::Msg(format!("{op}: inputs of different sizes")));
        }
        Ok(s)
    }
    match dst {
        CpuStorage::F32(d) => {
            let s = inputs::<f32>(op, b - a, srcs)?;
            f32_run(&mut d[a..b], &s);
        }
        CpuStorage::F64(d) => {
            let s = inputs::<f64>(op, b - a, srcs)?;
            f64_run(&mut d[a..b], &s);
        }
        other => {
            return Err(Error::Msg(format!(
                "{op} runs in f32 and f64, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            )));
        }
    }
    Ok(())
}

impl Moment {
    #[inline(always)]
    fn run<T: Real>(&self, m: &mut [T], g: &[T]) {
        let s = self.step;
        let (scale, zero) = (T::from_f64(s.scale), T::ZERO);
        let (beta, rest) =
            if self.second { (s.beta2, 1.0 - s.beta2) } else { (s.beta1, 1.0 - s.beta1) };
        let (beta, rest) = (T::from_f64(beta), T::from_f64(rest));
        for (m, &gr) in m.iter_mut().zip(g) {
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
        dispatch(
            "adam-moment",
            s1,
            l1,
            &[(s2, l2)],
            |m, g| simd::fast(|| self.run(m, g[0])),
            |m, g| simd::fast(|| self.run(m, g[0])),
        )
    }
}

impl Apply {
    #[inline(always)]
    fn run<T: Real>(&self, w: &mut [T], m: &[T], v: &[T]) {
        let s = self.0;
        let zero = T::ZERO;
        let (c1, c2) = (T::from_f64(1.0 / s.bc1), T::from_f64(1.0 / s.bc2));
        let (one, eps) = (T::ONE, T::from_f64(s.eps));
        let (keep, lr) = (T::from_f64(1.0 - s.lr * s.decay), T::from_f64(s.lr));
        for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
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
        dispatch(
            "adam-apply",
            s1,
            l1,
            &[(s2, l2), (s3, l3)],
            |w, mv| simd::fast(|| self.run(w, mv[0], mv[1])),
            |w, mv| simd::fast(|| self.run(w, mv[0], mv[1])),
        )
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
