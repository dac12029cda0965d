//! The `gather` strategy (colocated): all-gather-v inside groups, then local selection.
//!
//! A rank that lacks a row is linked to the row's single contributor (forward: its lowest
//! holder; backward: its canonical gradient). The connected components of those links are
//! the gather groups: each member contributes the rows it is the contributor of, every
//! member receives all contributions into its stage buffer and copies out the intervals it
//! needs. Rows a rank already has are copied locally, so a fan-in backward moves nothing.

use std::collections::{BTreeMap, BTreeSet};

use super::{Buf, Movement, Op, Program, Seg, Segs};
use crate::edge::EdgeId;
use crate::geometry::{EdgeGeometry, RowId};
use crate::layout::ModuleLayout;
use crate::manifest::BatchManifest;

/// The root of `x` in the union-find `parent`, halving the path on the way.
fn find(parent: &mut [usize], mut x: usize) -> usize {
    while parent[x] != x {
        parent[x] = parent[parent[x]];
        x = parent[x];
    }
    x
}

pub(super) fn plan(mv: &Movement<'_>) -> Program {
    let mut prog = mv.empty_program();
    let ranks: Vec<usize> = prog.ops.keys().copied().collect();
    let index: BTreeMap<usize, usize> = ranks.iter().enumerate().map(|(i, &r)| (r, i)).collect();
    let mut parent: Vec<usize> = (0..ranks.len()).collect();
    // (target, slot, row) for every row a target lacks.
    let mut missing = Vec::new();
    for &t in &ranks {
        for (slot, row) in mv.copy_local(&mut prog, t) {
            let (a, b) =
                (find(&mut parent, index[&t]), find(&mut parent, index[&mv.contributor(row)]));
            parent[a] = b;
            missing.push((t, slot, row));
        }
    }
    // Each rank's component, the members of each (in rank order) and what each target
    // lacks, each found in one pass: at thousands of ranks and millions of rows, a scan of
    // every rank or row per member would be quadratic.
    let comp: Vec<usize> = (0..ranks.len()).map(|i| find(&mut parent, i)).collect();
    let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &r) in ranks.iter().enumerate() {
        members.entry(comp[i]).or_default().push(r);
    }
    // Rows each component must circulate, and what each target lacks (in `missing`'s order).
    let mut comp_rows: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    let mut lacks: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
    for &(t, slot, row) in &missing {
        comp_rows.entry(comp[index[&t]]).or_default().insert(row);
        lacks.entry(t).or_default().push((slot, row));
    }
    for (c, rows) in &comp_rows {
        let group = &members[c];
        let mut by_contributor: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &row in rows {
            by_contributor.entry(mv.contributor(row)).or_default().push(row);
        }
        let contributions: Vec<Vec<usize>> =
            group.iter().map(|m| by_contributor.remove(m).unwrap_or_default()).collect();
        let counts: Vec<usize> = contributions.iter().map(Vec::len).collect();
        let total: usize = counts.iter().sum();
        // Offset of each row in the gathered concatenation.
        let offset: BTreeMap<usize, usize> =
            contributions.iter().flatten().enumerate().map(|(i, &row)| (row, i)).collect();
        for (m, mine) in group.iter().zip(&contributions) {
            let base = prog.alloc_stage(*m, total);
            let mut send = Segs::default();
            for &row in mine {
                send.push(
                    mv.source_buf(),
                    mv.source_slot(*m, row).expect("contributor has the row"),
                );
            }
            let into = Seg { buf: Buf::Stage, start: base, len: total };
            prog.push(
                *m,
                Op::AllGatherV { group: group.clone(), send, counts: counts.clone(), into },
            );
            let (mut from, mut to) = (Segs::default(), Segs::default());
            for &(slot, row) in lacks.get(m).map_or(&[][..], Vec::as_slice) {
                from.push(Buf::Stage, base + offset[&row]);
                to.push(mv.target_buf(), slot);
            }
            if !from.is_empty() {
                prog.push(*m, Op::Copy { from, to });
            }
        }
    }
    prog
}

