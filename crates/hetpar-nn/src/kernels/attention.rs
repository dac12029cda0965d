//! Attention over blocks with an online softmax (Milakov and Gimelshein 2018; the tiling of
//! FlashAttention-2, Dao 2023), forward and backward, on the CPU.
//!
//! Queries `[b, s_q, heads, d]`, keys and values `[b, s_k, kv_heads, d]` (grouped-query:
//! each key/value head serves `heads / kv_heads` query heads, read in place, never
//! repeated), output `[b, s_q, heads, d]`: the layouts the projections produce and consume,
//! so no transpose or copy sits around the kernel. Masks come from global positions
//! (`k_pos <= q_pos` under the causal mask), so context-parallel ranks pass their zigzag
//! positions; a block of keys all after its queries is skipped, one all before them runs
//! unmasked, and only blocks on the diagonal test elements. Each block pair (`64 x 64`
//! under the causal mask; without it, a sequence of up to 256 rows is one block) is a gemm
//! into a buffer, exponentiated, and multiplied into the output; the backward recomputes it
//! from the log-sum-exp kept per row. The one exception is a sequence that is a single block
//! each way (no mask, 256 rows or fewer, no log-sum-exp output: a short encoder's): the
//! forward keeps its probabilities, at most `256 x 256` a head, and the backward reads them,
//! which spares it one of its five products and an exponential per score.
//!
//! With `with_lse` the output gains a last column, the row's log-sum-exp (`-inf` for a row
//! that sees no key), whose gradient the backward takes too: ring attention merges the
//! blocks of several calls through it.
//!
//! A key head whose blocks serve several products (the query heads that share it, several
//! blocks of queries) is transposed once for the products that take it as `k^T` (the
//! scores, and the values' for `dO v^T`), where gemm would gather each block's transpose
//! as it packs it: the same bits, the causal cores of `bench nn` 6-8% faster.
//!
//! Under `dtype = "bf16"` ([`FlashAttention::with_matmul`]) the block products multiply
//! bf16-rounded operands and sum in f32 on the bf16 kernels ([`super::bf16`], AMX tiles
//! where the CPU has them), as the linear layers do; everything between them stays f32,
//! the softmax's exponentials evaluated in f32 ([`super::exp_f32_fast`]) rather than
//! rounded from f64.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Error, Layout, Shape, Tensor};

use super::gemm::{View, layout_keeps_bits, matmul};
use super::linear::Matmul;
use super::{CResult, Real, by_real, by_real_dtype, dot, max, simd, slice, sum, with_data};

/// Rows (queries or keys) per block under a causal mask, and beyond [`WHOLE`] rows.
const BLOCK: usize = 64;
/// Without a causal mask, a sequence of up to this many rows is one block: nothing is
/// skipped there, and one product over the whole sequence runs faster than many small
/// ones with the online softmax's rescaling between them. Such a block's probabilities are
/// kept for the backward ([`FlashAttention::keeps_probabilities`]).
pub const WHOLE: usize = 256;

/// Rows per block for `n` rows.
fn block_len(n: usize, causal: bool) -> usize {
    if !causal && n <= WHOLE { n.max(1) } else { BLOCK }
}

/// `softmax(scale * q k^T + mask) v` over the positions given.
#[derive(Debug)]
pub struct FlashAttention {
    q_pos: Arc<Vec<usize>>,
    k_pos: Arc<Vec<usize>>,
    causal: bool,
    scale: f64,
    with_lse: bool,
    /// Log-sum-exp per `[b, heads, s_q]` row, from the forward.
    lse: Mutex<Vec<f64>>,
    /// The probabilities of every `[b, heads]` block, `[s_q, s_k]` each, from the forward
    /// where [`Self::keeps_probabilities`] holds: the backward reads them instead of
    /// computing them again. Kept, like the log-sum-exps, as long as the op.
    probs: Mutex<Option<Tensor>>,
    /// How the block products multiply (the forward's two, the backward's four and its
    /// recomputed scores): under [`Matmul::Bf16`] (`dtype = "bf16"`, f32 tensors only)
    /// their operands round to bf16 and the sums stay f32, as in the linear layers; the
    /// scores, the softmax and the gradients between the products stay f32, the softmax's
    /// exponentials evaluated in f32 ([`Real::exp_in_place_as`]).
    how: Matmul,
    /// Whether a key (and value) head that serves more than one block product is
    /// transposed once for them ([`transposed_keys`]; gemm's products only); the same bits
    /// either way.
    transpose_keys: bool,
}

