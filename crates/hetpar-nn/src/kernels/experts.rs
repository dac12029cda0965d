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
//!
//! Where the experts are all local (`ep` 1), [`routed_experts`] takes the routing in as well:
//! each assignment's row of the tokens, its expert's output and its gate, summed into the
//! token's output, are one node with the experts. Composed, the gather is an index select
//! (its backward zero-fills the tokens' gradient and adds the rows in), and the weighting
//! and the sum are a broadcast multiply and an index add whose backwards make and add half
//! a dozen tensors of every assignment's row. The gather, the weighting and the sum here
//! are the composed graph's operations in its order (so the output, the tokens' gradient and
//! the weights' gradients keep its bits); a gate's gradient, the dot product of its row's
//! output and output gradient, sums in the eight partial sums of the kernels' `dot` where
//! candle's reduction has its own order, within an ulp or two of it.

use std::sync::{Mutex, MutexGuard};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Error, Layout, Shape, Tensor};

use super::linear::{Matmul, backward, product};
use super::pointwise::{NormalCdf, SwiGluOp};
use super::sink::GradSink;
use super::{
    Anchored, CResult, Real, by_real, by_real_dtype, dot, saved_state, simd, slice, with_data,
};

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

    /// Expert `e` on its `r` rows `xe` (`[r, hidden]`): their outputs `w2 (silu(w1 x) * w3
    /// x)`, and `w1 x`, `w3 x` and their SwiGLU for its backward.
    fn expert_forward<T: Real>(
        &self,
        e: usize,
        xe: &[T],
        r: usize,
        hidden: usize,
    ) -> CResult<(Vec<T>, [Tensor; 3])> {
        let op = "experts";
        let (h_in, ffn) = self.dims(e);
        if h_in != hidden {
            return Err(Error::Msg(format!("experts: rows of {hidden}, expert {e} of {h_in}")));
        }
        let w = &self.experts[e];
        let h1 = with_data::<T, _>(&w.w1.0, op, |w| product(self.how, xe, w, (r, hidden, ffn)))?;
        let h3 = with_data::<T, _>(&w.w3.0, op, |w| product(self.how, xe, w, (r, hidden, ffn)))?;
        let h = simd::fast!({ SwiGluOp::forward(&h1, &h3, self.how) });
        let ye = with_data::<T, _>(&w.w2.0, op, |w| product(self.how, &h, w, (r, ffn, hidden)))?;
        let keep = |v: Vec<T>| Tensor::from_vec(v, (r, ffn), &candle_core::Device::Cpu);
        Ok((ye, [keep(h1)?, keep(h3)?, keep(h)?]))
    }

    /// The two parts of the gradient of expert `e`'s rows `xe` given their outputs' `dye`,
    /// `(dx3, dx1)` (through `w3` and `w1`; the per-expert graph's gradient is `dx3 + dx1`);
    /// its weights' gradients go to their sinks.
    fn expert_backward<T: Real>(
        &self,
        e: usize,
        (xe, dye): (&[T], &[T]),
        r: usize,
        hidden: usize,
        [h1, h3, h]: &[Tensor; 3],
    ) -> CResult<(Vec<T>, Vec<T>)> {
        let op = "experts backward";
        let (_, ffn) = self.dims(e);
        let w = &self.experts[e];
        let (dh, dw2) = with_data::<T, _>(h, op, |h| {
            with_data::<T, _>(&w.w2.0, op, |w| backward(self.how, h, w, dye, (r, ffn, hidden)))
        })?;
        let (dg, du) = with_data::<T, _>(h1, op, |g| {
            with_data::<T, _>(h3, op, |u| Ok(simd::fast!(SwiGluOp::backward(g, u, &dh, self.how))))
        })?;
        let (dx1, dw1) =
            with_data::<T, _>(&w.w1.0, op, |w| backward(self.how, xe, w, &dg, (r, hidden, ffn)))?;
        let (dx3, dw3) =
            with_data::<T, _>(&w.w3.0, op, |w| backward(self.how, xe, w, &du, (r, hidden, ffn)))?;
        w.w1.1.add(dw1)?;
        w.w3.1.add(dw3)?;
        w.w2.1.add(dw2)?;
        Ok((dx3, dx1))
    }

    /// The saved state of the `k`-th expert with rows.
    fn saved_of(saved: &[[Tensor; 3]], k: usize) -> CResult<&[Tensor; 3]> {
        saved.get(k).ok_or_else(|| Error::Msg("experts: backward without its forward".into()))
    }

    fn forward<T: Real>(&self, x: &[T], hidden: usize) -> CResult<Vec<T>> {
        let mut y = Vec::with_capacity(x.len());
        let mut saved = Vec::new();
        let mut start = 0;
        for (e, &r) in self.rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let xe = &x[start * hidden..(start + r) * hidden];
            let (ye, keep) = self.expert_forward(e, xe, r, hidden)?;
            y.extend_from_slice(&ye);
            saved.push(keep);
            start += r;
        }
        *self.saved()? = saved;
        Ok(y)
    }

    fn backward<T: Real>(&self, x: &[T], dy: &[T], hidden: usize) -> CResult<Vec<T>> {
        let saved = self.saved()?;
        let mut dx = Vec::with_capacity(x.len());
        let (mut start, mut k) = (0, 0);
        for (e, &r) in self.rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let rows = start * hidden..(start + r) * hidden;
            let io = (&x[rows.clone()], &dy[rows]);
            let (dx3, dx1) = self.expert_backward(e, io, r, hidden, Self::saved_of(&saved, k)?)?;
            simd::fast!(dx.extend(dx3.iter().zip(&dx1).map(|(&a, &b)| a + b)));
            k += 1;
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

/// Adds each of `rows` (`[len, hidden]`, assignments in order) times its gate to its
/// token's row of `out`, in order: the composed graph's broadcast multiply and index add.
#[inline(always)]
fn weigh_into<T: Real>(out: &mut [T], rows: &[T], gates: &[T], tokens: &[u32], hidden: usize) {
    for ((y, &t), &g) in rows.chunks_exact(hidden).zip(tokens).zip(gates) {
        let t = t as usize;
        for (o, &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(y) {
            *o += v * g;
        }
    }
}

/// Adds each row of `a + b` (`[len, hidden]` each, summed element by element first, as the
/// per-expert graph sums an expert's `dx3 + dx1`) to its token's row of `out`, in order: an
/// index select's backward (its rows added into zeros in index order).
#[inline(always)]
fn add_rows<T: Real>(out: &mut [T], (a, b): (&[T], &[T]), tokens: &[u32], hidden: usize) {
    for ((x, y), &t) in a.chunks_exact(hidden).zip(b.chunks_exact(hidden)).zip(tokens) {
        let t = t as usize;
        for ((o, &u), &v) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(x).zip(y) {
            *o += u + v;
        }
    }
}

/// The backward of [`weigh_into`] for `rows` given the output's gradient `dy`: each row's
/// gradient (its token's times its gate), appended to `drows`, and each gate's (the dot
/// product of the row and its token's gradient, in `dot`'s order), appended to `dgates`.
#[inline(always)]
fn weigh_back<T: Real>(
    dy: &[T],
    rows: &[T],
    gates: &[T],
    tokens: &[u32],
    hidden: usize,
    (drows, dgates): (&mut Vec<T>, &mut Vec<T>),
) {
    for ((y, &t), &g) in rows.chunks_exact(hidden).zip(tokens).zip(gates) {
        let d = &dy[t as usize * hidden..(t as usize + 1) * hidden];
        drows.extend(d.iter().map(|&v| v * g));
        dgates.push(dot(d, y));
    }
}

/// Checks `tokens` against `n` token rows and `a` assignments.
fn check_tokens(op: &str, tokens: &[u32], n: usize, a: usize) -> CResult<()> {
    if tokens.len() != a {
        return Err(Error::Msg(format!("{op}: {a} assignments, {} tokens", tokens.len())));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= n) {
        return Err(Error::Msg(format!("{op}: token {t} of {n}")));
    }
    Ok(())
}

/// The experts with their routing (see the module's documentation): for tokens `x` `[n,
/// hidden]` and `a` assignments, assignment `i` sends row `tokens[i]` to its expert (the
/// assignments grouped by expert, `rows[e]` of them for expert `e`, in order) and adds the
/// output times `gates[i]` to that token's output row, in assignment order.
#[derive(Debug)]
struct RoutedOp {
    experts: ExpertsOp,
    tokens: Vec<u32>,
    /// The assignments' rows of `x` (`[a, hidden]`) and each expert's outputs (one tensor
    /// per expert with rows, in order), from the forward.
    routed: Mutex<Option<(Tensor, Vec<Tensor>)>>,
}

impl RoutedOp {
    fn check(&self, n: usize, a: usize) -> CResult<()> {
        let op = "routed experts";
        check_tokens(op, &self.tokens, n, a)?;
        let rows = &self.experts.rows;
        if rows.iter().sum::<usize>() != a || rows.len() != self.experts.experts.len() {
            return Err(Error::Msg(format!(
                "{op}: {a} assignments for {} experts, grouped as {rows:?}",
                self.experts.experts.len(),
            )));
        }
        Ok(())
    }

    /// The output, plus `residual` where given (`residual + output`, as the composed
    /// residual add sums them).
    fn forward<T: Real>(
        &self,
        x: &[T],
        gates: &[T],
        residual: Option<&[T]>,
        hidden: usize,
    ) -> CResult<Vec<T>> {
        let a = self.tokens.len();
        let mut routed = Vec::with_capacity(a * hidden);
        for &t in &self.tokens {
            let t = t as usize;
            routed.extend_from_slice(&x[t * hidden..(t + 1) * hidden]);
        }
        let mut out = vec![T::ZERO; x.len()];
        let (mut outputs, mut saved) = (Vec::new(), Vec::new());
        let mut start = 0;
        for (e, &r) in self.experts.rows.iter().enumerate() {
            if r == 0 {
                continue;
            }
            let xe = &routed[start * hidden..(start + r) * hidden];
            let (ye, keep) = self.experts.expert_forward(e, xe, r, hidden)?;
            let block = start..start + r;
            let (g, tokens) = (&gates[block.clone()], &self.tokens[block]);
            simd::fast!(weigh_into(&mut out, &ye, g, tokens, hidden));
            outputs.push(Tensor::from_vec(ye, (r, hidden), &candle_core::Device::Cpu)?);
            saved.push(keep);
            start += r;
        }
        *self.experts.saved()? = saved;
        let routed = Tensor::from_vec(routed, (a, hidden), &candle_core::Device::Cpu)?;
        *saved_state(&self.routed, "routed experts")? = Some((routed, outputs));
        if let Some(r) = residual {
            simd::fast!(out.iter_mut().zip(r).for_each(|(o, &r)| *o = r + *o));
        }
        Ok(out)
    }

    /// The tokens' gradient and the gates'.
    fn backward<T: Real>(&self, gates: &[T], dy: &[T], hidden: usize) -> CResult<(Vec<T>, Vec<T>)> {
        let op = "routed experts backward";
        let saved = self.experts.saved()?;
        let routed = saved_state(&self.routed, op)?;
        let (xs, ys) = routed
            .as_ref()
            .ok_or_else(|| Error::Msg(format!("{op}: backward without its forward")))?;
        let mut dx = vec![T::ZERO; dy.len()];
        let mut dgates = Vec::with_capacity(gates.len());
        with_data::<T, _>(xs, op, |xs| {
            let (mut start, mut k) = (0, 0);
            for (e, &r) in self.experts.rows.iter().enumerate() {
                if r == 0 {
                    continue;
                }
                let ye = ys
                    .get(k)
                    .ok_or_else(|| Error::Msg(format!("{op}: no outputs kept for expert {e}")))?;
                let (block, mut dye) = (start..start + r, Vec::with_capacity(r * hidden));
                let (g, tokens) = (&gates[block.clone()], &self.tokens[block]);
                with_data::<T, _>(ye, op, |ye| {
                    let rows = (&mut dye, &mut dgates);
                    simd::fast!(weigh_back(dy, ye, g, tokens, hidden, rows));
                    Ok(())
                })?;
                let (held, xe) =
                    (ExpertsOp::saved_of(&saved, k)?, &xs[start * hidden..(start + r) * hidden]);
                let (dx3, dx1) = self.experts.expert_backward(e, (xe, &dye), r, hidden, held)?;
                simd::fast!(add_rows(&mut dx, (&dx3, &dx1), tokens, hidden));
                k += 1;
                start += r;
            }
            Ok(())
        })?;
        Ok((dx, dgates))
    }
}

impl RoutedOp {
    /// The forward on the tokens `(s1, l1)`, the gates `(s2, l2)` and, where the node adds
    /// it, the residual `(s3, l3)`.
    fn cpu_fwd_with(
        &self,
        (s1, l1): (&CpuStorage, &Layout),
        (s2, l2): (&CpuStorage, &Layout),
        residual: Option<(&CpuStorage, &Layout)>,
    ) -> CResult<(CpuStorage, Shape)> {
        let op = "routed experts";
        // Tokens `[.., hidden]`: a matrix, or the layer's `[b, s, hidden]` as it is.
        let Some((&hidden, lead)) = l1.shape().dims().split_last().filter(|(_, l)| !l.is_empty())
        else {
            return Err(Error::Msg(format!(
                "{op}: tokens {:?} are not a matrix or more",
                l1.shape()
            )));
        };
        self.check(lead.iter().product(), l2.shape().elem_count())?;
        if let Some((_, l3)) = residual.filter(|(_, l3)| l3.shape() != l1.shape()) {
            return Err(Error::Msg(format!(
                "{op}: a residual {:?} for tokens {:?}",
                l3.shape(),
                l1.shape()
            )));
        }
        by_real!(s1, op, |T| {
            let x = slice::<T>(s1, l1, op)?;
            let gates = slice::<T>(s2, l2, op)?;
            let r = residual.map(|(s3, l3)| slice::<T>(s3, l3, op)).transpose()?;
            let y = self.forward(x, gates, r, hidden)?;
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), l1.shape().clone()))
        })
    }

    /// The tokens' and the gates' gradients.
    fn bwd_with(&self, x: &Tensor, gates: &Tensor, grad: &Tensor) -> CResult<(Tensor, Tensor)> {
        let op = "routed experts";
        let grad = grad.contiguous()?;
        let hidden = *x.dims().last().ok_or_else(|| Error::Msg(format!("{op}: scalar tokens")))?;
        by_real_dtype!(x.dtype(), op, |T| {
            let (dx, dg) = with_data::<T, _>(gates, op, |g| {
                with_data::<T, _>(&grad, op, |d| self.backward(g, d, hidden))
            })?;
            Ok((
                Tensor::from_vec(dx, x.shape(), x.device())?,
                Tensor::from_vec(dg, gates.shape(), gates.device())?,
            ))
        })
    }
}

