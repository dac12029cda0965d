//! The rows of one edge in one microbatch: for every row, which ranks hold it after the
//! source forward and which ranks need it before the destination forward (SEMANTICS.md
//! sections 3-4). The source's replicas own the microbatch's items (contiguous ranges in
//! canonical order), the destination's replicas own its samples. Routing strategies only
//! read this; it is the single derivation of "who has what" that plans, lower bounds and
//! tests share.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::ops::Range;

use crate::edge::EdgeId;
use crate::layout::ModuleLayout;
use crate::manifest::{BatchManifest, ItemRef, item_range, item_replica};
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
    /// The source ranks holding it after the forward (last stage): its index in the
    /// geometry's [`EdgeGeometry::sets`] ([`EdgeGeometry::holders`]). Rows with the same
    /// owning part share one list, so a geometry holds a list a part rather than a row.
    pub holder_set: usize,
    /// The destination ranks needing it (first stage): as `holder_set`
    /// ([`EdgeGeometry::needers`]).
    pub needer_set: usize,
    /// The needer whose gradient is canonical: lowest `tp` index, then lowest `cp` index.
    pub canonical: usize,
}

/// Who holds and who needs each row of one edge in one microbatch: every row and every
/// rank ([`EdgeGeometry::new`]), or one rank's view ([`EdgeGeometry::for_rank`]: the rows
/// of that rank's replicas), which is all a rank's own programs read and costs its
/// replicas' rows rather than the whole step's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgeGeometry {
    /// Rows sorted by `(sample, token)`: every row, or in one rank's view the rows of its
    /// replicas.
    pub rows: Vec<Row>,
    /// The rows' holders and needers: sets of ranks, each ascending, indexed by
    /// [`Row::holder_set`] and [`Row::needer_set`].
    pub sets: Vec<Vec<usize>>,
    /// Per rank of either module, the indices into `rows` it holds, in its buffer order. In
    /// a rank's view: that rank and the other boundary ranks of its replicas, each with the
    /// rows of those replicas only (whole for the viewing rank, and for the others on the
    /// side they share with it).
    pub held: BTreeMap<usize, Vec<usize>>,
    /// Per rank of either module, the indices into `rows` it needs, in its buffer order (in
    /// a rank's view, as `held`).
    pub needed: BTreeMap<usize, Vec<usize>>,
    /// Source layout.
    pub src: ModuleLayout,
    /// Destination layout.
    pub dst: ModuleLayout,
    /// The rank whose view this is; `None` for every rank's.
    pub rank: Option<usize>,
    /// Whether some rank needs a row it does not hold (a forward moves rows), and whether
    /// some rank holds a row it did not consume (a backward moves gradients): properties of
    /// the whole microbatch, the same in every rank's view, so each rank knows whether a
    /// collective every member joins takes place.
    pub moves: [bool; 2],
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
        EdgeItems::new((src, dst), manifest, (edge, k)).geometry(None)
    }

    /// Rank `rank`'s view of [`EdgeGeometry::new`]: the rows of its replicas (the source
    /// replica whose last stage it is in, the destination replica whose first stage it is
    /// in), in the same order, so its buffers and slots are the same, with the buffers of
    /// the ranks of those stages. Only those replicas' items are cut into rows, so a view
    /// costs the rank's share of the step and one pass over the microbatch's items (many
    /// ranks' views share that pass through [`EdgeItems::view`]).
    pub fn for_rank(
        src: &ModuleLayout,
        dst: &ModuleLayout,
        manifest: &BatchManifest,
        (edge, k): (EdgeId, usize),
        rank: usize,
    ) -> EdgeGeometry {
        EdgeItems::new((src, dst), manifest, (edge, k)).view(rank)
    }

    /// The rows of `edge` in microbatch `k` as runs of rows that share their holders and
    /// needers, in row order: `visit(len, holders, needers, canonical)` for each run of `len`
    /// rows, with [`Row`]'s sets. What [`EdgeGeometry::new`] says of every row, at the cost
    /// of a pass over the microbatch's rows and the memory of one run (holders follow an
    /// item's CP/SP part and needers the position's, so a run changes a few times an item).
    pub fn for_each_run(
        src: &ModuleLayout,
        dst: &ModuleLayout,
        manifest: &BatchManifest,
        (edge, k): (EdgeId, usize),
        mut visit: impl FnMut(usize, &[usize], &[usize], usize),
    ) {
        let split = SeqSplit::new(manifest.seq_len(), dst);
        let items = manifest.microbatch_items(edge, k);
        let mut last: Option<(OwnerKey, UserKey)> = None;
        let (mut len, mut holders, mut needers, mut canonical) = (0, Vec::new(), Vec::new(), 0);
        for j in 0..items.len() {
            let rows = manifest.item(items[j]).rows;
            for (u, pos, owners, users) in keyed_rows((src, dst, &split), manifest, &items, j) {
                if last == Some((owners, users)) {
                    len += 1;
                    continue;
                }
                if len > 0 {
                    visit(len, &holders, &needers, canonical);
                }
                last = Some((owners, users));
                holders = holders_of(src, owners.1, rows, u);
                needers = needers_of(dst, &split, users.2, pos);
                canonical = canonical_of(dst, &needers);
                len = 1;
            }
        }
        if len > 0 {
            visit(len, &holders, &needers, canonical);
        }
    }

    /// The source ranks holding `row` after the forward (the owning replica's last stage),
    /// ascending.
    pub fn holders(&self, row: &Row) -> &[usize] {
        &self.sets[row.holder_set]
    }

    /// The destination ranks needing `row` (the using replica's first stage), ascending.
    pub fn needers(&self, row: &Row) -> &[usize] {
        &self.sets[row.needer_set]
    }

    /// Slot of row `row` in `rank`'s held buffer, if it holds it.
    pub fn held_slot(&self, rank: usize, row: usize) -> Option<usize> {
        self.held.get(&rank).and_then(|v| v.binary_search(&row).ok())
    }

    /// Slot of row `row` in `rank`'s needed buffer, if it needs it.
    pub fn needed_slot(&self, rank: usize, row: usize) -> Option<usize> {
        self.needed.get(&rank).and_then(|v| v.binary_search(&row).ok())
    }

    /// Every rank of either module (in a rank's view, the ranks whose buffers it keeps),
    /// ascending.
    pub fn ranks(&self) -> impl Iterator<Item = usize> + '_ {
        self.held.keys().copied()
    }

    /// Rows each rank needs but does not hold, summed: the least a forward can move (of the
    /// whole geometry; a rank's view gives only the viewing rank's whole count).
    pub fn forward_lower_bound(&self) -> BTreeMap<usize, usize> {
        self.needed.keys().map(|&r| (r, self.lower_bounds_of(r)[0])).collect()
    }

    /// Rows each rank holds but did not consume, summed: the least a backward can move (as
    /// the forward's, whole only for the viewing rank in a view).
    pub fn backward_lower_bound(&self) -> BTreeMap<usize, usize> {
        self.held.keys().map(|&r| (r, self.lower_bounds_of(r)[1])).collect()
    }

    /// `rank`'s part of [`EdgeGeometry::forward_lower_bound`] and
    /// [`EdgeGeometry::backward_lower_bound`]: the rows it needs but does not hold, and
    /// those it holds but did not consume (whole in the rank's own view).
    pub fn lower_bounds_of(&self, rank: usize) -> [usize; 2] {
        let none = Vec::new();
        let (held, needed) =
            (self.held.get(&rank).unwrap_or(&none), self.needed.get(&rank).unwrap_or(&none));
        // Both lists ascend (row order): count the rows in both by one merge.
        let (mut i, mut j, mut both) = (0, 0, 0);
        while i < held.len() && j < needed.len() {
            match held[i].cmp(&needed[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => (i, j, both) = (i + 1, j + 1, both + 1),
            }
        }
        [needed.len() - both, held.len() - both]
    }
}

