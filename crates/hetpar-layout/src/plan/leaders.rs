//! The `leaders` strategy (non-colocated): boundary leaders and local distribution.
//!
//! For each pair of a from-replica `a` and a to-replica `b` that share rows (an encoder
//! replica's items and an LLM replica's samples), those rows cross the island boundary once, between leaders. With `stripes = w` the
//! pair's rows are cut into `w` contiguous parts, part `j` going from the `j`-th rank of
//! `a`'s stage to the `j`-th rank of `b`'s stage (`j = 0` is the canonical `(tp 0, cp 0)`
//! leader), so a replica pair uses `w` links. Three phases, each deadlock-free:
//!
//! 1. collect: each from-leader receives the rows of its part it does not have from one
//!    source in its replica (stripe by stripe, each a star into the leader);
//! 2. cross: from-leaders send to to-leaders (sends by receiver, receives by sender);
//! 3. distribute: each to-leader broadcasts to its replica's stage when every member wants
//!    every row, else sends each member what it wants (stripe by stripe).
//!
//! The same code runs the backward with the sides swapped: to-leaders are then the source
//! module's last stage and the gradients collected are canonical or the leader's own.

use std::collections::{BTreeMap, HashMap};

use super::{Buf, Movement, Op, Program, Segs, leader_ranks};
use crate::ownership::balanced_start;

pub(super) fn plan(mv: &Movement<'_>, stripes: usize) -> Program {
    let mut prog = mv.empty_program();
    let (from_layout, from_stage) = mv.source_side();
    let (to_layout, to_stage) = mv.target_side();
    let from_leaders = leader_ranks(from_layout, from_stage, stripes);
    let to_leaders = leader_ranks(to_layout, to_stage, stripes);
    // In a rank's view, only the phases of its own replicas (its rows are theirs): a
    // replica pair's crossing is planned where either end is the rank's, its sends only
    // where the from-replica is (the view holds no other replica's collected rows).
    let replica = |l: &crate::layout::ModuleLayout, stage: usize| {
        mv.geo.rank.map(|me| l.coords(me).filter(|c| c.pp_idx == stage).map(|c| c.dp_idx))
    };
    let (from_d, to_d) = (replica(from_layout, from_stage), replica(to_layout, to_stage));
    let from_wanted = |a: usize| from_d.is_none_or(|d| d == Some(a));
    let to_wanted = |b: usize| to_d.is_none_or(|d| d == Some(b));

    // Rows per (from replica, to replica), ascending; part j of a pair goes over stripe j.
    let mut pairs: BTreeMap<(usize, usize), Vec<usize>> = BTreeMap::new();
    for row in 0..mv.geo.rows.len() {
        pairs.entry((mv.source_replica(row), mv.target_replica(row))).or_default().push(row);
    }
    let part = |rows: &[usize], j: usize| -> Vec<usize> {
        let n = rows.len();
        rows[balanced_start(n, stripes, j)..balanced_start(n, stripes, j + 1)].to_vec()
    };

    // Phase 1: collect each stripe's rows at its from-leader.
    let mut at_from: HashMap<(usize, usize), (Buf, usize)> = HashMap::new();
    for j in 0..stripes {
        for (a, leaders) in from_leaders.iter().enumerate().filter(|&(a, _)| from_wanted(a)) {
            let leader = leaders[j];
            let mut rows: Vec<usize> =
                pairs.range((a, 0)..(a + 1, 0)).flat_map(|(_, rs)| part(rs, j)).collect();
            rows.sort_unstable();
            let mut fetch: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
            for row in rows {
                match mv.source_slot(leader, row) {
                    Some(slot) => {
                        at_from.insert((leader, row), (mv.source_buf(), slot));
                    }
                    None => fetch.entry(mv.pick(row, leader)).or_default().push(row),
                }
            }
            for (src, rows) in fetch {
                let base = prog.alloc_stage(leader, rows.len());
                let (mut send, mut recv) = (Segs::default(), Segs::default());
                for (i, &row) in rows.iter().enumerate() {
                    send.push(
                        mv.source_buf(),
                        mv.source_slot(src, row).expect("source has the row"),
                    );
                    recv.push(Buf::Stage, base + i);
                    at_from.insert((leader, row), (Buf::Stage, base + i));
                }
                prog.push(src, Op::Send { peer: leader, rows: send });
                prog.push(leader, Op::Recv { peer: src, rows: recv });
            }
        }
    }

    // Phase 2: cross the island boundary, leader to leader.
    let mut at_to: HashMap<(usize, usize), (Buf, usize)> = HashMap::new();
    let mut msgs: BTreeMap<(usize, usize), (Segs, Segs)> = BTreeMap::new();
    for (&(a, b), rows) in pairs.iter().filter(|&(&(a, b), _)| from_wanted(a) || to_wanted(b)) {
        for j in 0..stripes {
            let rows = part(rows, j);
            if rows.is_empty() {
                continue;
            }
            let (f, t) = (from_leaders[a][j], to_leaders[b][j]);
            let spare = rows.iter().filter(|&&r| mv.target_slot(t, r).is_none()).count();
            let mut next = prog.alloc_stage(t, spare);
            let (mut send, mut recv) = (Segs::default(), Segs::default());
            for row in rows {
                if from_wanted(a) {
                    let (buf, slot) = at_from[&(f, row)];
                    send.push(buf, slot);
                }
                let dest = match mv.target_slot(t, row) {
                    Some(slot) => (mv.target_buf(), slot),
                    None => {
                        next += 1;
                        (Buf::Stage, next - 1)
                    }
                };
                recv.push(dest.0, dest.1);
                at_to.insert((t, row), dest);
            }
            msgs.insert((f, t), (send, recv));
        }
    }
    prog.push_messages(&msgs);

    // Phase 3: each to-leader hands its replica's stage what it wants.
    for j in 0..stripes {
        for (b, leaders) in to_leaders.iter().enumerate().filter(|&(b, _)| to_wanted(b)) {
            let leader = leaders[j];
            let mut rows: Vec<usize> = pairs
                .iter()
                .filter(|((_, to), _)| *to == b)
                .flat_map(|(_, rs)| part(rs, j))
                .collect();
            if rows.is_empty() {
                continue;
            }
            rows.sort_unstable();
            let mut members = to_layout.stage_ranks(b, to_stage);
            members.sort_unstable();
            let everyone_wants_all =
                members.iter().all(|&m| rows.iter().all(|&r| mv.target_slot(m, r).is_some()));
            if everyone_wants_all && members.len() > 1 {
                for &m in &members {
                    let mut segs = Segs::default();
                    for &row in &rows {
                        segs.push(
                            mv.target_buf(),
                            mv.target_slot(m, row).expect("member wants the row"),
                        );
                    }
                    let op = Op::Broadcast { group: members.clone(), root: leader, rows: segs };
                    prog.push(m, op);
                }
                continue;
            }
            for &m in members.iter().filter(|&&m| m != leader) {
                let (mut send, mut recv) = (Segs::default(), Segs::default());
                for &row in &rows {
                    if let Some(slot) = mv.target_slot(m, row) {
                        let (buf, at) = at_to[&(leader, row)];
                        send.push(buf, at);
                        recv.push(mv.target_buf(), slot);
                    }
                }
                if !send.is_empty() {
                    prog.push(leader, Op::Send { peer: m, rows: send });
                    prog.push(m, Op::Recv { peer: leader, rows: recv });
                }
            }
        }
    }
    prog
}
