//! `x @ w^T` as one autograd node, `x` `[.., in]` and `w` `[out, in]` (HF's layout) to
//! `[.., out]`, and the same with a bias added to every row. Written with candle ops the
//! product is a reshape, a transpose, a matmul and a reshape, and candle's backward gives
//! each node a gradient tensor it zero-fills and adds into: for a linear layer that is
//! several full passes over activations and weights per step, and one more for a separate
//! bias add. Here the backward computes `dx = dy w`, `dw = dy^T x` and the bias gradient
//! (the column sums of `dy`) straight into their own layouts; `dx` only where `x` tracks a
//! gradient (a `Var` or computed from one: not an image's patches cut from its pixels),
//! so candle's store holds none for such an input. With a bias the output is
//! the product plus the bias, element by element, as the unfused bias add computes it, so
//! the fused and unfused forms give the same bits.
//!
//! Given a [`GradSink`] (the layers give their weight's), the backward adds `dw` to the
//! sink and hands candle no gradient for the weight, which then must be the parameter's
//! `Var` itself ([`super::sink`] says why).
//!
//! Under [`Matmul::Bf16`] all three products (forward, `dx`, `dw`) multiply bf16-rounded
//! operands and sum in f32 ([`super::bf16`]); the tensors, the bias and its gradient stay
//! f32.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Error, Layout, Shape, Tensor};

use super::gemm::{View, matmul_new};
use super::pointwise::{BiasAddOp, GeluOp};
use super::sink::GradSink;
use super::{CResult, Real, by_real, by_real_dtype, saved_state, simd, slice, with_data};

/// How a linear layer multiplies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Matmul {
    /// In the tensors' own element type.
    #[default]
    Native,
    /// bf16 operands (rounded from f32 tensors), f32 sums: `dtype = "bf16"`.
    Bf16,
}

/// The product `x @ w^T`.
#[derive(Clone, Debug, Default)]
pub struct LinearOp {
    /// How it multiplies.
    pub how: Matmul,
    /// Where the backward puts `dw`; `None`: candle's gradient store.
    pub sink: Option<GradSink>,
}

/// The product `x @ w^T + b`, `b` `[out]` added to every row.
#[derive(Clone, Debug, Default)]
pub struct LinearBiasOp {
    /// How it multiplies.
    pub how: Matmul,
    /// Where the backward puts `dw` (the bias's gradient goes to candle's store).
    pub sink: Option<GradSink>,
}

/// `dw` as a tensor shaped like `w` for candle's store, or added to `sink` (then `None`).
fn weight_grad<T: Real>(
    sink: Option<&GradSink>,
    dw: Vec<T>,
    w: &Tensor,
) -> CResult<Option<Tensor>> {
    match sink {
        Some(s) => {
            s.add(dw)?;
            Ok(None)
        }
        None => Ok(Some(Tensor::from_vec(dw, w.shape(), w.device())?)),
    }
}

/// `(rows, in, out)` of `x` `[.., in]` and `w` `[out, in]`.
fn dims(x: &Shape, w: &Shape) -> CResult<(usize, usize, usize)> {
    let Some((&inner, lead)) = x.dims().split_last() else {
        return Err(Error::Msg(format!("linear: input {x:?} has no feature dim")));
    };
    match w.dims() {
        &[out, i] if i == inner => Ok((lead.iter().product(), inner, out)),
        _ => Err(Error::Msg(format!("linear: input {x:?} and weight {w:?} do not fit"))),
    }
}

/// The output shape: `x`'s with its last dim `out`.
fn out_shape(x: &Shape, out: usize) -> Shape {
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("dims checked it has a feature dim") = out;
    Shape::from(shape)
}

/// A new matrix of `len` elements, `lhs @ rhs` written through `dv` (which names each of
/// them once), on as many threads as candle's matmuls, multiplying as `how` says.
fn mul<T: Real>(
    how: Matmul,
    len: usize,
    dv: View,
    lhs: &[T],
    lv: View,
    rhs: &[T],
    rv: View,
) -> CResult<Vec<T>> {
    match how {
        Matmul::Native => Ok(matmul_new(len, dv, lhs, lv, rhs, rv)),
        Matmul::Bf16 => T::bf16_product(len, dv, lhs, lv, rhs, rv, super::threads()),
    }
}