impl CustomOp2 for RoutedOp {
    fn name(&self) -> &'static str {
        "routed-experts"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        self.cpu_fwd_with((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        gates: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dg) = self.bwd_with(x, gates, grad)?;
        Ok((Some(dx), Some(dg)))
    }
}

/// With the residual: its gradient is the output's.
impl CustomOp3 for RoutedOp {
    fn name(&self) -> &'static str {
        "routed-experts-residual"
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
        self.cpu_fwd_with((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gates: &Tensor,
        _residual: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dg) = self.bwd_with(x, gates, grad)?;
        Ok((Some(dx), Some(dg), Some(grad.clone())))
    }
}

/// The MoE layer's experts with the routing around them, as one node (see the module's
/// documentation): for tokens `x` `[n, hidden]` (or `[b, s, hidden]`, `n = b * s`, the
/// output shaped alike), `tokens[i]` is the token of assignment `i`
/// and `gates[i]` (`gates` of `a` elements) its weight, the assignments grouped by expert
/// (`rows[e]` of them for `experts[e]`, in order). Token `t`'s output is the sum, in
/// assignment order, of `gates[i] w2 (silu(w1 x_t) * w3 x_t)` over its assignments `i`
/// (zero for a token with none); gradients go to `x` and `gates`, and the weights' to their
/// sinks. With a `residual` shaped like `x` (a pre-norm layer's input), the node returns
/// `residual + output` (the composed residual add's sum) and passes the output's gradient
/// to it: the add's own node would zero-fill and add a gradient the size of `x` for each
/// side.
pub fn routed_experts(
    how: Matmul,
    x: &Tensor,
    gates: &Tensor,
    experts: Vec<ExpertWeights>,
    (rows, tokens): (Vec<usize>, Vec<u32>),
    residual: Option<&Tensor>,
) -> CResult<Tensor> {
    let experts = ExpertsOp { how, experts, rows, saved: Mutex::new(Vec::new()) };
    let op = RoutedOp { experts, tokens, routed: Mutex::new(None) };
    let (x, gates) = (x.contiguous()?, gates.contiguous()?);
    match residual {
        Some(r) => x.apply_op3(&gates, &r.contiguous()?, op),
        None => x.apply_op2(&gates, op),
    }
}

