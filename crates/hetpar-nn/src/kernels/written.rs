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

    /// Elements `N` at a time: those from `i` (a multiple of `N`) are `f(i)`, and the last
    /// `len % N` elements one at a time, element `i` being `one(i)`.
    #[inline(always)]
    pub(crate) fn lanes<const N: usize>(
        self,
        f: impl Fn(usize) -> [T; N],
        one: impl Fn(usize) -> T,
    ) -> Written {
        let whole = self.0.len() - self.0.len() % N;
        let (head, tail) = self.0.split_at_mut(whole);
        for (k, c) in head.chunks_exact_mut(N).enumerate() {
            for (o, v) in c.iter_mut().zip(f(k * N)) {
                o.write(v);
            }
        }
        for (i, o) in tail.iter_mut().enumerate() {
            o.write(one(whole + i));
        }
        self.done()
    }

    /// Element `i` of this part and of `other` (as long) are the two results of `f(a[i],
    /// b[i], c[i], d[i])`; all as long as the part.
    #[inline(always)]
    pub(crate) fn map4_pair<A: Copy>(
        self,
        other: Part<'_, T>,
        [a, b, c, d]: [&[A]; 4],
        f: impl Fn(A, A, A, A) -> (T, T),
    ) -> (Written, Written) {
        let n = self.0.len();
        assert!(other.0.len() == n, "two parts of a pair");
        assert!(a.len() == n && b.len() == n && c.len() == n && d.len() == n, "a part");
        for (i, (o, p)) in self.0.iter_mut().zip(other.0.iter_mut()).enumerate() {
            let (x, y) = f(a[i], b[i], c[i], d[i]);
            o.write(x);
            p.write(y);
        }
        (self.done(), other.done())
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

/// Two new vectors of `len` elements each, made together `part` at a time as [`written`]
/// makes one: `fill(start, a, b)` writes elements `start..start + a.len()` of both through
/// the [`Part`]s' methods and returns their [`Written`]s, in that order.
///
/// # Panics
/// If `fill` returns a [`Written`] of another part.
#[inline(always)]
pub(crate) fn written_pair<T>(
    len: usize,
    part: usize,
    mut fill: impl FnMut(usize, Part<'_, T>, Part<'_, T>) -> (Written, Written),
) -> (Vec<T>, Vec<T>) {
    let part = part.max(1);
    let (mut a, mut b) = (Vec::with_capacity(len), Vec::with_capacity(len));
    let parts = a.spare_capacity_mut()[..len].chunks_mut(part);
    for (i, (p, q)) in parts.zip(b.spare_capacity_mut()[..len].chunks_mut(part)).enumerate() {
        let (at, bt, n) = (p.as_ptr().cast::<()>(), q.as_ptr().cast::<()>(), p.len());
        let (Written(wa, na), Written(wb, nb)) = fill(i * part, Part(p), Part(q));
        assert!(
            wa == at && na == n && wb == bt && nb == n,
            "a part of a new vector was not written whole"
        );
    }
    // SAFETY: as in `written`, for each vector: the first `len` slots of its spare capacity
    // went to `fill` part by part, in order and without gaps (two `chunks_mut` of equal
    // lengths), and `fill` returned the `Written` of that very part (address and length
    // checked) for each, which only a `Part` method makes after writing all of it.
    unsafe {
        a.set_len(len);
        b.set_len(len);
    }
    (a, b)
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::{Part, written, written_pair};

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
    fn pairs_are_written_whole_in_order() {
        let x: Vec<f64> = (0..11).map(f64::from).collect();
        let (s, d) = written_pair(11, 4, |start, a, b| {
            let x = &x[start..start + a.len()];
            a.map4_pair(b, [x, x, x, x], |p, q, r, t| (p + q, r * t))
        });
        assert_eq!(s, x.iter().map(|v| 2.0 * v).collect::<Vec<_>>());
        assert_eq!(d, x.iter().map(|v| v * v).collect::<Vec<_>>());
        let (e, f): (Vec<f32>, Vec<f32>) =
            written_pair(0, 3, |_, a, b| a.map4_pair(b, [&[]; 4], |p, _, _, _| (p, p)));
        assert!(e.is_empty() && f.is_empty());
    }

    #[test]
    #[should_panic(expected = "not written whole")]
    fn a_pair_with_its_parts_swapped_is_refused() {
        let x = [1.0f32; 4];
        // `b`'s proof first, `a`'s second.
        let _ = written_pair(4, 4, |_, a, b| b.map4_pair(a, [&x, &x, &x, &x], |p, _, _, _| (p, p)));
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
