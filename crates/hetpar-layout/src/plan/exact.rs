//! The `exact` strategy: every rank receives exactly the rows it lacks, each from one source.
//!
//! Colocated, the messages form one all-to-all-v over the shared span (deadlock-free by
//! construction). Across islands they are direct sends; a rank only sends (source island)
//! or only receives (destination island), sends are ordered by receiver and receives by
//! sender, which cannot deadlock even with rendezvous sends.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Movement, Op, Program, Segs};
use crate::edge::PlacementMode;

pub(super) fn plan(mv: &Movement<'_>, mode: PlacementMode) -> Program {
    let mut prog = mv.empty_program();
    // The ranks whose programs are built: every rank, or the viewing rank. Each
    // message is found from both ends, the receiver's slots from the rows it lacks and the
    // sender's from the rows it holds that a lacking target picks it for; both walk rows in
    // ascending order, so the two lists of a message name the same rows in the same order.
    let ranks: Vec<usize> =
        prog.ops.keys().copied().filter(|&r| mv.geo.rank.is_none_or(|me| me == r)).collect();
    // (source, target) -> (rows read on the source, slots written on the target)
    let mut msgs: BTreeMap<(usize, usize), (Segs, Segs)> = BTreeMap::new();
    for &t in &ranks {
        for (slot, row) in mv.copy_local(&mut prog, t) {
            msgs.entry((mv.pick(row, t), t)).or_default().1.push(mv.target_buf(), slot);
        }
    }
    for &s in &ranks {
        for (slot, &row) in mv.source_rows(s).iter().enumerate() {
            let sources = mv.sources(row);
            for &t in mv.row_targets(row) {
                if !sources.contains(&t) && mv.pick(row, t) == s {
                    msgs.entry((s, t)).or_default().0.push(mv.source_buf(), slot);
                }
            }
        }
    }
    debug_assert!(mv.geo.rank.is_some() || msgs.is_empty() != mv.moves(), "moves flag");
    if !mv.moves() {
        return prog;
    }
    match mode {
        PlacementMode::Colocated => {
            // Each built member's per-peer lists, filled from the messages in one pass (a
            // lookup per member pair is quadratic in map probes on wide spans). `msgs` is
            // ordered by source, then target, so each list comes out ascending by member.
            let span = mv.geo.src.span();
            let group: Arc<[usize]> = span.ranks().collect();
            type Lists = (Vec<(usize, Segs)>, Vec<(usize, Segs)>);
            let mut lists: BTreeMap<usize, Lists> =
                ranks.iter().map(|&r| (r, Lists::default())).collect();
            for ((s, t), (from, to)) in msgs {
                if let Some(l) = lists.get_mut(&s).filter(|_| !from.is_empty()) {
                    l.0.push((t - span.start, from));
                }
                if let Some(l) = lists.get_mut(&t).filter(|_| !to.is_empty()) {
                    l.1.push((s - span.start, to));
                }
            }
            for (r, (send, recv)) in lists {
                prog.push(r, Op::AllToAllV { group: Arc::clone(&group), send, recv });
            }
        }
        // In a rank's view the other ends are empty and dropped with the view's other ranks.
        PlacementMode::NonColocated => prog.push_messages(&msgs),
    }
    prog
}