/// `x @ w^T` into a new row-major `[rows, out]`.
///
/// With few f32 rows against the inner length and the outputs (`2 * rows <= inner`,
/// `rows < out`), gemm's kernels run this product far below their rate when the result is
/// row-major: they repack all of `w` for a handful of rows (64 rows of a 704 x 512 weight:
/// 100 GFLOP/s where the square product runs 230 on one Zen 5 core). Written column-major,
/// the same product runs at the full rate, and a blocked transpose of the `rows x out`
/// result costs less than the difference (BENCHMARKS.md, "Short products"). Narrow outputs
/// run 1.4-3x slower that way (64 outputs; an MoE router's 8), hence `rows < out`. The
/// sums are the same products in another order, so the two forms agree to rounding, not
/// to the bit. gemm's f64 kernels gain at some of these shapes and lose at others, so f64
/// (the parity reference) keeps one form.
///
/// The bf16 kernel ([`super::bf16`]) has the same trouble at few rows (it rounds and packs
/// the weight with strided reads for a handful of rows, all of them in one row block):
/// with at most half as many rows as outputs it computes `w x^T` into `y`'s transpose
/// (704 x 512 weight, AVX512-BF16 on one Zen 5 core: 32 rows 171 -> 287 GFLOP/s, 128 rows
/// 318 -> 350; the AMX kernel then runs it as whichever of the two transposes less).
pub(crate) fn product<T: Real>(
    how: Matmul,
    x: &[T],
    w: &[T],
    (rows, inner, out): (usize, usize, usize),
) -> CResult<Vec<T>> {
    let (xv, wt) = (View::rows(0, rows, inner, inner), View::rows(0, out, inner, inner).t());
    let f32 = <T as candle_core::WithDType>::DTYPE == candle_core::DType::F32;
    if how == Matmul::Native && f32 && 2 * rows <= inner && rows < out && rows > 0 {
        let cv = View { offset: 0, rows, cols: out, rs: 1, cs: rows };
        let columns = mul(how, rows * out, cv, x, xv, w, wt)?;
        let mut y = vec![T::ZERO; rows * out];
        transpose::transpose(&columns, &mut y, rows, out);
        Ok(y)
    } else if how == Matmul::Bf16 && 2 * rows <= out {
        // `y^T = w x^T`, written through `y`'s transpose: the weight's rows go to the
        // kernel's row blocks (packed from contiguous rows, split over threads) and the
        // few rows of `x` to its 32-wide column panels.
        let yt = View::rows(0, rows, out, out).t();
        mul(how, rows * out, yt, w, View::rows(0, out, inner, inner), x, xv.t())
    } else {
        mul(how, rows * out, View::rows(0, rows, out, out), x, xv, w, wt)
    }
}

/// `dx = dy w`, a tensor shaped like `x`, and `dw = dy^T x`, `w`'s elements in its order.
/// No `dx` where `x` tracks no gradient (neither a `Var` nor computed from one: the patches
/// of an image, cut from the pixels, under an encoder's patch embedding): candle would
/// zero-fill a gradient for it, add `dx` into that and never read it, after a product as
/// large as the layer's forward (PyTorch's autograd leaves it out alike).
fn input_grads<T: Real>(
    how: Matmul,
    x: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    dims: (usize, usize, usize),
) -> CResult<(Option<Tensor>, Vec<T>)> {
    let op = "linear backward";
    with_data::<T, _>(grad, op, |gd| {
        let dx = if x.track_op() {
            let dx = with_data::<T, _>(w, op, |wd| input_grad(how, wd, gd, dims))?;
            Some(Tensor::from_vec(dx, x.shape(), x.device())?)
        } else {
            None
        };
        let dw = with_data::<T, _>(x, op, |xd| weight_grad_of(how, xd, gd, dims))?;
        Ok((dx, dw))
    })
}

/// `dx = dy w` (`[rows, in]`) and `dw = dy^T x` (`[out, in]`) on row-major slices: the
/// backward of [`product`].
pub(crate) fn backward<T: Real>(
    how: Matmul,
    x: &[T],
    w: &[T],
    dy: &[T],
    dims: (usize, usize, usize),
) -> CResult<(Vec<T>, Vec<T>)> {
    Ok((input_grad(how, w, dy, dims)?, weight_grad_of(how, x, dy, dims)?))
}