/// [`plan`]'s groups of `edge` in microbatch `k` over `ranks` (every rank of either
/// module), `[forward, backward]`: each group's members in rank order with the rows each
/// contributes, what its all-gather-v ops list. Found from the runs of rows that share
/// their holders and needers ([`EdgeGeometry::for_each_run`]), linking each run's lacking
/// targets to its contributor as [`plan`] links each row's: one pass over the microbatch's
/// rows and a word per rank, where [`plan`] holds every row and [`plan_for`] walks a group
/// through its members' views.
pub(super) fn groups(
    (src, dst): (&ModuleLayout, &ModuleLayout),
    manifest: &BatchManifest,
    (edge, k): (EdgeId, usize),
    ranks: &[usize],
) -> [Vec<(Vec<usize>, Vec<usize>)>; 2] {
    let end = ranks.last().map_or(0, |&r| r + 1);
    // Per direction: each rank's union-find parent and the rows it contributes.
    let mut parent: [Vec<usize>; 2] = [(0..end).collect(), (0..end).collect()];
    let mut rows = [vec![0; end], vec![0; end]];
    EdgeGeometry::for_each_run(src, dst, manifest, (edge, k), |len, holders, needers, canon| {
        // Forward: needers read from the lowest holder; backward: holders from the
        // canonical needer.
        let sides = [(needers, holders, holders[0]), (holders, needers, canon)];
        for (((targets, sources, contributor), parent), rows) in
            sides.into_iter().zip(&mut parent).zip(&mut rows)
        {
            let mut lacking = targets.iter().filter(|t| !sources.contains(t)).peekable();
            if lacking.peek().is_none() {
                continue;
            }
            rows[contributor] += len;
            for &t in lacking {
                let (a, b) = (find(parent, t), find(parent, contributor));
                parent[a] = b;
            }
        }
    });
    let mut out = [Vec::new(), Vec::new()];
    for ((out, parent), rows) in out.iter_mut().zip(&mut parent).zip(&rows) {
        let mut members: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for &r in ranks {
            members.entry(find(parent, r)).or_default().push(r);
        }
        for group in members.into_values() {
            let counts: Vec<usize> = group.iter().map(|&m| rows[m]).collect();
            if group.len() > 1 && counts.iter().any(|&c| c > 0) {
                out.push((group, counts));
            }
        }
        out.sort_unstable();
    }
    out
}

/// The viewing rank's programs of [`plan`] from its view (`mv`) and the views of the
/// members of its group (`view(r)`): the group is the connected component of the links
/// from the rank, found by walking them (a rank links to the contributor of each row it
/// lacks, and each lacking target of a row it contributes links to it), each member's view
/// giving its own links. The rows the group circulates are the rows its members lack, named
/// by [`RowId`] across views (whose order is the whole geometry's row order), so the
/// counts, the concatenation and the offsets are the whole plan's.
pub(super) fn plan_for(mv: &Movement<'_>, view: &dyn Fn(usize) -> EdgeGeometry) -> Program {
    let me = mv.geo.rank.expect("planned from a rank's view");
    let mut prog = mv.empty_program();
    if !prog.ops.contains_key(&me) {
        return prog;
    }
    let lacking = mv.copy_local(&mut prog, me);
    // Each circulated row and its contributor, and the members found.
    let mut circulated: BTreeMap<RowId, usize> = BTreeMap::new();
    let mut members = BTreeSet::from([me]);
    let mut walk = vec![me];
    while let Some(x) = walk.pop() {
        let theirs;
        let geo = if x == me {
            mv.geo
        } else {
            theirs = view(x);
            &theirs
        };
        let mx = Movement { geo, dir: mv.dir };
        let mut link = |row: usize, other: usize, contributor: usize| {
            circulated.insert(geo.rows[row].id, contributor);
            if members.insert(other) {
                walk.push(other);
            }
        };
        for &row in mx.targets(x) {
            if mx.source_slot(x, row).is_none() {
                let c = mx.contributor(row);
                link(row, c, c);
            }
        }
        for &row in mx.source_rows(x) {
            if mx.contributor(row) != x {
                continue;
            }
            let sources = mx.sources(row);
            for &t in mx.row_targets(row).iter().filter(|t| !sources.contains(t)) {
                link(row, t, x);
            }
        }
    }
    if circulated.is_empty() {
        return prog;
    }
    let group: Vec<usize> = members.into_iter().collect();
    // The concatenation: each member's contributions in member order, rows ascending.
    let mut order: Vec<(usize, RowId)> = circulated.iter().map(|(&id, &c)| (c, id)).collect();
    order.sort_unstable();
    let mut per: BTreeMap<usize, usize> = BTreeMap::new();
    for &(c, _) in &order {
        *per.entry(c).or_default() += 1;
    }
    let counts: Vec<usize> = group.iter().map(|m| per.get(m).copied().unwrap_or(0)).collect();
    let offset: BTreeMap<RowId, usize> =
        order.iter().enumerate().map(|(i, &(_, id))| (id, i)).collect();
    let base = prog.alloc_stage(me, order.len());
    let mut send = Segs::default();
    for (slot, &row) in mv.source_rows(me).iter().enumerate() {
        if circulated.get(&mv.geo.rows[row].id) == Some(&me) {
            send.push(mv.source_buf(), slot);
        }
    }
    let into = Seg { buf: Buf::Stage, start: base, len: order.len() };
    prog.push(me, Op::AllGatherV { group, send, counts, into });
    let (mut from, mut to) = (Segs::default(), Segs::default());
    for (slot, row) in lacking {
        from.push(Buf::Stage, base + offset[&mv.geo.rows[row].id]);
        to.push(mv.target_buf(), slot);
    }
    if !from.is_empty() {
        prog.push(me, Op::Copy { from, to });
    }
    prog
}
