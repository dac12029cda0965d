//! Weight gradients summed outside candle's autograd.
//!
//! Candle's backward gives every input of a node a zero-filled gradient and adds the node's
//! contribution into it (`GradStore::or_insert`, then an add that allocates the sum). For a
//! weight that is a zero fill, a read of two weight-sized tensors and a write of a third on
//! every backward, for a tensor the product has just computed whole: for an MoE layer's 24
//! expert weights (34.6 MB at h 512, ffn 704), 19 ms on one core in a probe (glibc's
//! allocator, each tensor new), next to a 150 ms layer. The fused linear ops given a
//! [`GradSink`] put `dw` there
//! instead and hand candle no gradient for the weight (Megatron's gradient-accumulation
//! fusion writes the weight gradient into `main_grad` the same way); the parameter's
//! gradient is then whatever its sink holds plus whatever candle's store holds
//! ([`crate::Param::take_grad`]).
//!
//! The first gradient a sink takes is kept as computed. A second one, before the sink is
//! taken (a weight used twice in one graph), is added element by element, `sum + g`, as
//! candle's store adds: the sums have the same bits as through the store.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Error, Shape, Tensor};

use super::{CResult, Real};

/// A parameter's gradient sum, shared by the parameter and the ops that write it.
#[derive(Clone, Debug, Default)]
pub struct GradSink(Arc<Mutex<Option<CpuStorage>>>);

impl GradSink {
    /// A new, empty sink.
    pub fn new() -> GradSink {
        GradSink::default()
    }

    fn lock(&self) -> CResult<MutexGuard<'_, Option<CpuStorage>>> {
        // A panic while holding the lock leaves a half-written sum: refuse to use it.
        self.0.lock().map_err(|_| Error::Msg("a gradient sink was poisoned by a panic".into()))
    }

    /// Adds `g`, a gradient of the parameter's (flattened) elements.
    pub fn add<T: Real>(&self, g: Vec<T>) -> CResult<()> {
        let mut slot = self.lock()?;
        let sum = match slot.take() {
            None => g,
            Some(prev) => {
                let mut sum = T::cpu_storage_data(prev)?;
                if sum.len() != g.len() {
                    return Err(Error::Msg(format!(
                        "a gradient sink holding {} elements was given {}",
                        sum.len(),
                        g.len()
                    )));
                }
                for (s, x) in sum.iter_mut().zip(&g) {
                    *s += *x;
                }
                sum
            }
        };
        *slot = Some(T::to_cpu_storage_owned(sum));
        Ok(())
    }

    /// The sum so far as a tensor of `shape` (no copy), leaving the sink empty; `None` when
    /// nothing was added since the last take.
    pub fn take(&self, shape: &Shape) -> CResult<Option<Tensor>> {
        let Some(storage) = self.lock()?.take() else { return Ok(None) };
        let t = match storage {
            CpuStorage::F32(v) => Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?,
            CpuStorage::F64(v) => Tensor::from_vec(v, shape, &candle_core::Device::Cpu)?,
            other => {
                return Err(Error::Msg(format!(
                    "a gradient sink holds {:?}, not f32 or f64",
                    other.dtype()
                )));
            }
        };
        Ok(Some(t))
    }

    /// Drops the sum (a frozen parameter's gradient, which nothing reads).
    pub fn clear(&self) -> CResult<()> {
        *self.lock()? = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use candle_core::{Device, Shape, Tensor};

    use super::GradSink;

    #[test]
    fn a_sink_keeps_the_first_gradient_and_adds_later_ones_as_the_store_does() {
        let sink = GradSink::new();
        let shape = Shape::from((2, 2));
        assert!(sink.take(&shape).unwrap().is_none());
        let (a, b) = (vec![0.1f32, -0.0, 3.0, 1e-8], vec![0.2f32, 0.0, -3.0, 1.0]);
        sink.add(a.clone()).unwrap();
        sink.add(b.clone()).unwrap();
        let got = sink.take(&shape).unwrap().unwrap();
        let dev = &Device::Cpu;
        let want = (Tensor::new(a.as_slice(), dev).unwrap()
            + Tensor::new(b.as_slice(), dev).unwrap())
        .unwrap()
        .reshape((2, 2))
        .unwrap();
        let bits = |t: &Tensor| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&got), bits(&want));
        assert!(sink.take(&shape).unwrap().is_none(), "a take empties the sink");
        sink.add(vec![1.0f64; 3]).unwrap();
        let e = sink.add(vec![1.0f64; 4]).unwrap_err().to_string();
        assert!(e.contains("holding 3 elements was given 4"), "{e}");
        sink.clear().unwrap();
        assert!(sink.take(&Shape::from(3)).unwrap().is_none());
    }
}