/// `dx = dy w` (`[rows, in]`) on row-major slices.
pub(crate) fn input_grad<T: Real>(
    how: Matmul,
    w: &[T],
    dy: &[T],
    (rows, inner, out): (usize, usize, usize),
) -> CResult<Vec<T>> {
    let gv = View::rows(0, rows, out, out);
    let xv = View::rows(0, rows, inner, inner);
    mul(how, rows * inner, xv, dy, gv, w, View::rows(0, out, inner, inner))
}

/// `dw = dy^T x` (`[out, in]`) on row-major slices.
pub(crate) fn weight_grad_of<T: Real>(
    how: Matmul,
    x: &[T],
    dy: &[T],
    (rows, inner, out): (usize, usize, usize),
) -> CResult<Vec<T>> {
    let gv = View::rows(0, rows, out, out);
    let xv = View::rows(0, rows, inner, inner);
    mul(how, out * inner, View::rows(0, out, inner, inner), dy, gv.t(), x, xv)
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let dims = dims(l1.shape(), l2.shape())?;
        by_real!(s1, "linear", |T| {
            let (x, w) = (slice::<T>(s1, l1, "linear")?, slice::<T>(s2, l2, "linear")?);
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(product(self.how, x, w, dims)?),
                out_shape(l1.shape(), dims.2),
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
        let dims = dims(x.shape(), w.shape())?;
        let grad = grad.contiguous()?;
        by_real_dtype!(x.dtype(), "linear", |T| {
            let (dx, dw) = input_grads::<T>(self.how, x, w, &grad, dims)?;
            Ok((dx, weight_grad(self.sink.as_ref(), dw, w)?))
        })
    }
}

/// [`dims`] of `x`, `w`, checking that bias `b` has one element per output.
fn bias_dims(x: &Shape, w: &Shape, b: &Shape) -> CResult<(usize, usize, usize)> {
    let dims = dims(x, w)?;
    if b.dims() != [dims.2] {
        return Err(Error::Msg(format!("linear: bias {b:?} does not fit weight {w:?}")));
    }
    Ok(dims)
}

/// `x @ w^T + b` on row-major slices: the product, then the bias (if any) added to every
/// row, element by element, as the unfused bias add computes it.
pub(crate) fn biased<T: Real>(
    how: Matmul,
    x: &[T],
    w: &[T],
    b: Option<&[T]>,
    dims: (usize, usize, usize),
) -> CResult<Vec<T>> {
    let mut y = product(how, x, w, dims)?;
    if let Some(b) = b {
        simd::fast!(BiasAddOp::add_rows(&mut y, b));
    }
    Ok(y)
}

/// [`biased`] on the storages of a linear-bias op's three inputs.
fn biased_storage<T: Real>(
    how: Matmul,
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    (s3, l3): (&CpuStorage, &Layout),
    dims: (usize, usize, usize),
) -> CResult<Vec<T>> {
    let (x, w) = (slice::<T>(s1, l1, "linear")?, slice::<T>(s2, l2, "linear")?);
    biased(how, x, w, Some(slice::<T>(s3, l3, "linear")?), dims)
}

impl CustomOp3 for LinearBiasOp {
    fn name(&self) -> &'static str {
        "linear-bias"
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
        let dims = bias_dims(l1.shape(), l2.shape(), l3.shape())?;
        by_real!(s1, "linear", |T| {
            let y = biased_storage::<T>(self.how, (s1, l1), (s2, l2), (s3, l3), dims)?;
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(y),
                out_shape(l1.shape(), dims.2),
            ))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dims = dims(x.shape(), w.shape())?;
        let grad = grad.contiguous()?;
        fn run<T: Real>(
            op: &LinearBiasOp,
            x: &Tensor,
            w: &Tensor,
            grad: &Tensor,
            dims: (usize, usize, usize),
        ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let (dx, dw) = input_grads::<T>(op.how, x, w, grad, dims)?;
            let db = with_data::<T, _>(grad, "linear backward", |g| {
                Ok(simd::fast!(BiasAddOp::bias_grad(g, dims.2)))
            })?;
            let db = Tensor::from_vec(db, dims.2, grad.device())?;
            Ok((dx, weight_grad(op.sink.as_ref(), dw, w)?, Some(db)))
        }
        by_real_dtype!(x.dtype(), "linear", |T| run::<T>(self, x, w, &grad, dims))
    }
}