impl FlashAttention {
    /// Queries at `q_pos`, keys at `k_pos` (global positions, used by the causal mask only).
    pub fn new(
        q_pos: Arc<Vec<usize>>,
        k_pos: Arc<Vec<usize>>,
        causal: bool,
        scale: f64,
        with_lse: bool,
    ) -> Self {
        FlashAttention {
            q_pos,
            k_pos,
            causal,
            scale,
            with_lse,
            lse: Mutex::new(Vec::new()),
            probs: Mutex::new(None),
            how: Matmul::Native,
            transpose_keys: true,
        }
    }

    /// The same op with its products multiplying as `how` says (the layer's own
    /// [`Matmul`], so that its attention core rounds as its projections do).
    pub fn with_matmul(self, how: Matmul) -> Self {
        FlashAttention { how, ..self }
    }

    /// The same op with every key block read through a transposed view (the tests hold the
    /// transposed heads to it).
    #[cfg(test)]
    fn with_key_views(self) -> Self {
        FlashAttention { transpose_keys: false, ..self }
    }

    /// One block product, `dst = (dst if acc else 0) + beta * lhs @ rhs`, on one thread:
    /// gemm's kernels in `T`, or bf16 operands summed in f32 ([`super::bf16`]; AMX tiles
    /// where the CPU has them). An error under bf16 with f64 tensors.
    #[inline(always)]
    fn product<T: Real>(
        &self,
        dst: &mut [T],
        dv: View,
        (lhs, lv): (&[T], View),
        (rhs, rv): (&[T], View),
        acc: bool,
        beta: T,
    ) -> CResult<()> {
        match self.how {
            Matmul::Native => {
                matmul(dst, dv, lhs, lv, rhs, rv, acc, beta);
                Ok(())
            }
            Matmul::Bf16 => T::bf16_product_into(dst, dv, lhs, lv, rhs, rv, acc, beta),
        }
    }

    /// Applies the op: `q` `[b, s_q, heads, d]`, `k`, `v` `[b, s_k, kv_heads, d]`.
    pub fn apply(self, q: &Tensor, k: &Tensor, v: &Tensor) -> CResult<Tensor> {
        q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, self)
    }

    pub(crate) fn dims(&self, q: &Shape, k: &Shape, v: &Shape) -> CResult<Dims> {
        let (b, sq, hq, d) = q.dims4()?;
        let (kb, sk, hkv, kd) = k.dims4()?;
        if (kb, kd) != (b, d) || k != v || hkv == 0 || hq % hkv != 0 {
            return Err(Error::Msg(format!(
                "attention: queries {q:?} and keys/values {k:?} / {v:?} do not fit"
            )));
        }
        if self.q_pos.len() != sq || self.k_pos.len() != sk {
            return Err(Error::Msg(format!(
                "attention: {} query and {} key positions for {sq} queries and {sk} keys",
                self.q_pos.len(),
                self.k_pos.len()
            )));
        }
        Ok(Dims { b, sq, sk, hq, hkv, d, od: d + usize::from(self.with_lse) })
    }

    /// Whether the forward keeps the probabilities for the backward: without a mask or a
    /// log-sum-exp output, where `s_q` queries and `s_k` keys are one block each ([`WHOLE`]
    /// rows or fewer). There the backward's recomputation is one of its five products per
    /// head and an exponential per score, while the probabilities, `s_q x s_k` per head,
    /// hold at most `s / (15 d)` of what a transformer layer keeps besides (some fifteen
    /// hidden widths per position): a quarter at 256 positions and `d` 64. Longer
    /// sequences, causal ones and ring attention's calls recompute, as FlashAttention does.
    pub fn keeps_probabilities(causal: bool, with_lse: bool, s_q: usize, s_k: usize) -> bool {
        !causal && !with_lse && s_q <= WHOLE && s_k <= WHOLE
    }

    fn keeps_probs(&self, dm: &Dims) -> bool {
        Self::keeps_probabilities(self.causal, self.with_lse, dm.sq, dm.sk)
    }

    /// How many probabilities the last forward kept (0 where it kept none).
    pub fn kept_probabilities(&self) -> usize {
        let kept = self.probs.lock().unwrap_or_else(|e| e.into_inner());
        kept.as_ref().map_or(0, Tensor::elem_count)
    }

    fn stored_lse(&self) -> Vec<f64> {
        self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    b: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    /// Output row width: `d`, plus one with the log-sum-exp.
    od: usize,
}

