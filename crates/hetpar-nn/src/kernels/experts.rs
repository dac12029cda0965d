//! An MoE layer's local experts (SwiGLU MLPs, Mixtral's `w1`, `w3`, `w2`) over their rows,
//! grouped by expert, as one autograd node.
//!
//! Written per expert, each of 8 experts is a row selection, three linear nodes and a SwiGLU
//! node, and their outputs a concatenation: candle's backward then copies the whole
//! selection's gradient once per expert (an index select's backward adds its rows into a
//! copy of the input's gradient), zero-fills and adds the gradient of every expert's input
//! twice over (it feeds `w1` and `w3`), and splits the output's gradient again. Here each
//! expert reads its rows in place (they are one contiguous block of the input), the forward
//! keeps `w1 x`, `w3 x` and their SwiGLU for the backward, and the backward writes the
//! input's gradient once, each expert's rows `dx3 + dx1` as the per-expert graph sums them,
//! and adds each weight's gradient to its parameter's [`GradSink`]. The products, the
//! SwiGLU and the sums are the per-expert graph's own, so the results keep its bits.
//!
//! The weights are not inputs of the node (a custom op takes at most three); an anchor, a
//! variable the caller passes, makes candle run the backward whenever the layer trains, and
//! gets no gradient from it.

use std::sync::{Mutex, MutexGuard};

use candle_core::{CpuStorage, CustomOp2, Error, Layout, Shape, Tensor};

use super::linear::{Matmul, backward, product};
use super::pointwise::{NormalCdf, SwiGluOp};
use super::sink::GradSink;
use super::{Anchored, CResult, Real, by_real, saved_state, simd, slice, with_data};

/// One expert's weights, each with the sink its gradient goes to: `w1`, `w3` `[ffn,
/// hidden]`, `w2` `[hidden, ffn]`.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// The gate projection.
    pub w1: (Tensor, GradSink),
    /// The up projection.
    pub w3: (Tensor, GradSink),
    /// The down projection.
    pub w2: (Tensor, GradSink),
}

/// The experts over rows grouped by expert: `rows[e]` rows for expert `e`, in order.
#[derive(Debug)]
struct ExpertsOp {
    how: Matmul,
    experts: Vec<ExpertWeights>,
    rows: Vec<usize>,
    /// `w1 x`, `w3 x` and their SwiGLU, for each expert with rows, from the forward.
    saved: Mutex<Vec<[Tensor; 3]>>,
}

