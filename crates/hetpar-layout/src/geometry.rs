//! The rows of one edge in one microbatch: for every row, which ranks hold it after the
//! source forward and which ranks need it before the destination forward (SEMANTICS.md
//! sections 3-4). The source's replicas own the microbatch's items (contiguous ranges in
//! canonical order), the destination's replicas own its samples. Routing strategies only
//! read this; it is the single derivation of "who has what" that plans, lower bounds and
//! tests share.

use std::collections::BTreeMap;
use std::fmt;

use crate::edge::EdgeId;
use crate::layout::ModuleLayout;
use crate::manifest::{BatchManifest, item_replica};
use crate::ownership::{SeqSplit, item_owner};

/// A boundary row: token `token` (counting the sample's rows on this edge in position
/// order) of sample `sample` (global index in the step).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowId {
    /// Global sample index.
    pub sample: usize,
    /// Row index inside the sample on this edge.
    pub token: usize,
}

impl fmt::Display for RowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({},{})", self.sample, self.token)
    }
}

/// One row and its owners on both sides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// The row's name.
    pub id: RowId,
    /// Its position in the destination sequence.
    pub pos: usize,
    /// The item it belongs to: its index in the microbatch's items on this edge, in
    /// canonical order (`BatchManifest::microbatch_items`).
    pub item: usize,
    /// Source replica that produces it (the owner of its item).
    pub src_replica: usize,
    /// Destination replica that consumes it.
    pub dst_replica: usize,
    /// Source ranks holding it after the forward (last stage), ascending.
    pub holders: Vec<usize>,
    /// Destination ranks needing it (first stage), ascending.
    pub needers: Vec<usize>,
    /// The needer whose gradient is canonical: lowest `tp` index, then lowest `cp` index.
    pub canonical: usize,
}

/// Who holds and who needs each row of one edge in one microbatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgeGeometry {
    /// Rows sorted by `(sample, token)`.
    pub rows: Vec<Row>,
    /// Per rank of either module, the indices into `rows` it holds, in its buffer order.
    pub held: BTreeMap<usize, Vec<usize>>,
    /// Per rank of either module, the indices into `rows` it needs, in its buffer order.
    pub needed: BTreeMap<usize, Vec<usize>>,
    /// Source layout.
    pub src: ModuleLayout,
    /// Destination layout.
    pub dst: ModuleLayout,
}

impl EdgeGeometry {
    /// Rows of `edge` in global microbatch `k` of `manifest`, placed on `src` and `dst`.
    pub fn new(
        src: &ModuleLayout,
        dst: &ModuleLayout,
        manifest: &BatchManifest,
        edge: EdgeId,
        k: usize,
    ) -> EdgeGeometry {
        let split = SeqSplit::new(manifest.seq_len(), dst);
        let items = manifest.microbatch_items(edge, k);
        let mut rows = Vec::new();
        // Rows count per sample across its items on this edge.
        let mut token = 0;
        for (j, &r) in items.iter().enumerate() {
            if j > 0 && items[j - 1].sample != r.sample {
                token = 0;
            }
            let (sample, item) = (r.sample, manifest.item(r));
            let src_replica = item_replica(items.len(), src.dp(), j);
            let dst_replica = manifest.replica_of(dst.dp(), sample);
            for u in 0..item.rows {
                let pos = item.pos + u;
                let holders = holders_of(src, src_replica, item.rows, u);
                let needers = needers_of(dst, &split, dst_replica, pos);
                let canonical = *needers
                    .iter()
                    .min_by_key(|&&r| {
                        let c = dst.coords(r).expect("needer inside dst");
                        (c.tp_idx, c.cp_idx)
                    })
                    .expect("every row has a needer");
                let id = RowId { sample, token };
                rows.push(Row {
                    id,
                    pos,
                    item: j,
                    src_replica,
                    dst_replica,
                    holders,
                    needers,
                    canonical,
                });
                token += 1;
            }
        }
        let mut held: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut needed: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for r in src.span().ranks().chain(dst.span().ranks()) {
            held.entry(r).or_default();
            needed.entry(r).or_default();
        }
        for (i, row) in rows.iter().enumerate() {
            for &h in &row.holders {
                held.entry(h).or_default().push(i);
            }
            for &n in &row.needers {
                needed.entry(n).or_default().push(i);
            }
        }
        EdgeGeometry { rows, held, needed, src: src.clone(), dst: dst.clone() }
    }

    /// Slot of row `row` in `rank`'s held buffer, if it holds it.
    pub fn held_slot(&self, rank: usize, row: usize) -> Option<usize> {
        self.held.get(&rank).and_then(|v| v.binary_search(&row).ok())
    }

    /// Slot of row `row` in `rank`'s needed buffer, if it needs it.
    pub fn needed_slot(&self, rank: usize, row: usize) -> Option<usize> {
        self.needed.get(&rank).and_then(|v| v.binary_search(&row).ok())
    }

    /// Every rank of either module, ascending.
    pub fn ranks(&self) -> impl Iterator<Item = usize> + '_ {
        self.held.keys().copied()
    }

    /// Rows each rank needs but does not hold, summed: the least a forward can move.
    pub fn forward_lower_bound(&self) -> BTreeMap<usize, usize> {
        self.needed
            .iter()
            .map(|(&r, rows)| (r, rows.iter().filter(|&&i| self.held_slot(r, i).is_none()).count()))
            .collect()
    }

    /// Rows each rank holds but did not consume, summed: the least a backward can move.
    pub fn backward_lower_bound(&self) -> BTreeMap<usize, usize> {
        self.held
            .iter()
            .map(|(&r, rows)| {
                (r, rows.iter().filter(|&&i| self.needed_slot(r, i).is_none()).count())
            })
            .collect()
    }
}

/// Source holders: replica `d`'s last stage; every TP rank of the owning CP index, or the
/// one SP owner.
fn holders_of(src: &ModuleLayout, d: usize, item_len: usize, u: usize) -> Vec<usize> {
    let stage = src.pp() - 1;
    let (cp_idx, tp) = item_owner(src, item_len, u);
    let tps: Vec<usize> = match tp {
        Some(t) => vec![t],
        None => (0..src.tp()).collect(),
    };
    let mut out: Vec<usize> = tps
        .into_iter()
        .map(|tp_idx| src.rank(crate::layout::Coords { tp_idx, cp_idx, dp_idx: d, pp_idx: stage }))
        .collect();
    out.sort_unstable();
    out
}

/// Destination needers: replica `d`'s first stage; the CP owner of `pos`, and every TP rank
/// or the one SP owner.
fn needers_of(dst: &ModuleLayout, split: &SeqSplit, d: usize, pos: usize) -> Vec<usize> {
    let cp_idx = split.cp_owner(pos);
    let tps: Vec<usize> = match split.tp_owner(pos) {
        Some(t) => vec![t],
        None => (0..dst.tp()).collect(),
    };
    let mut out: Vec<usize> = tps
        .into_iter()
        .map(|tp_idx| dst.rank(crate::layout::Coords { tp_idx, cp_idx, dp_idx: d, pp_idx: 0 }))
        .collect();
    out.sort_unstable();
    out
}