/// The weighted sum of an MoE layer's expert outputs back at their tokens, where they came
/// back from other ranks: `rows` `[a, hidden]` in assignment order, `gates` `[a]`, into
/// `n` token rows, each row times its gate added to its token's in order (zero for a token
/// with none). The composed broadcast multiply and index add, whose backwards make and add
/// several `[a, hidden]` tensors; here the rows' gradient is written once, and the gates'
/// as [`routed_experts`] sums them.
#[derive(Debug)]
struct CombineOp {
    tokens: Vec<u32>,
    n: usize,
}

impl CustomOp2 for CombineOp {
    fn name(&self) -> &'static str {
        "combine-experts"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let op = "combine experts";
        let &[a, hidden] = l1.shape().dims() else {
            return Err(Error::Msg(format!("{op}: rows {:?} are not a matrix", l1.shape())));
        };
        check_tokens(op, &self.tokens, self.n, a)?;
        if l2.shape().elem_count() != a {
            return Err(Error::Msg(format!("{op}: {a} rows, {:?} gates", l2.shape())));
        }
        by_real!(s1, op, |T| {
            let (rows, gates) = (slice::<T>(s1, l1, op)?, slice::<T>(s2, l2, op)?);
            let mut out = vec![T::ZERO; self.n * hidden];
            simd::fast!(weigh_into(&mut out, rows, gates, &self.tokens, hidden));
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(out), (self.n, hidden).into()))
        })
    }

    fn bwd(
        &self,
        rows: &Tensor,
        gates: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let op = "combine experts";
        let grad = grad.contiguous()?;
        let (a, hidden) = rows.dims2()?;
        by_real_dtype!(rows.dtype(), op, |T| {
            let (mut drows, mut dgates) = (Vec::with_capacity(a * hidden), Vec::with_capacity(a));
            with_data::<T, _>(rows, op, |r| {
                with_data::<T, _>(gates, op, |g| {
                    with_data::<T, _>(&grad, op, |d| {
                        let out = (&mut drows, &mut dgates);
                        simd::fast!(weigh_back(d, r, g, &self.tokens, hidden, out));
                        Ok(())
                    })
                })
            })?;
            Ok((
                Some(Tensor::from_vec(drows, rows.shape(), rows.device())?),
                Some(Tensor::from_vec(dgates, gates.shape(), gates.device())?),
            ))
        })
    }
}

/// Each of `rows` (`[a, hidden]`, the experts' outputs in assignment order) times its gate
/// (`gates`, `a` elements) summed at its token (`tokens[i]` of `n`), in assignment order, as
/// one node: `[n, hidden]`. Gradients go to `rows` and `gates`, the gates' summed as
/// [`routed_experts`] sums them.
pub fn combine_experts(
    rows: &Tensor,
    gates: &Tensor,
    tokens: Vec<u32>,
    n: usize,
) -> CResult<Tensor> {
    rows.contiguous()?.apply_op2(&gates.contiguous()?, CombineOp { tokens, n })
}