/// A block of consecutive rows and the range of their positions.
#[derive(Clone, Copy, Debug)]
struct Block {
    start: usize,
    len: usize,
    min: usize,
    max: usize,
}

fn blocks(pos: &[usize], size: usize) -> Vec<Block> {
    (0..pos.len())
        .step_by(size)
        .map(|start| {
            let p = &pos[start..(start + size).min(pos.len())];
            Block {
                start,
                len: p.len(),
                min: *p.iter().min().expect("non-empty"),
                max: *p.iter().max().expect("non-empty"),
            }
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Visible {
    None,
    Some,
    All,
}

fn visible(causal: bool, q: &Block, k: &Block) -> Visible {
    if !causal || k.max <= q.min {
        Visible::All
    } else if k.min > q.max {
        Visible::None
    } else {
        Visible::Some
    }
}

/// Sets the masked scores of a diagonal block (rows `bk` apart) to `-inf`: those of keys
/// after the query. Where the block's key positions ascend (always without context
/// parallelism, and within each chunk of the load-balanced split), a row's masked keys
/// are the block's keys after the first one past the query: one fill per row.
fn mask<T: Real>(s: &mut [T], bk: usize, q_pos: &[usize], k_pos: &[usize]) {
    let ascending = k_pos.windows(2).all(|w| w[0] <= w[1]);
    for (i, &qp) in q_pos.iter().enumerate() {
        let row = &mut s[i * bk..i * bk + k_pos.len()];
        if ascending {
            row[k_pos.partition_point(|&kp| kp <= qp)..].fill(T::NEG_INF);
        } else {
            for (e, &kp) in row.iter_mut().zip(k_pos) {
                if kp > qp {
                    *e = T::NEG_INF;
                }
            }
        }
    }
}

/// The views of a block pair's scores (rows `bk` apart, from 0), queries and keys.
fn views(bk: usize, x: &Bases, d: usize, qb: &Block, kb: &Block) -> (View, View, View) {
    let sv = View::rows(0, qb.len, kb.len, bk);
    let qv = View::rows(x.q + qb.start * x.qrs, qb.len, d, x.qrs);
    let kv = View::rows(x.k + kb.start * x.krs, kb.len, d, x.krs);
    (sv, qv, kv)
}

/// A key or value head `[s_k, d]` (rows `rs` apart from `base`) transposed into `dst`
/// (`[d, s_k]`, row-major), 16 rows at a time.
#[inline(always)]
fn transpose_head<T: Real>(
    dst: &mut [T],
    src: &[T],
    base: usize,
    (sk, d, rs): (usize, usize, usize),
) {
    for r0 in (0..sk).step_by(16) {
        let r1 = (r0 + 16).min(sk);
        for c in 0..d {
            let out = &mut dst[c * sk + r0..c * sk + r1];
            for (r, o) in (r0..r1).zip(out.iter_mut()) {
                *o = src[base + r * rs + c];
            }
        }
    }
}

/// Room for one key (or value) head's transpose where its blocks serve more than one
/// product: the query heads that share it (grouped-query) times the blocks of queries.
/// gemm gathers a transposed right operand element by element as it packs it (a block of
/// scores against `k^T` ran at 135 GFLOP/s, against the transpose made once at 180, with
/// the same bits); made once per head, the transpose pays for itself from the second use.
/// Not under bf16 products, whose packing transposes in registers already (there the
/// transpose made the causal cores 3-4% slower).
fn transposed_keys<T: Real>(dm: &Dims, query_blocks: usize, fa: &FlashAttention) -> Option<Vec<T>> {
    let worth = fa.transpose_keys && fa.how == Matmul::Native;
    (worth && (dm.hq / dm.hkv) * query_blocks > 1).then(|| vec![T::ZERO; dm.d * dm.sk])
}

/// A block of keys (or values) as the right operand `k^T` of a product with `rows` rows of
/// queries: from the head's transpose `[d, s_k]` where one was made ([`transpose_head`]:
/// the `d` columns of the block are then rows), else as a transposed view of `k` itself,
/// which small products keep ([`layout_keeps_bits`]: gemm sums those on kernels of their
/// own, whose bits the transpose would change).
#[inline(always)]
fn keys_t<'a, T>(
    k: &'a [T],
    kv: View,
    kt: Option<&'a [T]>,
    (rows, kb): (usize, &Block),
    sk: usize,
) -> (&'a [T], View) {
    match kt {
        Some(kt) if layout_keeps_bits(rows, kb.len, kv.cols) => {
            (kt, View::rows(kb.start, kv.cols, kb.len, sk))
        }
        _ => (k, kv.t()),
    }
}

/// Where head `h` of batch row `bi` starts in each tensor, and the row strides.
#[derive(Clone, Copy)]
struct Bases {
    q: usize,
    k: usize,
    o: usize,
    qrs: usize,
    krs: usize,
    ors: usize,
}

impl Dims {
    fn bases(&self, bi: usize, h: usize) -> Bases {
        let g = h / (self.hq / self.hkv);
        let (qrs, krs, ors) = (self.hq * self.d, self.hkv * self.d, self.hq * self.od);
        Bases {
            q: bi * self.sq * qrs + h * self.d,
            k: bi * self.sk * krs + g * self.d,
            o: bi * self.sq * ors + h * self.od,
            qrs,
            krs,
            ors,
        }
    }
}

impl FlashAttention {
    /// `scale * q k^T` of one block pair into `s` (rows `bk` apart), masked where needed.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn scores<T: Real>(
        &self,
        s: &mut [T],
        bk: usize,
        q: &[T],
        (k, kt, sk): (&[T], Option<&[T]>, usize),
        x: &Bases,
        d: usize,
        qb: &Block,
        kb: &Block,
        vis: Visible,
    ) -> CResult<(View, View, View)> {
        let (sv, qv, kv) = views(bk, x, d, qb, kb);
        let scale = T::from_f64(self.scale);
        self.product(s, sv, (q, qv), keys_t(k, kv, kt, (qb.len, kb), sk), false, scale)?;
        if vis == Visible::Some {
            mask(
                s,
                bk,
                &self.q_pos[qb.start..qb.start + qb.len],
                &self.k_pos[kb.start..kb.start + kb.len],
            );
        }
        Ok((sv, qv, kv))
    }

    /// The output `[b, s_q, heads, od]` and each row's log-sum-exp, on contiguous slices.
    #[inline(always)]
    pub(crate) fn forward<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        dm: Dims,
    ) -> CResult<(Vec<T>, Vec<f64>)> {
        let d = dm.d;
        let mut out = vec![T::ZERO; dm.b * dm.sq * dm.hq * dm.od];
        let mut lse = vec![f64::NEG_INFINITY; dm.b * dm.hq * dm.sq];
        let (bq, bk) = (block_len(dm.sq, self.causal), block_len(dm.sk, self.causal));
        let (qbl, kbl) = (blocks(&self.q_pos, bq), blocks(&self.k_pos, bk));
        let mut s = vec![T::ZERO; bq * bk];
        let (mut m, mut l) = (vec![T::NEG_INF; bq], vec![T::ZERO; bq]);
        // One block each way: each row's scores are all in `s` after its only pass.
        let keep = self.keeps_probs(&dm);
        let mut probs = Vec::with_capacity(if keep { dm.b * dm.hq * dm.sq * dm.sk } else { 0 });
        let mut kt = transposed_keys(&dm, qbl.len(), self);
        for bi in 0..dm.b {
            for h in 0..dm.hq {
                let x = dm.bases(bi, h);
                if let Some(kt) = kt.as_deref_mut().filter(|_| h % (dm.hq / dm.hkv) == 0) {
                    transpose_head(kt, k, x.k, (dm.sk, d, x.krs));
                }
                for qb in &qbl {
                    let rows = qb.len;
                    m[..rows].fill(T::NEG_INF);
                    l[..rows].fill(T::ZERO);
                    let ov = View::rows(x.o + qb.start * x.ors, rows, d, x.ors);
                    for kb in &kbl {
                        let vis = visible(self.causal, qb, kb);
                        if vis == Visible::None {
                            continue;
                        }
                        let keys = (k, kt.as_deref(), dm.sk);
                        let (sv, _, kv) = self.scores(&mut s, bk, q, keys, &x, d, qb, kb, vis)?;
                        for i in 0..rows {
                            let row = &mut s[i * bk..i * bk + kb.len];
                            let top = max(row);
                            let m_new = m[i].larger(top);
                            if m_new == T::NEG_INF {
                                row.fill(T::ZERO);
                                continue;
                            }
                            row.iter_mut().for_each(|e| *e -= m_new);
                            T::exp_in_place_as(row, self.how);
                            let row_sum = sum(row);
                            if m[i] != m_new {
                                let alpha = (m[i] - m_new).exp();
                                l[i] *= alpha;
                                let o = ov.offset + i * x.ors;
                                out[o..o + d].iter_mut().for_each(|e| *e *= alpha);
                                m[i] = m_new;
                            }
                            l[i] += row_sum;
                        }
                        self.product(&mut out, ov, (&s, sv), (v, kv), true, T::ONE)?;
                    }
                    for i in 0..rows {
                        let o = ov.offset + i * x.ors;
                        let row_lse = if l[i] > T::ZERO {
                            let inv = T::ONE / l[i];
                            out[o..o + d].iter_mut().for_each(|e| *e *= inv);
                            if keep {
                                probs.extend(s[i * bk..i * bk + dm.sk].iter().map(|&e| e * inv));
                            }
                            m[i].to_f64() + l[i].to_f64().ln()
                        } else {
                            if keep {
                                probs.extend(std::iter::repeat_n(T::ZERO, dm.sk));
                            }
                            f64::NEG_INFINITY
                        };
                        lse[(bi * dm.hq + h) * dm.sq + qb.start + i] = row_lse;
                        if self.with_lse {
                            out[o + d] = T::from_f64(row_lse);
                        }
                    }
                }
            }
        }
        let kept = keep.then(|| {
            let n = probs.len();
            Tensor::from_vec(probs, n, &candle_core::Device::Cpu).expect("a vector of its length")
        });
        *self.probs.lock().unwrap_or_else(|e| e.into_inner()) = kept;
        Ok((out, lse))
    }

    /// `dq`, `dk`, `dv` from the forward's output `o`, its gradient `go` and `lse`, and
    /// the probabilities the forward kept where it kept them.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn backward<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        o: &[T],
        go: &[T],
        lse: &[f64],
        dm: Dims,
    ) -> CResult<(Vec<T>, Vec<T>, Vec<T>)> {
        let kept = self.probs.lock().unwrap_or_else(|e| e.into_inner());
        match kept.as_ref().filter(|_| self.keeps_probs(&dm)) {
            None => self.backward_with(q, k, v, o, go, lse, dm, None),
            Some(p) => with_data::<T, _>(p, "attention backward", |p| {
                let want = dm.b * dm.hq * dm.sq * dm.sk;
                if p.len() != want {
                    return Err(Error::Msg(format!(
                        "attention backward: {} kept probabilities for {want}",
                        p.len()
                    )));
                }
                self.backward_with(q, k, v, o, go, lse, dm, Some(p))
            }),
        }
    }

    /// [`Self::backward`] given the kept probabilities (`[b, heads, s_q, s_k]`), or none to
    /// recompute them.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn backward_with<T: Real>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        o: &[T],
        go: &[T],
        lse: &[f64],
        dm: Dims,
        kept: Option<&[T]>,
    ) -> CResult<(Vec<T>, Vec<T>, Vec<T>)> {
        let d = dm.d;
        let mut dq = vec![T::ZERO; q.len()];
        let mut dk = vec![T::ZERO; k.len()];
        let mut dv = vec![T::ZERO; v.len()];
        let (bq, bk) = (block_len(dm.sq, self.causal), block_len(dm.sk, self.causal));
        let (qbl, kbl) = (blocks(&self.q_pos, bq), blocks(&self.k_pos, bk));
        let (mut s, mut dp) = (vec![T::ZERO; bq * bk], vec![T::ZERO; bq * bk]);
        let (mut delta, mut row_lse) = (vec![T::ZERO; bq], vec![T::ZERO; bq]);
        let scale = T::from_f64(self.scale);
        // Scores are recomputed only without kept probabilities.
        let mut kt = transposed_keys(&dm, qbl.len(), self).filter(|_| kept.is_none());
        let mut vt = transposed_keys(&dm, qbl.len(), self);
        for bi in 0..dm.b {
            for h in 0..dm.hq {
                let x = dm.bases(bi, h);
                if h % (dm.hq / dm.hkv) == 0 {
                    if let Some(kt) = kt.as_deref_mut() {
                        transpose_head(kt, k, x.k, (dm.sk, d, x.krs));
                    }
                    if let Some(vt) = vt.as_deref_mut() {
                        transpose_head(vt, v, x.k, (dm.sk, d, x.krs));
                    }
                }
                for qb in &qbl {
                    let rows = qb.len;
                    let gv = View::rows(x.o + qb.start * x.ors, rows, d, x.ors);
                    for i in 0..rows {
                        let r = gv.offset + i * x.ors;
                        let go_o = dot(&go[r..r + d], &o[r..r + d]);
                        // With the log-sum-exp an output, its gradient joins the softmax's.
                        delta[i] = if self.with_lse { go_o - go[r + d] } else { go_o };
                        row_lse[i] = T::from_f64(lse[(bi * dm.hq + h) * dm.sq + qb.start + i]);
                    }
                    for kb in &kbl {
                        let vis = visible(self.causal, qb, kb);
                        if vis == Visible::None {
                            continue;
                        }
                        let (sv, qv, kv, p, pv) = match kept {
                            Some(p) => {
                                // The only block pair: the kept `[s_q, s_k]` of this head.
                                let (sv, qv, kv) = views(bk, &x, d, qb, kb);
                                let at = (bi * dm.hq + h) * dm.sq * dm.sk;
                                (sv, qv, kv, p, View { offset: at, ..sv })
                            }
                            None => {
                                let keys = (k, kt.as_deref(), dm.sk);
                                let (sv, qv, kv) =
                                    self.scores(&mut s, bk, q, keys, &x, d, qb, kb, vis)?;
                                for i in 0..rows {
                                    let row = &mut s[i * bk..i * bk + kb.len];
                                    if row_lse[i] == T::NEG_INF {
                                        row.fill(T::ZERO);
                                    } else {
                                        row.iter_mut().for_each(|e| *e -= row_lse[i]);
                                        T::exp_in_place_as(row, self.how);
                                    }
                                }
                                (sv, qv, kv, s.as_slice(), sv)
                            }
                        };
                        // p (through pv) holds the probabilities P.
                        self.product(&mut dv, kv, (p, pv.t()), (go, gv), true, T::ONE)?;
                        let values = keys_t(v, kv, vt.as_deref(), (rows, kb), dm.sk);
                        self.product(&mut dp, sv, (go, gv), values, false, T::ONE)?;
                        let p = &p[pv.offset..pv.offset + rows * bk];
                        for ((dr, pr), &di) in
                            dp.chunks_exact_mut(bk).zip(p.chunks_exact(bk)).zip(&delta[..rows])
                        {
                            for (g, &p) in dr[..kb.len].iter_mut().zip(&pr[..kb.len]) {
                                *g = p * (*g - di);
                            }
                        }
                        self.product(&mut dq, qv, (&dp, sv), (k, kv), true, scale)?;
                        self.product(&mut dk, kv, (&dp, sv.t()), (q, qv), true, scale)?;
                    }
                }
            }
        }
        Ok((dq, dk, dv))
    }
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
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
        let dm = self.dims(l1.shape(), l2.shape(), l3.shape())?;
        by_real!(s1, "attention", |T| {
            let (q, k, v) = (
                slice::<T>(s1, l1, "attention")?,
                slice::<T>(s2, l2, "attention")?,
                slice::<T>(s3, l3, "attention")?,
            );
            let (out, lse) = simd::fast!(self.forward(q, k, v, dm))?;
            *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
            Ok((
                <T as candle_core::WithDType>::to_cpu_storage_owned(out),
                Shape::from((dm.b, dm.sq, dm.hq, dm.od)),
            ))
        })
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dm = self.dims(q.shape(), k.shape(), v.shape())?;
        let lse = self.stored_lse();
        let grad = grad.contiguous()?;
        let (dq, dk, dv) = by_real_dtype!(q.dtype(), "attention", |T| self
            .grads::<T>(q, k, v, res, &grad, &lse, dm))?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

