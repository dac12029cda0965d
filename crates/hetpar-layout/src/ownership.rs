//! Which rank owns which row: load-balanced CP and SP over the LLM sequence (destination
//! side), and the token split of an encoder's sequence-sharded output (source side).
//!
//! Destination (SEMANTICS.md section 4, EXAMPLES.md case 2): with `cp > 1` a sequence of
//! `seq_len` positions is cut into `2*cp` chunks; CP rank `i` owns chunks `i` and
//! `2*cp-1-i`, in that order. With sequence parallelism the rank's positions, in local
//! order, are cut again into `tp` equal parts. Since `i < 2*cp-1-i`, local order is
//! ascending position order.
//!
//! Source: an encoder processes each item (an image, a clip) as its own bidirectional
//! sequence, so no load balancing is needed: an item of `L` rows is cut into `cp`
//! contiguous, balanced parts (part `j` starts at `floor(j*L/cp)`), and under sequence
//! parallelism each part again into `tp` parts the same way.

use std::ops::Range;

use crate::layout::ModuleLayout;

/// The CP/SP split of a destination module's sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSplit {
    seq_len: usize,
    cp: usize,
    sp_tp: usize,
}

impl SeqSplit {
    /// The split of a `seq_len` sequence under `layout` (its `cp`, and its `tp` if `sp`).
    /// Panics unless `2*cp` (when `cp > 1`) and the SP parts divide evenly: config validation
    /// guarantees both.
    pub fn new(seq_len: usize, layout: &ModuleLayout) -> SeqSplit {
        let cp = layout.cp();
        let sp_tp = if layout.sp() { layout.tp() } else { 1 };
        assert!(cp == 1 || seq_len.is_multiple_of(2 * cp), "seq_len {seq_len} vs 2*cp {}", 2 * cp);
        assert!(
            (seq_len / cp).is_multiple_of(sp_tp),
            "seq_len {seq_len} / cp {cp} vs sp tp {sp_tp}"
        );
        SeqSplit { seq_len, cp, sp_tp }
    }

    /// Positions per CP rank.
    pub fn local_len(&self) -> usize {
        self.seq_len / self.cp
    }

    /// The CP rank owning position `pos`.
    pub fn cp_owner(&self, pos: usize) -> usize {
        if self.cp == 1 {
            return 0;
        }
        let chunk = pos / (self.seq_len / (2 * self.cp));
        if chunk < self.cp { chunk } else { 2 * self.cp - 1 - chunk }
    }

    /// Index of `pos` in its CP rank's local sequence.
    pub fn local_index(&self, pos: usize) -> usize {
        if self.cp == 1 {
            return pos;
        }
        let c = self.seq_len / (2 * self.cp);
        let chunk = pos / c;
        if chunk < self.cp { pos - chunk * c } else { c + pos - chunk * c }
    }

    /// The TP rank owning `pos` under SP, or `None` when every TP rank holds it.
    pub fn tp_owner(&self, pos: usize) -> Option<usize> {
        (self.sp_tp > 1).then(|| self.local_index(pos) / (self.local_len() / self.sp_tp))
    }

    /// Positions of CP rank `cp_idx` before any SP split (what its attention queries
    /// cover): the whole sequence at cp 1, else chunks `cp_idx` and `2*cp - 1 - cp_idx`.
    pub fn cp_owned(&self, cp_idx: usize) -> Vec<Range<usize>> {
        if self.cp == 1 {
            return std::iter::once(0..self.seq_len).collect();
        }
        let c = self.seq_len / (2 * self.cp);
        let far = 2 * self.cp - 1 - cp_idx;
        vec![cp_idx * c..(cp_idx + 1) * c, far * c..(far + 1) * c]
    }

    /// Positions owned by CP rank `cp_idx` (and TP rank `tp_idx` under SP), as ascending
    /// ranges.
    pub fn owned(&self, cp_idx: usize, tp_idx: usize) -> Vec<Range<usize>> {
        let runs = self.cp_owned(cp_idx);
        if self.sp_tp == 1 {
            return runs;
        }
        let part = self.local_len() / self.sp_tp;
        let (lo, hi) = (tp_idx * part, (tp_idx + 1) * part);
        let mut out = Vec::new();
        let mut local = 0;
        for run in runs {
            let (a, b) = (local, local + run.len());
            let (s, e) = (a.max(lo), b.min(hi));
            if s < e {
                out.push(run.start + (s - a)..run.start + (e - a));
            }
            local = b;
        }
        out
    }
}