impl ExpertsOp {
    fn saved(&self) -> CResult<MutexGuard<'_, Vec<[Tensor; 3]>>> {
        saved_state(&self.saved, "experts")
    }

    /// `(hidden, ffn)` of expert `e`.
    fn dims(&self, e: usize) -> (usize, usize) {
        let w1 = self.experts[e].w1.0.dims();
        (w1[1], w1[0])
    }

    fn forward<T: Real>(&self, x: &[T], hidden: usize) -> CResult<Vec<T>> {
        let op = "experts";
        let mut y = Vec::with_capacity(x.len());
        let mut saved = Vec::new();
        let mut start = 0;
        for (e, &r) in self.rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let (h_in, ffn) = self.dims(e);
            if h_in != hidden {
                return Err(Error::Msg(format!("experts: rows of {hidden}, expert {e} of {h_in}")));
            }
            let w = &self.experts[e];
            let xe = &x[start * hidden..(start + r) * hidden];
            let h1 =
                with_data::<T, _>(&w.w1.0, op, |w| product(self.how, xe, w, (r, hidden, ffn)))?;
            let h3 =
                with_data::<T, _>(&w.w3.0, op, |w| product(self.how, xe, w, (r, hidden, ffn)))?;
            let h = simd::fast!({ SwiGluOp::forward(&h1, &h3) });
            let ye =
                with_data::<T, _>(&w.w2.0, op, |w| product(self.how, &h, w, (r, ffn, hidden)))?;
            y.extend_from_slice(&ye);
            let keep = |v: Vec<T>| Tensor::from_vec(v, (r, ffn), &candle_core::Device::Cpu);
            saved.push([keep(h1)?, keep(h3)?, keep(h)?]);
            start += r;
        }
        *self.saved()? = saved;
        Ok(y)
    }

    fn backward<T: Real>(&self, x: &[T], dy: &[T], hidden: usize) -> CResult<Vec<T>> {
        let op = "experts backward";
        let saved = self.saved()?;
        let mut dx = vec![T::ZERO; x.len()];
        let (mut start, mut k) = (0, 0);
        for (e, &r) in self.rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let (_, ffn) = self.dims(e);
            let w = &self.experts[e];
            let [h1, h3, h] = saved
                .get(k)
                .ok_or_else(|| Error::Msg("experts: backward without its forward".into()))?;
            k += 1;
            let rows = start * hidden..(start + r) * hidden;
            let (xe, dye) = (&x[rows.clone()], &dy[rows.clone()]);
            let (dh, dw2) = with_data::<T, _>(h, op, |h| {
                with_data::<T, _>(&w.w2.0, op, |w| backward(self.how, h, w, dye, (r, ffn, hidden)))
            })?;
            let (dg, du) = with_data::<T, _>(h1, op, |g| {
                with_data::<T, _>(h3, op, |u| Ok(simd::fast!(SwiGluOp::backward(g, u, &dh))))
            })?;
            let (dx1, dw1) = with_data::<T, _>(&w.w1.0, op, |w| {
                backward(self.how, xe, w, &dg, (r, hidden, ffn))
            })?;
            let (dx3, dw3) = with_data::<T, _>(&w.w3.0, op, |w| {
                backward(self.how, xe, w, &du, (r, hidden, ffn))
            })?;
            for ((d, a), b) in dx[rows].iter_mut().zip(&dx3).zip(&dx1) {
                *d = *a + *b;
            }
            w.w1.1.add(dw1)?;
            w.w3.1.add(dw3)?;
            w.w2.1.add(dw2)?;
            start += r;
        }
        Ok(dx)
    }
}

impl Anchored for ExpertsOp {
    const NAME: &'static str = "experts";

    fn input_grad<T: NormalCdf>(&self, x: &[T], shape: &Shape, dy: &[T]) -> CResult<Vec<T>> {
        self.backward(x, dy, shape.dims2()?.1)
    }
}

impl CustomOp2 for ExpertsOp {
    fn name(&self) -> &'static str {
        "experts"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let &[n, hidden] = l1.shape().dims() else {
            return Err(Error::Msg(format!("experts: rows {:?} are not a matrix", l1.shape())));
        };
        if self.rows.iter().sum::<usize>() != n || self.rows.len() != self.experts.len() {
            return Err(Error::Msg(format!(
                "experts: {} rows for {} experts, grouped as {:?}",
                n,
                self.experts.len(),
                self.rows
            )));
        }
        by_real!(s1, "experts", |T| {
            let x = slice::<T>(s1, l1, "experts")?;
            let y = self.forward(x, hidden)?;
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        self.anchored_bwd(x, grad)
    }
}

/// The experts' outputs for `x` `[n, hidden]`, its rows grouped by expert (`rows[e]` rows for
/// `experts[e]`, in order): `w2 (silu(w1 x) * w3 x)` for each row, multiplying as `how`
/// says. `anchor`, a variable, joins the graph only so that candle runs the backward; the
/// weights' gradients go to their sinks.
pub fn experts_swiglu(
    how: Matmul,
    x: &Tensor,
    anchor: &Tensor,
    experts: Vec<ExpertWeights>,
    rows: Vec<usize>,
) -> CResult<Tensor> {
    let op = ExpertsOp { how, experts, rows, saved: Mutex::new(Vec::new()) };
    x.contiguous()?.apply_op2(anchor, op)
}