impl FlashAttention {
    #[allow(clippy::too_many_arguments)]
    fn grads<T: Real>(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
        lse: &[f64],
        dm: Dims,
    ) -> CResult<(Tensor, Tensor, Tensor)> {
        let op = "attention backward";
        let (dq, dk, dv) = with_data::<T, _>(q, op, |qd| {
            with_data::<T, _>(k, op, |kd| {
                with_data::<T, _>(v, op, |vd| {
                    with_data::<T, _>(res, op, |od| {
                        with_data::<T, _>(grad, op, |gd| {
                            simd::fast!(self.backward(qd, kd, vd, od, gd, lse, dm))
                        })
                    })
                })
            })
        })?;
        let dev = q.device();
        Ok((
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            Tensor::from_vec(dv, v.shape(), dev)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Rows of pseudo-random values in `[-1, 1)`.
    fn values(n: usize, seed: u64) -> Vec<f64> {
        (0..n as u64)
            .map(|i| ((i * 2_654_435_761 + seed * 97) % 1000) as f64 / 500.0 - 1.0)
            .collect()
    }

    /// One block each way without a mask: the forward keeps every head's probabilities and
    /// the backward that reads them gives what recomputing them gives, to rounding; a causal
    /// or longer sequence keeps none.
    #[test]
    fn a_single_block_keeps_its_probabilities_and_the_backward_reads_them() {
        let (b, sq, sk, hq, hkv, d) = (2, 30, 45, 4, 2, 8);
        let (q, k, v) =
            (values(b * sq * hq * d, 1), values(b * sk * hkv * d, 2), values(b * sk * hkv * d, 3));
        let go = values(b * sq * hq * d, 4);
        let fa = FlashAttention::new(
            Arc::new((0..sq).collect()),
            Arc::new((0..sk).collect()),
            false,
            0.3,
            false,
        );
        let dm = Dims { b, sq, sk, hq, hkv, d, od: d };
        let (o, lse) = fa.forward(&q, &k, &v, dm).unwrap();
        assert_eq!(fa.kept_probabilities(), b * hq * sq * sk);
        let kept = fa.backward(&q, &k, &v, &o, &go, &lse, dm).unwrap();
        let again = fa.backward_with(&q, &k, &v, &o, &go, &lse, dm, None).unwrap();
        for (x, y) in [(&kept.0, &again.0), (&kept.1, &again.1), (&kept.2, &again.2)] {
            let top = y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let err = x.iter().zip(y).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= 1e-12 * top, "kept against recomputed: {err:e} of {top:e}");
        }
        let causal = FlashAttention::new(
            Arc::new((0..sq).collect()),
            Arc::new((0..sk).collect()),
            true,
            0.3,
            false,
        );
        causal.forward(&q, &k, &v, dm).unwrap();
        assert_eq!(causal.kept_probabilities(), 0);
        let long = 300;
        let (q2, k2) = (values(long * d, 5), values(long * d, 6));
        let fa2 = FlashAttention::new(
            Arc::new((0..long).collect()),
            Arc::new((0..long).collect()),
            false,
            0.3,
            false,
        );
        let dm2 = Dims { b: 1, sq: long, sk: long, hq: 1, hkv: 1, d, od: d };
        fa2.forward(&q2, &k2, &k2, dm2).unwrap();
        assert_eq!(fa2.kept_probabilities(), 0);
    }

    /// Key and value heads transposed once for their block products give the bits of the
    /// transposed views, forward and backward, f32 and f64, grouped-query heads and several
    /// query blocks (causal and not; with the log-sum-exp output too), blocks of every size
    /// included: 66 rows leave a causal block pair of 2 x 64 and one of 2 x 2, and 16 rows
    /// one of 16 x 16, products of at most 256 outputs, which gemm sums on other kernels.
    #[test]
    fn transposed_key_heads_give_the_bits_of_transposed_views() {
        fn run<T: Real>(s: usize, causal: bool, with_lse: bool) {
            let (b, hq, hkv, d) = (2, 4, 2, 16);
            let t = |v: Vec<f64>| v.into_iter().map(T::from_f64).collect::<Vec<T>>();
            let (q, k, v) = (
                t(values(b * s * hq * d, 1)),
                t(values(b * s * hkv * d, 2)),
                t(values(b * s * hkv * d, 3)),
            );
            let od = d + usize::from(with_lse);
            let go = t(values(b * s * hq * od, 4));
            let dm = Dims { b, sq: s, sk: s, hq, hkv, d, od };
            let op = || {
                let pos = Arc::new((0..s).collect::<Vec<_>>());
                FlashAttention::new(pos.clone(), pos, causal, 0.3, with_lse)
            };
            let grads = |fa: FlashAttention| {
                let (o, lse) = fa.forward(&q, &k, &v, dm).unwrap();
                let (dq, dk, dv) = fa.backward(&q, &k, &v, &o, &go, &lse, dm).unwrap();
                let bits = |x: &[T]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
                [bits(&o), bits(&dq), bits(&dk), bits(&dv)]
            };
            let (fa, views) = (op(), op().with_key_views());
            assert!(transposed_keys::<T>(&dm, 1, &fa).is_some());
            assert_eq!(grads(fa), grads(views), "{s} rows, causal {causal}, with_lse {with_lse}");
        }
        for s in [150, 66, 16] {
            for (causal, with_lse) in [(true, false), (false, false), (true, true)] {
                run::<f32>(s, causal, with_lse);
                run::<f64>(s, causal, with_lse);
            }
        }
    }
}