/// `gelu(x @ w^T + b)` as one node (a GELU MLP's first layer). Apart, the GELU is a node
/// of its own whose input gradient candle zero-fills and adds into, a full pass over the
/// MLP's widest activation (and a zero fill of it) on every backward; here the backward
/// turns the output's gradient into the pre-activation's ([`GeluOp`]'s backward, from the
/// pre-activation the forward keeps and the output) and goes on as [`LinearBiasOp`]'s. The
/// sum, the GELU and both backwards are the separate nodes' own, so the bits are theirs.
#[derive(Debug)]
struct LinearBiasGeluOp {
    linear: LinearBiasOp,
    /// `x @ w^T + b`, from the forward.
    pre: Mutex<Option<Tensor>>,
}

impl CustomOp3 for LinearBiasGeluOp {
    fn name(&self) -> &'static str {
        "linear-bias-gelu"
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
        let dims = bias_dims(l1.shape(), l2.shape(), l3.shape())?;
        let shape = out_shape(l1.shape(), dims.2);
        by_real!(s1, "linear", |T| {
            let pre = biased_storage::<T>(self.linear.how, (s1, l1), (s2, l2), (s3, l3), dims)?;
            let y = simd::fast!({ GeluOp::forward(&pre, self.linear.how) });
            let pre = Tensor::from_vec(pre, shape.clone(), &candle_core::Device::Cpu)?;
            *saved_state(&self.pre, "linear-bias-gelu")? = Some(pre);
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), shape))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let pre = saved_state(&self.pre, "linear-bias-gelu")?.clone();
        let pre =
            pre.ok_or_else(|| Error::Msg("linear-bias-gelu: backward without its forward".into()))?;
        let gelu = GeluOp { how: self.linear.how };
        let dpre =
            gelu.bwd(&pre, res, grad)?.expect("the GELU's backward gives its input's gradient");
        self.linear.bwd(x, w, b, &pre, &dpre)
    }
}

/// `x @ w^T` through the fused op (`x` `[.., in]`, `w` `[out, in]`). Its backward gives
/// `x` no gradient where `x` tracks none (see the module doc).
pub fn linear(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    linear_as(Matmul::Native, x, w)
}

/// [`linear`], multiplying as `how` says.
pub fn linear_as(how: Matmul, x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, LinearOp { how, sink: None })
}

/// The sink to give the op for weight `w`: only a `Var` may leave candle's store without a
/// gradient (a tensor computed from one, say a reshape, must pass its gradient on).
fn sink_for<'s>(w: &Tensor, sink: &'s GradSink) -> Option<&'s GradSink> {
    (w.is_variable() && w.is_contiguous()).then_some(sink)
}

/// [`linear_as`] with `dw` added to `sink` rather than to candle's gradient store (when `w`
/// is a `Var`; otherwise as [`linear_as`]).
pub fn linear_into(how: Matmul, x: &Tensor, w: &Tensor, sink: &GradSink) -> CResult<Tensor> {
    let sink = sink_for(w, sink).cloned();
    x.contiguous()?.apply_op2(&w.contiguous()?, LinearOp { how, sink })
}

/// `x @ w^T + b` through the fused op (`b` `[out]`, added to every row), `x`'s gradient as
/// [`linear`]'s.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> CResult<Tensor> {
    linear_bias_as(Matmul::Native, x, w, b)
}

/// [`linear_bias`], multiplying as `how` says.
pub fn linear_bias_as(how: Matmul, x: &Tensor, w: &Tensor, b: &Tensor) -> CResult<Tensor> {
    let op = LinearBiasOp { how, sink: None };
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
}

/// [`linear_bias_as`] with `dw` added to `sink` (when `w` is a `Var`), as [`linear_into`].
pub fn linear_bias_into(
    how: Matmul,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    sink: &GradSink,
) -> CResult<Tensor> {
    let op = LinearBiasOp { how, sink: sink_for(w, sink).cloned() };
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
}

/// `gelu(x @ w^T + b)` as one node, with `dw` added to `sink` (when `w` is a `Var`), as
/// [`linear_bias_into`]: the same bits as `gelu_as(how, &linear_bias_into(how, ..))`.
pub fn linear_bias_gelu_into(
    how: Matmul,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    sink: &GradSink,
) -> CResult<Tensor> {
    let linear = LinearBiasOp { how, sink: sink_for(w, sink).cloned() };
    let op = LinearBiasGeluOp { linear, pre: Mutex::new(None) };
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, op)
}
