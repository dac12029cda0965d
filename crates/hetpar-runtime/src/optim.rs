//! AdamW (Loshchilov and Hutter 2019: Adam's bias-corrected moments, weight decay decoupled
//! from the gradient) and the learning-rate schedule (linear warmup, cosine decay).
//!
//! The update of an element depends only on that element's gradient and state, so every
//! rank updates its own slices and the result equals one rank's update of the whole model.
//! Weight decay applies to matrices and higher (weights, embeddings, convolutions), not to
//! biases and norm scales, as Megatron-LM and HF do by default.

use candle_core::Tensor;
use hetpar_nn::Param;
use hetpar_nn::kernels::adam::{AdamStep, adamw_step};

use crate::error::RuntimeError;
use crate::step::Grads;

type Result<T> = std::result::Result<T, RuntimeError>;

/// Learning rate by step: `warmup` steps rising linearly to `peak` (step 0 takes
/// `peak / warmup`), then a half cosine from `peak` down to `min` at step `total - 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Highest rate.
    pub peak: f64,
    /// Rate at the end of the decay.
    pub min: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// Steps of the run.
    pub total: usize,
}

impl LrSchedule {
    /// The rate of step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup + 1);
        if span == 0 {
            return self.peak;
        }
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// AdamW's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay (times the learning rate).
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// One module's optimizer state on one rank: both moments of every local parameter slice
/// and the steps taken.
#[derive(Debug)]
pub struct AdamState {
    /// First moments, in parameter order.
    pub m: Vec<Tensor>,
    /// Second moments.
    pub v: Vec<Tensor>,
    /// Updates applied so far.
    pub steps: u64,
}

impl AdamState {
    /// Zero moments for `params`.
    pub fn new(params: &[&Param]) -> Result<AdamState> {
        let zeros = || {
            params
                .iter()
                .map(|p| p.tensor().zeros_like())
                .collect::<std::result::Result<Vec<_>, _>>()
        };
        Ok(AdamState { m: zeros()?, v: zeros()?, steps: 0 })
    }

