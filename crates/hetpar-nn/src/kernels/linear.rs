//! `x @ w^T` as one autograd node, `x` `[.., in]` and `w` `[out, in]` (HF's layout) to
//! `[.., out]`. Written with candle ops the same product is a reshape, a transpose, a matmul
//! and a reshape, and candle's backward gives each node a gradient tensor it zero-fills and
//! adds into: for a linear layer that is several full passes over activations and weights
//! per step. Here the backward computes `dx = dy w` and `dw = dy^T x` straight into their
//! own layouts.

use candle_core::{CpuStorage, CustomOp2, Error, Layout, Shape, Tensor};

use super::gemm::{View, matmul_wide};
use super::{CResult, Real, by_real, by_real_dtype, slice, with_data};

/// The product `x @ w^T`.
#[derive(Clone, Copy, Debug)]
pub struct LinearOp;

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
        let (rows, inner, out) = dims(l1.shape(), l2.shape())?;
        let mut shape = l1.shape().dims().to_vec();
        *shape.last_mut().expect("checked") = out;
        by_real!(s1, "linear", |T| {
            let (x, w) = (slice::<T>(s1, l1, "linear")?, slice::<T>(s2, l2, "linear")?);
            let mut y = vec![<T as Real>::ZERO; rows * out];
            matmul_wide(
                &mut y,
                View::rows(0, rows, out, out),
                x,
                View::rows(0, rows, inner, inner),
                w,
                View::rows(0, out, inner, inner).t(),
                false,
                <T as Real>::ONE,
            );
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), Shape::from(shape)))
        })
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (rows, inner, out) = dims(x.shape(), w.shape())?;
        let grad = grad.contiguous()?;
        fn run<T: Real>(
            x: &Tensor,
            w: &Tensor,
            grad: &Tensor,
            (rows, inner, out): (usize, usize, usize),
        ) -> CResult<(Tensor, Tensor)> {
            let op = "linear backward";
            let (dx, dw) = with_data::<T, _>(x, op, |xd| {
                with_data::<T, _>(w, op, |wd| {
                    with_data::<T, _>(grad, op, |gd| {
                        let gv = View::rows(0, rows, out, out);
                        let xv = View::rows(0, rows, inner, inner);
                        let mut dx = vec![T::ZERO; rows * inner];
                        matmul_wide(
                            &mut dx,
                            xv,
                            gd,
                            gv,
                            wd,
                            View::rows(0, out, inner, inner),
                            false,
                            T::ONE,
                        );
                        let mut dw = vec![T::ZERO; out * inner];
                        let wv = View::rows(0, out, inner, inner);
                        matmul_wide(&mut dw, wv, gd, gv.t(), xd, xv, false, T::ONE);
                        Ok((dx, dw))
                    })
                })
            })?;
            Ok((
                Tensor::from_vec(dx, x.shape(), x.device())?,
                Tensor::from_vec(dw, w.shape(), w.device())?,
            ))
        }
        let (dx, dw) =
            by_real_dtype!(x.dtype(), "linear", |T| run::<T>(x, w, &grad, (rows, inner, out)))?;
        Ok((Some(dx), Some(dw)))
    }
}

/// `x @ w^T` through the fused op (`x` `[.., in]`, `w` `[out, in]`).
pub fn linear(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, LinearOp)
}
