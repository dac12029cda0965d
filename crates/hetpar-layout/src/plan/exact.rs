//! The `exact` strategy: every rank receives exactly the rows it lacks, each from one source.
//!
//! Colocated, the messages form one all-to-all-v over the shared span (deadlock-free by
//! construction). Across islands they are direct sends; a rank only sends (source island)
//! or only receives (destination island), sends are ordered by receiver and receives by
//! sender, which cannot deadlock even with rendezvous sends.

use std::collections::BTreeMap;

use super::{Movement, Op, Program, Segs};
use crate::edge::PlacementMode;

pub(super) fn plan(mv: &Movement<'_>, mode: PlacementMode) -> Program {
    let mut prog = mv.empty_program();
    let ranks: Vec<usize> = prog.ops.keys().copied().collect();
    // (source, target) -> (rows read on the source, slots written on the target)
    let mut msgs: BTreeMap<(usize, usize), (Segs, Segs)> = BTreeMap::new();
    for &t in &ranks {
        for (slot, row) in mv.copy_local(&mut prog, t) {
            let s = mv.pick(row, t);
            let m = msgs.entry((s, t)).or_default();
            m.0.push(mv.source_buf(), mv.source_slot(s, row).expect("picked source has the row"));
            m.1.push(mv.target_buf(), slot);
        }
    }
    if msgs.is_empty() {
        return prog;
    }
    match mode {
        PlacementMode::Colocated => {
            // Every member's per-peer lists, filled from the messages in one pass (a
            // lookup per member pair is quadratic in map probes on wide spans).
            let span = mv.geo.src.span();
            let group: Vec<usize> = span.ranks().collect();
            let n = group.len();
            let mut send = vec![vec![Segs::default(); n]; n];
            let mut recv = vec![vec![Segs::default(); n]; n];
            for ((s, t), (from, to)) in msgs {
                let (si, ti) = (s - span.start, t - span.start);
                send[si][ti] = from;
                recv[ti][si] = to;
            }
            for ((&r, send), recv) in group.iter().zip(send).zip(recv) {
                prog.push(r, Op::AllToAllV { group: group.clone(), send, recv });
            }
        }
        PlacementMode::NonColocated => prog.push_messages(&msgs),
    }
    prog
}
