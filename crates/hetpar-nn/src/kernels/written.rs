//! New vectors written once, with no zero fill first.
//!
//! An element-wise kernel that returns `vec![0; n]` after writing every element of it
//! passes over its output twice: the allocator's zero fill (a `memset` of the whole output,
//! megabytes that leave the cache), then the kernel's own writes. Under `perf` those fills
//! were 2-3% of a layer's step (BENCHMARKS.md), and filling a scratch part in cache and
//! appending it costs as much as the fill saves. [`written`] hands a kernel the vector's
//! uninitialized memory a part at a time as a [`Part`], which only its own methods can
//! write, each writing every element of the part; they return a [`Written`] naming the
//! part, which [`written`] checks before it moves on. Nothing outside this module sees
//! uninitialized memory, and a part that was not written whole stops the program rather
//! than reach the vector.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

/// Elements an element-wise kernel makes at a time where no row sets the part (its scratch
/// inputs, such as exponentials, sit in a stack array of this many: 4 KiB of f32, in the
/// L1 cache): per part, the kernel's loop runs long enough that slicing and checks cost
/// nothing worth counting.
pub(crate) const PART: usize = 1024;

/// A part of a new vector, not written yet: its methods write every element of it.
pub(crate) struct Part<'a, T>(&'a mut [MaybeUninit<T>]);

/// The proof that one [`Part`] was written whole: the part's address and length. Only
/// [`Part`]'s methods make one.
pub(crate) struct Written(*const (), usize);

impl<T> Part<'_, T> {
    /// The part's length.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    #[inline(always)]
    fn done(self) -> Written {
        Written(self.0.as_ptr().cast(), self.0.len())
    }

    /// Element `i` is `f(a[i])`; `a` is as long as the part.
    #[inline(always)]
    pub(crate) fn map<A: Copy>(self, a: &[A], f: impl Fn(A) -> T) -> Written {
        assert_eq!(a.len(), self.0.len(), "a part and its input");
        for (o, &x) in self.0.iter_mut().zip(a) {
            o.write(f(x));
        }
        self.done()
    }

    /// Element `i` is `f(a[i], b[i])`; both as long as the part.
    #[inline(always)]
    pub(crate) fn map2<A: Copy, B: Copy>(self, a: &[A], b: &[B], f: impl Fn(A, B) -> T) -> Written {
        assert!(a.len() == self.0.len() && b.len() == self.0.len(), "a part and its inputs");
        for ((o, &x), &y) in self.0.iter_mut().zip(a).zip(b) {
            o.write(f(x, y));
        }
        self.done()
    }

    /// Element `i` is `f(a[i], b[i], c[i])`; all as long as the part.
    #[inline(always)]
    pub(crate) fn map3<A: Copy, B: Copy, C: Copy>(
        self,
        a: &[A],
        b: &[B],
        c: &[C],
        f: impl Fn(A, B, C) -> T,
    ) -> Written {
        let n = self.0.len();
        assert!(a.len() == n && b.len() == n && c.len() == n, "a part and its inputs");
        for (((o, &x), &y), &z) in self.0.iter_mut().zip(a).zip(b).zip(c) {
            o.write(f(x, y, z));
        }
        self.done()
    }

    /// Element `i` is `f(a[i], b[i], c[i], d[i])`; all as long as the part.
    #[inline(always)]
    pub(crate) fn map4<A: Copy>(
        self,
        [a, b, c, d]: [&[A]; 4],
        f: impl Fn(A, A, A, A) -> T,
    ) -> Written {
        let n = self.0.len();
        assert!(a.len() == n && b.len() == n && c.len() == n && d.len() == n, "a part");
        for ((((o, &w), &x), &y), &z) in self.0.iter_mut().zip(a).zip(b).zip(c).zip(d) {
            o.write(f(w, x, y, z));
        }
        self.done()
    }
}

/// A new vector of `len` elements, made `part` at a time (a row, say; the last part may be
/// shorter): `fill(start, part)` writes elements `start..start + part.len()` through the
/// [`Part`]'s methods and returns their [`Written`]. Pass `fill` as an `#[inline(always)]`
/// closure: inside [`super::simd::fast!`] an out-of-line one runs on the baseline target.
///
/// # Panics
/// If `fill` returns a [`Written`] of another part (it cannot have written this one).
#[inline(always)]
pub(crate) fn written<T>(
    len: usize,
    part: usize,
    mut fill: impl FnMut(usize, Part<'_, T>) -> Written,
) -> Vec<T> {
    let part = part.max(1);
    let mut out = Vec::with_capacity(len);
    for (i, p) in out.spare_capacity_mut()[..len].chunks_mut(part).enumerate() {
        let (at, n) = (p.as_ptr().cast::<()>(), p.len());
        let Written(wrote, wn) = fill(i * part, Part(p));
        assert!(wrote == at && wn == n, "a part of a new vector was not written whole");
    }
    // SAFETY: the first `len` slots of the (empty) vector's spare capacity were handed to
    // `fill` part by part, in order and without gaps (`chunks_mut`), and for each part
    // `fill` returned the `Written` of that very part (address and length checked), which
    // only a `Part` method makes, after writing every element of its part. So all `len`
    // elements are initialized.
    unsafe { out.set_len(len) };
    out
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::{Part, written};

    #[test]
    fn parts_are_written_whole_in_order() {
        let x: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let y = written(10, 4, |start, part| {
            let n = part.len();
            part.map(&x[start..start + n], |v| 2.0 * v)
        });
        assert_eq!(y, x.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        let none: Vec<f64> = written(0, 3, |_, part| part.map(&[], |v: f64| v));
        assert!(none.is_empty());
    }

    #[test]
    #[should_panic(expected = "not written whole")]
    fn the_proof_of_another_part_is_refused() {
        let mut other = [MaybeUninit::<f32>::uninit(); 4];
        let _: Vec<f32> = written(4, 4, |_, _unwritten| Part(&mut other).map(&[1.0; 4], |v| v));
    }

    #[test]
    #[should_panic(expected = "a part and its input")]
    fn a_short_input_is_refused() {
        let _ = written(4, 4, |_, part| part.map(&[1.0f32; 3], |v| v));
    }
}