/// The items of one edge in one microbatch, in canonical order, with what every view of
/// their rows shares: where each item's rows start in its sample, and whether any row of
/// the microbatch moves in each direction. Built in one pass over the items, it gives the
/// whole geometry or any rank's view ([`EdgeItems::view`]) at the cost of the rows kept:
/// a view cuts only its replicas' items (contiguous ranges of the list: an encoder
/// replica's items, the LLM replica's samples') into rows.
#[derive(Debug)]
pub struct EdgeItems<'a> {
    src: &'a ModuleLayout,
    dst: &'a ModuleLayout,
    manifest: &'a BatchManifest,
    split: SeqSplit,
    items: Vec<ItemRef>,
    /// Per item, the rows of its sample's earlier items on this edge (its first row's
    /// token).
    tokens: Vec<usize>,
    moves: [bool; 2],
}

impl<'a> EdgeItems<'a> {
    /// The items of `edge` in global microbatch `k` of `manifest`, placed on `src` and
    /// `dst`.
    pub fn new(
        (src, dst): (&'a ModuleLayout, &'a ModuleLayout),
        manifest: &'a BatchManifest,
        (edge, k): (EdgeId, usize),
    ) -> EdgeItems<'a> {
        let split = SeqSplit::new(manifest.seq_len(), dst);
        let items = manifest.microbatch_items(edge, k);
        let mut tokens = Vec::with_capacity(items.len());
        let mut moves = Moves::default();
        // Rows count per sample across its items on this edge.
        let mut token = 0;
        for (j, &r) in items.iter().enumerate() {
            if j > 0 && items[j - 1].sample != r.sample {
                token = 0;
            }
            tokens.push(token);
            let rows = manifest.item(r).rows;
            token += rows;
            if moves.found == [true, true] {
                continue;
            }
            for (u, pos, owners, users) in keyed_rows((src, dst, &split), manifest, &items, j) {
                moves.see(owners, users, || {
                    (holders_of(src, owners.1, rows, u), needers_of(dst, &split, users.2, pos))
                });
            }
        }
        EdgeItems { src, dst, manifest, split, items, tokens, moves: moves.found }
    }

    /// Rank `rank`'s view ([`EdgeGeometry::for_rank`]).
    pub fn view(&self, rank: usize) -> EdgeGeometry {
        self.geometry(Some(rank))
    }

    /// The items (indices into the list) of the destination's replica `d`: those of its
    /// samples, a contiguous run of the list since the replicas' samples are contiguous
    /// and the list is in sample order.
    fn dst_items(&self, d: usize) -> Range<usize> {
        let (dp, m) = (self.dst.dp(), self.manifest);
        let first = self.items.partition_point(|r| m.replica_of(dp, r.sample) < d);
        let end = self.items.partition_point(|r| m.replica_of(dp, r.sample) <= d);
        first..end
    }

    /// Every row and every rank (`only` `None`), or rank `only`'s view.
    fn geometry(&self, only: Option<usize>) -> EdgeGeometry {
        let (src, dst, manifest) = (self.src, self.dst, self.manifest);
        let n = self.items.len();
        // The replicas whose rows the viewing rank can hold (as the source's last stage)
        // or need (as the destination's first stage).
        let side = |l: &ModuleLayout, stage: usize| {
            only.and_then(|r| l.coords(r)).filter(|c| c.pp_idx == stage).map(|c| c.dp_idx)
        };
        let (src_d, dst_d) = (side(src, src.pp() - 1), side(dst, 0));
        // The ranks whose buffers are kept: every rank of either module, or in a rank's
        // view the rank and the other ranks of its replicas' boundary stages.
        let kept: Option<BTreeSet<usize>> = only.map(|me| {
            let stage = |l: &ModuleLayout, d: Option<usize>, p: usize| {
                d.map(|d| l.stage_ranks(d, p)).unwrap_or_default()
            };
            let (a, b) = (stage(src, src_d, src.pp() - 1), stage(dst, dst_d, 0));
            a.into_iter().chain(b).chain([me]).collect()
        });
        // The items whose rows are kept, in list order: all, or the viewing rank's
        // replicas' (two ranges, merged where they meet).
        let mut ranges: Vec<Range<usize>> = match only {
            None => std::iter::once(0..n).collect(),
            Some(_) => {
                [src_d.map(|d| item_range(n, src.dp(), d)), dst_d.map(|d| self.dst_items(d))]
                    .into_iter()
                    .flatten()
                    .filter(|r| !r.is_empty())
                    .collect()
            }
        };
        ranges.sort_by_key(|r| r.start);
        if let [a, b] = &ranges[..]
            && b.start <= a.end
        {
            ranges = std::iter::once(a.start..a.end.max(b.end)).collect();
        }
        let count: usize =
            ranges.iter().flat_map(|r| r.clone()).map(|j| manifest.item(self.items[j]).rows).sum();
        let mut rows = Vec::with_capacity(count);
        // A row's holders follow its owning part and needers its using part, which change a
        // few times an item: each set is worked out once and shared by its rows.
        // (A needer set's canonical rank is kept with it.)
        let mut sets: Vec<Vec<usize>> = Vec::new();
        let mut holder_sets: HashMap<OwnerKey, usize> = HashMap::new();
        let mut needer_sets: HashMap<UserKey, (usize, usize)> = HashMap::new();
        let (mut owned, mut used): (Option<OwnerKey>, Option<UserKey>) = (None, None);
        let (mut holder_set, mut needer_set, mut canonical) = (0, 0, 0);
        for j in ranges.into_iter().flatten() {
            let r = self.items[j];
            let item_rows = manifest.item(r).rows;
            for (u, pos, owners, users) in
                keyed_rows((src, dst, &self.split), manifest, &self.items, j)
            {
                if owned != Some(owners) {
                    owned = Some(owners);
                    holder_set = *holder_sets.entry(owners).or_insert_with(|| {
                        sets.push(holders_of(src, owners.1, item_rows, u));
                        sets.len() - 1
                    });
                }
                if used != Some(users) {
                    used = Some(users);
                    (needer_set, canonical) = *needer_sets.entry(users).or_insert_with(|| {
                        let needers = needers_of(dst, &self.split, users.2, pos);
                        let canonical = canonical_of(dst, &needers);
                        sets.push(needers);
                        (sets.len() - 1, canonical)
                    });
                }
                rows.push(Row {
                    id: RowId { sample: r.sample, token: self.tokens[j] + u },
                    pos,
                    item: j,
                    src_replica: owners.1,
                    dst_replica: users.2,
                    holder_set,
                    needer_set,
                    canonical,
                });
            }
        }
        // Every rank of either module has a buffer (in a view, of those kept): a view lists
        // its kept ranks rather than filtering the whole world's. A row's holders and
        // needers lie in the modules' spans, so a kept one is listed.
        let mut listed: Vec<usize> = match &kept {
            Some(k) => {
                let in_either = |r: &usize| src.span().contains(*r) || dst.span().contains(*r);
                k.iter().copied().filter(in_either).collect()
            }
            None => src.span().ranks().chain(dst.span().ranks()).collect(),
        };
        listed.sort_unstable();
        listed.dedup();
        // Each set's listed ranks as buffer indices, found once a set rather than once a row.
        let buffers: Vec<Vec<usize>> = sets
            .iter()
            .map(|set| set.iter().filter_map(|r| listed.binary_search(r).ok()).collect())
            .collect();
        let (mut held, mut needed) =
            (vec![Vec::new(); listed.len()], vec![Vec::new(); listed.len()]);
        for (i, row) in rows.iter().enumerate() {
            for &b in &buffers[row.holder_set] {
                held[b].push(i);
            }
            for &b in &buffers[row.needer_set] {
                needed[b].push(i);
            }
        }
        let held: BTreeMap<usize, Vec<usize>> = listed.iter().copied().zip(held).collect();
        let needed: BTreeMap<usize, Vec<usize>> = listed.into_iter().zip(needed).collect();
        let (src, dst) = (src.clone(), dst.clone());
        EdgeGeometry { rows, sets, held, needed, src, dst, rank: only, moves: self.moves }
    }
}

