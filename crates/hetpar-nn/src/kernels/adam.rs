//! AdamW's update in place (Loshchilov and Hutter 2019), one pass over a parameter's
//! elements that reads the gradient and writes the two moments and the weights. Written
//! with candle ops the same update is fourteen element-wise tensor ops, each allocating its
//! result; here no tensor is allocated. Every element is computed by the same f32 or f64 operations in
//! the same order as that composition (each scalar taken to the element type first, `x *
//! c + 0` where candle's affine map adds zero), so the results are the same bits.

use std::cell::{Cell, RefCell};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Error, InplaceOp1, InplaceOp2, Layout, Storage, Tensor};

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

/// AdamW on contiguous elements: for each, the scaled gradient `g`, then `m = beta1 m +
/// (1 - beta1) g`, `v = beta2 v + (1 - beta2) g^2` and `w = (1 - lr decay) w - lr (m /
/// bc1) / (sqrt(v / bc2) + eps)`, each step the operation of the tensor composition.
/// Whether every weight and second moment written is finite: a finite gradient can still
/// overflow them (a huge learning rate or weight decay, a gradient whose square overflows),
/// and a second moment at infinity would freeze its weight with no error anywhere.
#[inline(always)]
fn update<T: Real>(s: &AdamStep, w: &mut [T], g: &[T], m: &mut [T], v: &mut [T]) -> bool {
    let (scale, zero, one) = (T::from_f64(s.scale), T::ZERO, T::ONE);
    let (beta1, rest1) = (T::from_f64(s.beta1), T::from_f64(1.0 - s.beta1));
    let (beta2, rest2) = (T::from_f64(s.beta2), T::from_f64(1.0 - s.beta2));
    let (c1, c2, eps) = (T::from_f64(1.0 / s.bc1), T::from_f64(1.0 / s.bc2), T::from_f64(s.eps));
    let (keep, lr) = (T::from_f64(1.0 - s.lr * s.decay), T::from_f64(s.lr));
    let (low, high) = (T::NEG_INF, -T::NEG_INF);
    // Comparisons fail for NaN, so this stays true only for values strictly inside.
    let mut finite = true;
    for (((w, &gr), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = gr * scale + zero;
        *m = (*m * beta1 + zero) + (g * rest1 + zero);
        *v = (*v * beta2 + zero) + ((g * g) * rest2 + zero);
        let denom = (*v * c2 + zero).sqrt() * one + eps;
        let step = (*m * c1 + zero) / denom;
        *w = (*w * keep + zero) - (step * lr + zero);
        finite &= (*w > low) & (*w < high) & (*v < high);
    }
    finite
}

/// A written tensor's storage, handed from the op that holds its lock to the one inside.
type Held<'a> = RefCell<Option<(&'a mut CpuStorage, &'a Layout)>>;

fn take<'a>(held: &Held<'a>) -> CResult<(&'a mut CpuStorage, &'a Layout)> {
    held.borrow_mut().take().ok_or_else(|| Error::Msg("adamw: a moment used twice".into()))
}

/// Candle writes one tensor per in-place op, so the update nests three: the first moment's
/// op runs the second moment's, which runs the weights' (reading the gradient); the
/// innermost holds all four and makes one pass.
struct First<'a> {
    w: &'a Tensor,
    g: &'a Tensor,
    v: &'a Tensor,
    step: AdamStep,
    finite: &'a Cell<bool>,
}

struct Second<'a, 'b> {
    w: &'a Tensor,
    g: &'a Tensor,
    step: AdamStep,
    m: Held<'b>,
    finite: &'a Cell<bool>,
}

struct Weights<'b> {
    step: AdamStep,
    m: Held<'b>,
    v: Held<'b>,
    /// Set by the pass: whether every weight and second moment it wrote is finite.
    finite: &'b Cell<bool>,
}

impl InplaceOp1 for First<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, m: &mut CpuStorage, lm: &Layout) -> CResult<()> {
        let inner = Second {
            w: self.w,
            g: self.g,
            step: self.step,
            m: RefCell::new(Some((m, lm))),
            finite: self.finite,
        };
        self.v.inplace_op1(&inner)
    }
}

