//! What a module keeps in memory on one rank, and offload: a colocated encoder's
//! parameters, gradients and optimizer state packed into one compact host buffer while the
//! LLM pipeline runs (the tensors dropped), and unpacked for its backward and step.
//!
//! On this CPU build host and device memory are the same, so offload shrinks the working
//! set of tensors the executor holds; on a GPU build the same buffer is where device
//! memory goes. The parameters go only where the encoder's phase-1 forwards kept no
//! autograd graph (`recompute`): a kept graph references them, so releasing them would free
//! nothing, and candle cannot release a tensor's storage in place.

use candle_core::{DType, Device, Tensor, Var, WithDType};

use crate::error::RuntimeError;

type Result<T> = std::result::Result<T, RuntimeError>;

/// Bytes of one module on one rank, the largest value seen over a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    /// Everything the executor holds for the module (parameters, gradients, optimizer
    /// state, stashed activations and their gradients), the step's high-water mark.
    pub peak: u64,
    /// The same while the LLM computes (phase 2 of a colocated step): where offload shows.
    pub llm_phase: u64,
    /// Host buffer of an offloaded module, at its largest.
    pub host: u64,
}

impl Resident {
    /// The larger of each field.
    pub fn max(self, o: Resident) -> Resident {
        Resident {
            peak: self.peak.max(o.peak),
            llm_phase: self.llm_phase.max(o.llm_phase),
            host: self.host.max(o.host),
        }
    }
}

/// Bytes of `tensors`' elements.
pub fn bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors.into_iter().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
}

/// Tensors packed into one contiguous host buffer, in order, with their shapes.
#[derive(Debug)]
pub struct HostCopy {
    dtype: DType,
    shapes: Vec<Vec<usize>>,
    data: Vec<u8>,
}

impl HostCopy {
    /// Packs `tensors` (one dtype) into one buffer; the caller drops the tensors.
    pub fn pack(tensors: &[Tensor], dtype: DType) -> Result<HostCopy> {
        let mut data = Vec::with_capacity(bytes(tensors) as usize);
        let mut shapes = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.dtype() != dtype {
                return Err(RuntimeError::Model(format!(
                    "offload packs one dtype ({dtype:?}), got a {:?} tensor",
                    t.dtype()
                )));
            }
            shapes.push(t.dims().to_vec());
            let flat = t.flatten_all()?;
            match dtype {
                DType::F32 => {
                    data.extend(flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_ne_bytes()))
                }
                DType::F64 => {
                    data.extend(flat.to_vec1::<f64>()?.iter().flat_map(|x| x.to_ne_bytes()))
                }
                other => {
                    return Err(RuntimeError::Model(format!("offload of {other:?} tensors")));
                }
            }
        }
        Ok(HostCopy { dtype, shapes, data })
    }

    /// Bytes held.
    pub fn len(&self) -> u64 {
        self.data.len() as u64
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The tensors back, as packed; those from index `vars_from` on come back as variables
    /// (trainable parameters: `Var::from_tensor` takes them without a copy).
    pub fn unpack(self, vars_from: usize) -> Result<Vec<Tensor>> {
        let size = self.dtype.size_in_bytes();
        let mut at = 0;
        let mut out = Vec::with_capacity(self.shapes.len());
        for (i, shape) in self.shapes.iter().enumerate() {
            let var = i >= vars_from;
            let n: usize = shape.iter().product();
            let chunk = &self.data[at..at + n * size];
            at += n * size;
            let t = match self.dtype {
                DType::F32 => {
                    let v: Vec<f32> = chunk
                        .chunks_exact(4)
                        .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
                        .collect();
                    tensor(v, shape, var)?
                }
                _ => {
                    let v: Vec<f64> = chunk
                        .chunks_exact(8)
                        .map(|b| f64::from_ne_bytes(b.try_into().expect("8 bytes")))
                        .collect();
                    tensor(v, shape, var)?
                }
            };
            out.push(t);
        }
        Ok(out)
    }
}

/// A tensor of `v`, a variable (tracked by autograd) if `var`.
fn tensor<T: WithDType>(v: Vec<T>, shape: &[usize], var: bool) -> Result<Tensor> {
    Ok(if var {
        Var::from_vec(v, shape, &Device::Cpu)?.into_inner()
    } else {
        Tensor::from_vec(v, shape, &Device::Cpu)?
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use candle_core::{DType, Device, Tensor};

    use super::{HostCopy, bytes};

    #[test]
    fn a_host_copy_gives_back_the_same_bits() {
        for dtype in [DType::F32, DType::F64] {
            let a = Tensor::randn(0.0, 1.0, (3, 5), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let b = Tensor::randn(0.0, 1.0, 7, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let c = HostCopy::pack(&[a.clone(), b.clone()], dtype).unwrap();
            assert_eq!(c.len(), bytes([&a, &b]));
            let back = c.unpack(1).unwrap();
            assert!(!back[0].is_variable() && back[1].is_variable());
            for (x, y) in [a, b].iter().zip(&back) {
                assert_eq!(x.dims(), y.dims());
                let d = (x - y).unwrap().abs().unwrap().sum_all().unwrap();
                assert_eq!(d.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), 0.0);
            }
        }
    }
}