/// The rows of item `j` of `items` (a microbatch's on an edge, in canonical order), each as
/// `(u, pos, owners, users)`: its index in the item, its position in the destination
/// sequence, and the source part and replica that hold it and the destination part and
/// replica that need it.
fn keyed_rows<'a>(
    (src, dst, split): (&'a ModuleLayout, &'a ModuleLayout, &'a SeqSplit),
    manifest: &'a BatchManifest,
    items: &[ItemRef],
    j: usize,
) -> impl Iterator<Item = (usize, usize, OwnerKey, UserKey)> + 'a {
    let item = manifest.item(items[j]);
    let src_replica = item_replica(items.len(), src.dp(), j);
    let dst_replica = manifest.replica_of(dst.dp(), items[j].sample);
    (0..item.rows).map(move |u| {
        let pos = item.pos + u;
        let owners = (item_owner(src, item.rows, u), src_replica);
        (u, pos, owners, (split.cp_owner(pos), split.tp_owner(pos), dst_replica))
    })
}

/// Whether any row moves in either direction, found by a scan that works out a row's
/// holders and needers only where the owning parts change (at most a few times an item):
/// within an item, holders follow the item's CP/SP part and needers the position's.
#[derive(Default)]
struct Moves {
    found: [bool; 2],
    last: Option<(OwnerKey, UserKey)>,
}

/// A row's source replica and part: `((cp, sp tp), replica)`.
type OwnerKey = ((usize, Option<usize>), usize);
/// A row's destination part and replica: `(cp, sp tp, replica)`.
type UserKey = (usize, Option<usize>, usize);

impl Moves {
    fn see(
        &mut self,
        owners: OwnerKey,
        users: UserKey,
        sets: impl FnOnce() -> (Vec<usize>, Vec<usize>),
    ) {
        if self.found == [true, true] || self.last == Some((owners, users)) {
            return;
        }
        self.last = Some((owners, users));
        let (holders, needers) = sets();
        self.found[0] |= needers.iter().any(|n| !holders.contains(n));
        self.found[1] |= holders.iter().any(|h| !needers.contains(h));
    }
}

/// The needer of a row whose gradient is canonical: lowest `tp` index, then lowest `cp`.
fn canonical_of(dst: &ModuleLayout, needers: &[usize]) -> usize {
    *needers
        .iter()
        .min_by_key(|&&r| {
            let c = dst.coords(r).expect("needer inside dst");
            (c.tp_idx, c.cp_idx)
        })
        .expect("every row has a needer")
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