impl InplaceOp1 for Second<'_, '_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, v: &mut CpuStorage, lv: &Layout) -> CResult<()> {
        let inner = Weights {
            step: self.step,
            m: RefCell::new(Some(take(&self.m)?)),
            v: RefCell::new(Some((v, lv))),
            finite: self.finite,
        };
        self.w.inplace_op2(self.g, &inner)
    }
}

/// The contiguous range of a written tensor's elements.
fn range(l: &Layout) -> CResult<std::ops::Range<usize>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| Error::Msg("adamw needs contiguous parameters and moments".into()))?;
    Ok(a..b)
}

impl InplaceOp2 for Weights<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, w: &mut CpuStorage, lw: &Layout, g: &CpuStorage, lg: &Layout) -> CResult<()> {
        let ((m, lm), (v, lv)) = (take(&self.m)?, take(&self.v)?);
        let (rw, rm, rv) = (range(lw)?, range(lm)?, range(lv)?);
        fn go<T: Real>(
            s: &AdamStep,
            w: &mut [T],
            g: &CpuStorage,
            lg: &Layout,
            m: &mut [T],
            v: &mut [T],
        ) -> CResult<bool> {
            let g = slice::<T>(g, lg, "adamw")?;
            if g.len() != w.len() || m.len() != w.len() || v.len() != w.len() {
                return Err(Error::Msg(format!(
                    "adamw: {} elements of gradient, {} and {} of moments for a parameter of {}",
                    g.len(),
                    m.len(),
                    v.len(),
                    w.len()
                )));
            }
            Ok(simd::fast!(update(s, w, g, m, v)))
        }
        let s = &self.step;
        let finite = match (w, m, v) {
            (CpuStorage::F32(w), CpuStorage::F32(m), CpuStorage::F32(v)) => {
                go(s, &mut w[rw], g, lg, &mut m[rm], &mut v[rv])
            }
            (CpuStorage::F64(w), CpuStorage::F64(m), CpuStorage::F64(v)) => {
                go(s, &mut w[rw], g, lg, &mut m[rm], &mut v[rv])
            }
            (w, m, v) => Err(Error::Msg(format!(
                "adamw runs in f32 and f64 with moments of the parameter's type, not {:?} with {:?} and {:?}",
                w.dtype(),
                m.dtype(),
                v.dtype()
            ))),
        }?;
        self.finite.set(finite);
        Ok(())
    }
}

/// One AdamW update of `w` from its gradient `g`, with its moments `m` and `v`, all in
/// place (`m`, `v` and `w` are written; `g` is read). All four are contiguous, of one
/// shape and one element type. Returns whether every weight and second moment written is
/// finite (the update is written either way).
pub fn adamw_step(w: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, step: AdamStep) -> CResult<bool> {
    for (name, t) in [("gradient", g), ("first moment", m), ("second moment", v)] {
        if t.shape() != w.shape() {
            return Err(Error::Msg(format!(
                "adamw: {name} {:?} for a parameter {:?}",
                t.shape(),
                w.shape()
            )));
        }
    }
    // The three written tensors are locked one inside the other, so neither they nor the
    // gradient (read inside all three locks) may share storage with a moment: a second lock
    // of one would never be granted. (Candle itself refuses a gradient sharing the
    // weights' storage.)
    let (pw, pm, pv, pg) = (storage_id(w), storage_id(m), storage_id(v), storage_id(g));
    if pw == pm || pw == pv || pm == pv || pg == pm || pg == pv {
        return Err(Error::Msg(
            "adamw: the moments must not share storage with each other, the parameter or the gradient".into(),
        ));
    }
    let g = g.contiguous()?;
    let finite = Cell::new(false);
    m.inplace_op1(&First { w, g: &g, v, step, finite: &finite })?;
    Ok(finite.get())
}

/// The address of a tensor's storage (tensors sharing storage share it).
fn storage_id(t: &Tensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    &*storage as *const Storage as usize
}
