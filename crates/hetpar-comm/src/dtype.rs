//! Element types the communicators move, and the reductions they apply.
//!
//! Backends work on bytes tagged with a [`DType`]; the typed API casts slices of an
//! [`Element`] to bytes (bytemuck, no copies). Reductions combine contributions strictly in
//! member order, so a backend that uses [`reduce_into`] is bitwise deterministic.

use std::borrow::Cow;

use half::bf16;

/// Element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// bfloat16 (reduced in f32, rounded once per element).
    Bf16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bf16 => 2,
        }
    }

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::Bf16 => "bf16",
        }
    }
}

/// A type a communicator can move: plain old data with a [`DType`].
pub trait Element: bytemuck::Pod {
    /// Its tag.
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}
impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
    /// Minimum.
    Min,
}

impl ReduceOp {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        }
    }
}

fn combine<T: Copy + PartialOrd + std::ops::Add<Output = T>>(acc: &mut [T], x: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum => acc.iter_mut().zip(x).for_each(|(a, &b)| *a = *a + b),
        ReduceOp::Max => acc.iter_mut().zip(x).for_each(|(a, &b)| {
            if b > *a {
                *a = b;
            }
        }),
        ReduceOp::Min => acc.iter_mut().zip(x).for_each(|(a, &b)| {
            if b < *a {
                *a = b;
            }
        }),
    }
}

/// A typed copy of `bytes` (which need not be aligned for `T`).
pub(crate) fn typed<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// `bytes` as `T`s, borrowed when aligned, copied when not.
fn view<T: bytemuck::Pod>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(typed(bytes)),
    }
}

/// `add` is generic (not a function pointer) so the sum loop inlines and vectorizes.
fn fold_typed<T: bytemuck::Pod + PartialOrd + std::ops::Add<Output = T>>(
    acc: &mut [u8],
    rest: &[&[u8]],
    op: ReduceOp,
    add: impl Fn(T, T) -> T + Copy,
) {
    let fold = |acc: &mut [T]| {
        for p in rest {
            let x = view::<T>(p);
            match op {
                ReduceOp::Sum => acc.iter_mut().zip(x.iter()).for_each(|(a, &b)| *a = add(*a, b)),
                _ => combine(acc, &x, op),
            }
        }
    };
    // In place when `acc` is aligned for `T` (the usual case), else through a copy.
    if let Ok(a) = bytemuck::try_cast_slice_mut::<u8, T>(acc) {
        fold(a);
    } else {
        let mut a: Vec<T> = typed(acc);
        fold(&mut a);
        acc.copy_from_slice(bytemuck::cast_slice(&a));
    }
}

/// Folds `rest` into `acc` elementwise, in order: `((acc op r0) op r1) ...` (equal byte
/// lengths, any alignment). Integer sums wrap like two's complement hardware; bf16
/// accumulates in f32 and rounds once at the end.
pub fn reduce_onto(acc: &mut [u8], rest: &[&[u8]], dtype: DType, op: ReduceOp) {
    assert!(rest.iter().all(|p| p.len() == acc.len()), "reduce of unequal parts");
    match dtype {
        DType::F32 => fold_typed::<f32>(acc, rest, op, |a, b| a + b),
        DType::F64 => fold_typed::<f64>(acc, rest, op, |a, b| a + b),
        DType::I64 => fold_typed::<i64>(acc, rest, op, i64::wrapping_add),
        DType::Bf16 => {
            let widen =
                |p: &[u8]| -> Vec<f32> { view::<bf16>(p).iter().map(|v| v.to_f32()).collect() };
            let mut wide = widen(acc);
            for p in rest {
                combine(&mut wide, &widen(p), op);
            }
            let narrow: Vec<bf16> = wide.iter().map(|&a| bf16::from_f32(a)).collect();
            acc.copy_from_slice(bytemuck::cast_slice(&narrow));
        }
    }
}

/// Writes into `out` the reduction of `parts`, combined in order (see [`reduce_onto`]).
pub fn reduce_into(out: &mut [u8], parts: &[&[u8]], dtype: DType, op: ReduceOp) {
    assert!(!parts.is_empty(), "reduce of nothing");
    out.copy_from_slice(parts[0]);
    reduce_onto(out, &parts[1..], dtype, op);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_combine_in_order() {
        let a = [1.0f32, 5.0, -2.0];
        let b = [4.0f32, 2.0, -3.0];
        let mut out = [0u8; 12];
        let parts = [bytemuck::cast_slice(&a), bytemuck::cast_slice(&b)];
        for (op, want) in [
            (ReduceOp::Sum, [5.0, 7.0, -5.0]),
            (ReduceOp::Max, [4.0, 5.0, -2.0]),
            (ReduceOp::Min, [1.0, 2.0, -3.0]),
        ] {
            reduce_into(&mut out, &parts, DType::F32, op);
            assert_eq!(typed::<f32>(&out), want);
        }
        let x = [bf16::from_f32(1.5), bf16::from_f32(-1.0)];
        let mut out = [0u8; 4];
        reduce_into(
            &mut out,
            &[bytemuck::cast_slice(&x), bytemuck::cast_slice(&x)],
            DType::Bf16,
            ReduceOp::Sum,
        );
        assert_eq!(typed::<bf16>(&out), [bf16::from_f32(3.0), bf16::from_f32(-2.0)]);
    }
}