/// The part of `0..len` cut into `parts` balanced contiguous parts that holds `u`:
/// part `j` is `floor(j*len/parts) .. floor((j+1)*len/parts)`.
pub fn balanced_part(len: usize, parts: usize, u: usize) -> usize {
    debug_assert!(u < len);
    // One part (no CP or SP split, the common case) without a division: this runs once a
    // boundary row.
    if parts == 1 {
        return 0;
    }
    ((u + 1) * parts).div_ceil(len) - 1
}

/// The start of part `j` of `0..len` cut into `parts` balanced parts.
pub fn balanced_start(len: usize, parts: usize, j: usize) -> usize {
    if parts == 1 {
        return j * len;
    }
    j * len / parts
}

/// Owner of row `u` of an item of `len` rows in an encoder's sequence-sharded output:
/// `(cp_idx, Some(tp_idx))` under SP, `(cp_idx, None)` when TP ranks replicate it.
pub fn item_owner(layout: &ModuleLayout, len: usize, u: usize) -> (usize, Option<usize>) {
    let cp_idx = balanced_part(len, layout.cp(), u);
    if !(layout.sp() && layout.tp() > 1) {
        return (cp_idx, None);
    }
    let start = balanced_start(len, layout.cp(), cp_idx);
    let part_len = balanced_start(len, layout.cp(), cp_idx + 1) - start;
    (cp_idx, Some(balanced_part(part_len, layout.tp(), u - start)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutSpec, Span};

    fn llm(tp: usize, cp: usize, sp: bool) -> ModuleLayout {
        let spec = LayoutSpec { tp, cp, sp, ..LayoutSpec::default() };
        ModuleLayout::new("llm", Span::new(0, tp * cp), spec).expect("valid")
    }

    #[test]
    fn cp_zigzag_of_sixteen_positions() {
        // EXAMPLES.md case 2.
        let split = SeqSplit::new(16, &llm(1, 2, false));
        let owners: Vec<usize> = (0..16).map(|p| split.cp_owner(p)).collect();
        assert_eq!(owners, [0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]);
        assert_eq!(split.owned(0, 0), vec![0..4, 12..16]);
        assert_eq!(split.owned(1, 0), vec![4..8, 8..12]);
        assert_eq!(split.local_index(13), 5);
        assert_eq!(split.tp_owner(13), None);
    }

    #[test]
    fn sp_cuts_each_cp_rank_in_local_order() {
        let split = SeqSplit::new(16, &llm(2, 2, true));
        // CP rank 0 holds 0-3 then 12-15; TP rank 0 gets the first half in that order.
        assert_eq!(split.owned(0, 0), vec![0..4]);
        assert_eq!(split.owned(0, 1), vec![12..16]);
        assert_eq!(split.owned(1, 0), vec![4..8]);
        assert_eq!(split.tp_owner(14), Some(1));
        let split = SeqSplit::new(24, &llm(4, 2, true));
        assert_eq!(split.owned(1, 1), vec![9..12]);
        assert_eq!(split.owned(0, 2), vec![18..21]);
        for p in 0..24 {
            let (c, t) = (split.cp_owner(p), split.tp_owner(p).expect("sp"));
            assert!(split.owned(c, t).iter().any(|r| r.contains(&p)), "position {p}");
        }
    }

    #[test]
    fn balanced_parts_cover_uneven_lengths() {
        let parts: Vec<usize> = (0..7).map(|u| balanced_part(7, 3, u)).collect();
        assert_eq!(parts, [0, 0, 1, 1, 2, 2, 2]);
        assert_eq!((0..4).map(|j| balanced_start(7, 3, j)).collect::<Vec<_>>(), [0, 2, 4, 7]);
        // More parts than rows: some parts are empty, each row still has one owner.
        assert_eq!((0..2).map(|u| balanced_part(2, 4, u)).collect::<Vec<_>>(), [1, 3]);
    }
}