    /// Applies one update to `params` from `grads` scaled by `scale` (the clip factor) at
    /// learning rate `lr`, in place: the moments and the parameters are written where they
    /// lie (by the fused kernel, with the bits of the element-wise composition). Returns the
    /// index of the first parameter the update left with a non-finite weight or second
    /// moment (every parameter is updated either way).
    pub fn update(
        &mut self,
        opt: &AdamW,
        params: &[&Param],
        grads: &Grads,
        lr: f64,
        scale: f64,
    ) -> Result<Option<usize>> {
        self.steps += 1;
        let t = self.steps as i32;
        let (bc1, bc2) = (1.0 - opt.beta1.powi(t), 1.0 - opt.beta2.powi(t));
        let mut overflowed = None;
        for (i, p) in params.iter().enumerate() {
            let decay = if p.tensor().rank() >= 2 { opt.weight_decay } else { 0.0 };
            let step = AdamStep {
                beta1: opt.beta1,
                beta2: opt.beta2,
                eps: opt.eps,
                scale,
                bc1,
                bc2,
                lr,
                decay,
            };
            // A moment loaded as a strided slice of a checkpoint tensor gets its own storage.
            for t in [&mut self.m[i], &mut self.v[i]] {
                if !t.is_contiguous() {
                    *t = t.copy()?;
                }
            }
            let finite = adamw_step(p.tensor(), &grads.tensors[i], &self.m[i], &self.v[i], step)?;
            overflowed = overflowed.or((!finite).then_some(i));
        }
        Ok(overflowed)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    use candle_core::DType;
    use hetpar_nn::Init;

    /// The update through the element-wise reference, parameter by parameter, with the
    /// constants derived here independently of [`AdamState::update`].
    fn composed(
        st: &mut (Vec<Tensor>, Vec<Tensor>, u64),
        opt: &AdamW,
        params: &[&Param],
        grads: &Grads,
        (lr, scale): (f64, f64),
    ) {
        st.2 += 1;
        let t = st.2 as i32;
        for (i, p) in params.iter().enumerate() {
            let s = AdamStep {
                beta1: opt.beta1,
                beta2: opt.beta2,
                eps: opt.eps,
                scale,
                bc1: 1.0 - opt.beta1.powi(t),
                bc2: 1.0 - opt.beta2.powi(t),
                lr,
                decay: if p.tensor().rank() >= 2 { opt.weight_decay } else { 0.0 },
            };
            let (w, m, v) = hetpar_nn::kernels::reference::adamw(
                p.tensor(),
                &grads.tensors[i],
                &st.0[i],
                &st.1[i],
                &s,
            )
            .unwrap();
            p.var.set(&w).unwrap();
            st.0[i] = m;
            st.1[i] = v;
        }
    }

    fn bits(t: &Tensor) -> Vec<u64> {
        let t = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
        t.to_vec1::<f64>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn the_update_gives_the_bits_of_the_element_wise_reference() {
        for dtype in [DType::F32, DType::F64] {
            let make = |name: &str, shape: &[usize], seed| {
                Param::new(name.into(), shape, None, vec![], Init::Normal(0.5), seed, dtype)
                    .unwrap()
            };
            let (w1, b1) = (make("w", &[7, 13], 1), make("b", &[13], 2));
            let (w2, b2) = (make("w", &[7, 13], 1), make("b", &[13], 2));
            let opt = AdamW { weight_decay: 0.1, ..AdamW::default() };
            let mut fused = AdamState::new(&[&w1, &b1]).unwrap();
            // Its own zeros: a clone of the fused state's tensors would share their storage,
            // which the fused update writes in place.
            let zeros = AdamState::new(&[&w2, &b2]).unwrap();
            let mut reference = (zeros.m, zeros.v, 0);
            for step in 0..5u64 {
                let grads = Grads::new(
                    [(&w1, 3), (&b1, 4)]
                        .iter()
                        .map(|(p, s)| {
                            let g = make("g", p.tensor().dims(), s * 10 + step);
                            g.tensor().clone()
                        })
                        .collect(),
                );
                let (lr, scale) = (1e-2 * (step + 1) as f64, if step == 2 { 0.37 } else { 1.0 });
                assert_eq!(fused.update(&opt, &[&w1, &b1], &grads, lr, scale).unwrap(), None);
                composed(&mut reference, &opt, &[&w2, &b2], &grads, (lr, scale));
                for (got, want) in [(w1.tensor(), w2.tensor()), (b1.tensor(), b2.tensor())] {
                    assert_eq!(bits(got), bits(want), "{dtype:?} step {step}: parameters");
                }
                for i in 0..2 {
                    assert_eq!(bits(&fused.m[i]), bits(&reference.0[i]), "{dtype:?} m");
                    assert_eq!(bits(&fused.v[i]), bits(&reference.1[i]), "{dtype:?} v");
                }
            }
            // The parameters moved.
            assert_ne!(bits(w1.tensor()), bits(make("w", &[7, 13], 1).tensor()));
        }
    }

    /// A gradient whose square overflows f32 leaves its second moment infinite (which would
    /// freeze the weight with no error): the update names that parameter, the first such.
    #[test]
    fn an_update_that_overflows_names_its_parameter() {
        let make = |name: &str, shape: &[usize], seed| {
            Param::new(name.into(), shape, None, vec![], Init::Normal(0.5), seed, DType::F32)
                .unwrap()
        };
        let (a, b, c) = (make("a", &[3, 4], 1), make("b", &[5], 2), make("c", &[2, 2], 3));
        let mut state = AdamState::new(&[&a, &b, &c]).unwrap();
        let grad =
            |p: &Param, x: f32| p.tensor().ones_like().unwrap().affine(x as f64, 0.0).unwrap();
        let grads = |x: f32| Grads::new(vec![grad(&a, 1.0), grad(&b, x), grad(&c, x)]);
        let opt = AdamW::default();
        assert_eq!(state.update(&opt, &[&a, &b, &c], &grads(1.0), 1e-3, 1.0).unwrap(), None);
        let huge = 1e20; // finite in f32, its square is not
        assert_eq!(state.update(&opt, &[&a, &b, &c], &grads(huge), 1e-3, 1.0).unwrap(), Some(1));
        // Every parameter was still updated: `c`'s second moment is infinite too.
        assert!(!crate::step::finite(&state.v[2]).unwrap());
        assert!(crate::step::finite(&state.v[0]).unwrap());
    }

    #[test]
    fn warmup_then_cosine() {
        let s = LrSchedule { peak: 1.0, min: 0.1, warmup: 4, total: 15 };
        let lr: Vec<f64> = (0..16).map(|i| s.at(i)).collect();
        assert_eq!(&lr[..4], [0.25, 0.5, 0.75, 1.0]);
        assert_eq!(lr[4], 1.0);
        assert!((lr[9] - 0.55).abs() < 1e-12, "{}", lr[9]);
        assert!((lr[14] - 0.1).abs() < 1e-12 && (lr[15] - 0.1).abs() < 1e-12);
        assert!(lr[4..15].windows(2).all(|w| w[1] < w[0]));
        let flat = LrSchedule { peak: 0.5, min: 0.0, warmup: 0, total: 1 };
        assert_eq!(flat.at(0), 0.5);
        // A run shorter than its warmup rises by a tenth of the peak a step, never reaching it.
        let short = LrSchedule { peak: 1.0, min: 0.1, warmup: 10, total: 3 };
        assert_eq!((0..3).map(|i| short.at(i)).collect::<Vec<_>>(), [0.1, 0.2, 0.3]);
    }
}
