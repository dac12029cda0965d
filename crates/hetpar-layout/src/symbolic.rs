//! A symbolic executor: runs per-rank boundary programs on row labels instead of numbers.
//!
//! It is the reference the real executor is tested against and the checker of plans: sends
//! are rendezvous (a send completes only when its receiver has posted the matching receive),
//! collectives complete only when every member has reached the same collective, and a state
//! where no rank can move is reported as a deadlock naming every blocked rank. Reads of
//! unset or out-of-range slots and size mismatches are errors naming the rank and the op.

use std::collections::BTreeMap;

use crate::edge::Direction;
use crate::geometry::RowId;
use crate::plan::{Buf, EdgePlan, Op, Program, Segs};

/// What a slot holds: row `row`, as produced on rank `origin` (the holder in a forward, the
/// destination rank whose gradient it is in a backward).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Label {
    /// The row.
    pub row: RowId,
    /// Rank whose copy this is.
    pub origin: usize,
}

/// The three buffers of one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Buffers {
    /// Source-layout slots.
    pub held: Vec<Option<Label>>,
    /// Destination-layout slots.
    pub needed: Vec<Option<Label>>,
    /// Scratch slots.
    pub stage: Vec<Option<Label>>,
}

impl Buffers {
    fn buf(&self, b: Buf) -> &Vec<Option<Label>> {
        match b {
            Buf::Held => &self.held,
            Buf::Needed => &self.needed,
            Buf::Stage => &self.stage,
        }
    }

    fn buf_mut(&mut self, b: Buf) -> &mut Vec<Option<Label>> {
        match b {
            Buf::Held => &mut self.held,
            Buf::Needed => &mut self.needed,
            Buf::Stage => &mut self.stage,
        }
    }
}

/// Buffers of every rank before `dir` of `plan`: the from-buffer labelled with each rank's
/// own copy of its rows, the to-buffer and stage empty.
pub fn initial_state(plan: &EdgePlan, dir: Direction) -> BTreeMap<usize, Buffers> {
    let geo = &plan.geometry;
    let prog = plan.program(dir);
    let labels = |rank: usize, rows: &[usize]| -> Vec<Option<Label>> {
        rows.iter().map(|&i| Some(Label { row: geo.rows[i].id, origin: rank })).collect()
    };
    geo.ranks()
        .map(|r| {
            let (held, needed) = (&geo.held[&r], &geo.needed[&r]);
            let mut b = Buffers {
                held: vec![None; held.len()],
                needed: vec![None; needed.len()],
                stage: vec![None; prog.stage_rows.get(&r).copied().unwrap_or(0)],
            };
            match dir {
                Direction::Forward => b.held = labels(r, held),
                Direction::Backward => b.needed = labels(r, needed),
            }
            (r, b)
        })
        .collect()
}

fn read(
    state: &BTreeMap<usize, Buffers>,
    rank: usize,
    segs: &Segs,
    what: &str,
) -> Result<Vec<Label>, String> {
    let b = &state[&rank];
    segs.slots()
        .map(|(buf, i)| match b.buf(buf).get(i) {
            Some(Some(l)) => Ok(*l),
            Some(None) => Err(format!("rank {rank} {what}: reads unset slot {buf:?}[{i}]")),
            None => Err(format!(
                "rank {rank} {what}: slot {buf:?}[{i}] is past the buffer's {} rows",
                b.buf(buf).len()
            )),
        })
        .collect()
}

fn write(
    state: &mut BTreeMap<usize, Buffers>,
    rank: usize,
    segs: &Segs,
    labels: &[Label],
    what: &str,
) -> Result<(), String> {
    if segs.rows() != labels.len() {
        return Err(format!(
            "rank {rank} {what}: {} rows arrive for {} slots",
            labels.len(),
            segs.rows()
        ));
    }
    let b = state.get_mut(&rank).expect("rank has buffers");
    for ((buf, i), l) in segs.slots().zip(labels) {
        let len = b.buf(buf).len();
        let slot = b.buf_mut(buf).get_mut(i).ok_or_else(|| {
            format!("rank {rank} {what}: slot {buf:?}[{i}] is past the buffer's {len} rows")
        })?;
        *slot = Some(*l);
    }
    Ok(())
}

/// Runs `program` from `state` to completion; returns the final buffers or the first error.
pub fn execute(
    program: &Program,
    mut state: BTreeMap<usize, Buffers>,
) -> Result<BTreeMap<usize, Buffers>, String> {
    let mut pc: BTreeMap<usize, usize> = program.ops.keys().map(|&r| (r, 0)).collect();
    let current = |pc: &BTreeMap<usize, usize>, r: usize| -> Option<&Op> {
        program.ops.get(&r).and_then(|ops| ops.get(pc[&r]))
    };
    loop {
        let mut progressed = false;
        for &rank in program.ops.keys() {
            let Some(op) = current(&pc, rank) else { continue };
            let at = format!("op {} ({op})", pc[&rank]);
            match op {
                Op::Copy { from, to } => {
                    let l = read(&state, rank, from, &at)?;
                    write(&mut state, rank, to, &l, &at)?;
                    *pc.get_mut(&rank).expect("rank") += 1;
                    progressed = true;
                }
                Op::Send { peer, rows } => {
                    if !pc.contains_key(peer) {
                        return Err(format!("rank {rank} {at}: peer {peer} has no program"));
                    }
                    if let Some(Op::Recv { peer: from, rows: into }) = current(&pc, *peer)
                        && *from == rank
                    {
                        if into.rows() != rows.rows() {
                            return Err(format!(
                                "rank {rank} {at}: sends {} rows but rank {peer} expects {}",
                                rows.rows(),
                                into.rows()
                            ));
                        }
                        let l = read(&state, rank, rows, &at)?;
                        write(&mut state, *peer, into, &l, &format!("receiving from {rank}"))?;
                        *pc.get_mut(&rank).expect("rank") += 1;
                        *pc.get_mut(peer).expect("peer") += 1;
                        progressed = true;
                    }
                }
                Op::Recv { .. } => {}
                collective => {
                    let group = collective.group().expect("collective has a group");
                    if !group.contains(&rank) {
                        return Err(format!("rank {rank} {at}: not a member of its group"));
                    }
                    // Only the lowest member drives, once everyone has arrived.
                    if group[0] != rank
                        || !group.iter().all(|&m| {
                            current(&pc, m).is_some_and(|o| same_collective(o, collective))
                        })
                    {
                        continue;
                    }
                    let ops: Vec<(usize, &Op)> =
                        group.iter().map(|&m| (m, current(&pc, m).expect("arrived"))).collect();
                    run_collective(&mut state, &ops, &at)?;
                    for &m in group {
                        *pc.get_mut(&m).expect("member") += 1;
                    }
                    progressed = true;
                }
            }
        }
        if program.ops.keys().all(|r| current(&pc, *r).is_none()) {
            return Ok(state);
        }
        if !progressed {
            let blocked: Vec<String> = program
                .ops
                .keys()
                .filter_map(|&r| {
                    current(&pc, r).map(|op| format!("rank {r} at op {} ({op})", pc[&r]))
                })
                .collect();
            return Err(format!("deadlock: {}", blocked.join("; ")));
        }
    }
}

fn same_collective(a: &Op, b: &Op) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b) && a.group() == b.group()
}

/// The send and receive lists of an all-to-all-v (members of one collective are one kind).
type A2aLists<'o> = (&'o [(usize, Segs)], &'o [(usize, Segs)]);

/// An all-to-all-v's lists, each ascending by member and inside the group (what the
/// executors' lookups and the runtime's member-order buffers rely on).
fn a2a_lists<'o>(op: &'o Op, group: &[usize]) -> Result<A2aLists<'o>, String> {
    let Op::AllToAllV { send, recv, .. } = op else {
        return Err(format!("all-to-all-v over {group:?}: another collective joined it"));
    };
    for (what, list) in [("send", send), ("receive", recv)] {
        let ascending = list.windows(2).all(|w| w[0].0 < w[1].0);
        if !ascending || list.last().is_some_and(|(i, _)| *i >= group.len()) {
            let members: Vec<usize> = list.iter().map(|(i, _)| *i).collect();
            return Err(format!(
                "all-to-all-v over {group:?}: {what} list names members {members:?}, not ascending within the group"
            ));
        }
    }
    Ok((send, recv))
}

fn run_collective(
    state: &mut BTreeMap<usize, Buffers>,
    ops: &[(usize, &Op)],
    at: &str,
) -> Result<(), String> {
    let group: Vec<usize> = ops.iter().map(|(r, _)| *r).collect();
    match ops[0].1 {
        Op::AllToAllV { .. } => {
            // Every member's lists, checked once.
            let lists: Vec<A2aLists> =
                ops.iter().map(|(_, op)| a2a_lists(op, &group)).collect::<Result<_, _>>()?;
            // The rows member `i` lists for member `j` in `list` (ascending by member).
            let rows_for = |list: &[(usize, Segs)], j: usize| match list
                .binary_search_by_key(&j, |(m, _)| *m)
            {
                Ok(k) => list[k].1.rows(),
                Err(_) => 0,
            };
            let mut inbound: Vec<Vec<Label>> = vec![Vec::new(); ops.len()];
            for (i, (r, _)) in ops.iter().enumerate() {
                let (send, recv) = lists[i];
                // Each listed send against its receiver's list, each listed receive against
                // its sender's: the rows the other end lists for this rank.
                let ends = [(send, "sends", "to", "expects"), (recv, "expects", "from", "sends")];
                for (mine, (list, did, way, other)) in ends.into_iter().enumerate() {
                    for (j, segs) in list {
                        let (their_send, their_recv) = lists[*j];
                        let theirs = rows_for([their_recv, their_send][mine], i);
                        if theirs != segs.rows() {
                            return Err(format!(
                                "all-to-all-v over {group:?}: rank {r} {did} {} rows {way} {} which {other} {theirs}",
                                segs.rows(),
                                group[*j],
                            ));
                        }
                    }
                }
                for (j, segs) in send {
                    inbound[*j].extend(read(state, *r, segs, at)?);
                }
            }
            for (j, (r, _)) in ops.iter().enumerate() {
                let mut labels = inbound[j].iter().copied();
                for (_, segs) in lists[j].1 {
                    let part: Vec<Label> = labels.by_ref().take(segs.rows()).collect();
                    write(state, *r, segs, &part, at)?;
                }
            }
        }
        Op::AllGatherV { counts, .. } => {
            let mut all = Vec::new();
            for (i, (r, op)) in ops.iter().enumerate() {
                let Op::AllGatherV { send, counts: c, .. } = op else { unreachable!() };
                if c != counts || send.rows() != counts[i] {
                    return Err(format!(
                        "all-gather-v over {group:?}: rank {r} contributes {} rows with counts {c:?}, expected counts {counts:?}",
                        send.rows()
                    ));
                }
                all.extend(read(state, *r, send, at)?);
            }
            for (r, op) in ops {
                let Op::AllGatherV { into, .. } = op else { unreachable!() };
                write(state, *r, &Segs(vec![*into]), &all, at)?;
            }
        }
        Op::Broadcast { root, .. } => {
            let root = *root;
            let Some((_, Op::Broadcast { rows, .. })) = ops.iter().find(|(r, _)| *r == root) else {
                return Err(format!("broadcast over {group:?}: root {root} is not a member"));
            };
            let l = read(state, root, rows, at)?;
            for (r, op) in ops {
                let Op::Broadcast { rows: into, root: other, .. } = op else { unreachable!() };
                if *other != root {
                    return Err(format!(
                        "broadcast over {group:?}: rank {r} expects root {other}, not {root}"
                    ));
                }
                if *r != root {
                    write(state, *r, into, &l, at)?;
                }
            }
        }
        _ => unreachable!("not a collective"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Seg;

    fn rows(buf: Buf, start: usize, len: usize) -> Segs {
        Segs(vec![Seg { buf, start, len }])
    }

    fn state(n: usize) -> BTreeMap<usize, Buffers> {
        (0..n)
            .map(|r| {
                let label = |t| Some(Label { row: RowId { sample: r, token: t }, origin: r });
                (
                    r,
                    Buffers {
                        held: vec![label(0), label(1)],
                        needed: vec![None; 2],
                        stage: vec![],
                    },
                )
            })
            .collect()
    }

    fn program(ops: Vec<(usize, Op)>) -> Program {
        let mut p = Program::for_ranks(0..2);
        for (r, op) in ops {
            p.push(r, op);
        }
        p
    }

    #[test]
    fn crossing_rendezvous_sends_deadlock() {
        let p = program(vec![
            (0, Op::Send { peer: 1, rows: rows(Buf::Held, 0, 2) }),
            (0, Op::Recv { peer: 1, rows: rows(Buf::Needed, 0, 2) }),
            (1, Op::Send { peer: 0, rows: rows(Buf::Held, 0, 2) }),
            (1, Op::Recv { peer: 0, rows: rows(Buf::Needed, 0, 2) }),
        ]);
        let e = execute(&p, state(2)).expect_err("both ranks send first");
        assert_eq!(
            e,
            "deadlock: rank 0 at op 0 (send 2 rows to 1 from H[0..2]); rank 1 at op 0 (send 2 rows to 0 from H[0..2])"
        );
    }

    #[test]
    fn ordered_exchange_completes() {
        let p = program(vec![
            (0, Op::Send { peer: 1, rows: rows(Buf::Held, 0, 2) }),
            (0, Op::Recv { peer: 1, rows: rows(Buf::Needed, 0, 2) }),
            (1, Op::Recv { peer: 0, rows: rows(Buf::Needed, 0, 2) }),
            (1, Op::Send { peer: 0, rows: rows(Buf::Held, 0, 2) }),
        ]);
        let out = execute(&p, state(2)).expect("completes");
        assert_eq!(out[&1].needed, out[&0].held);
    }

    #[test]
    fn size_mismatch_names_both_ranks() {
        let p = program(vec![
            (0, Op::Send { peer: 1, rows: rows(Buf::Held, 0, 2) }),
            (1, Op::Recv { peer: 0, rows: rows(Buf::Needed, 0, 1) }),
        ]);
        let e = execute(&p, state(2)).expect_err("2 rows into 1 slot");
        assert_eq!(
            e,
            "rank 0 op 0 (send 2 rows to 1 from H[0..2]): sends 2 rows but rank 1 expects 1"
        );
    }

    #[test]
    fn a_receive_without_send_is_a_deadlock_and_unset_reads_fail() {
        let p = program(vec![(1, Op::Recv { peer: 0, rows: rows(Buf::Needed, 0, 1) })]);
        let e = execute(&p, state(2)).expect_err("nobody sends");
        assert_eq!(e, "deadlock: rank 1 at op 0 (recv 1 rows from 0 into N[0])");
        let p = program(vec![(
            0,
            Op::Copy { from: rows(Buf::Needed, 1, 1), to: rows(Buf::Held, 0, 1) },
        )]);
        let e = execute(&p, state(2)).expect_err("needed is empty");
        assert_eq!(e, "rank 0 op 0 (copy N[1] -> H[0]): reads unset slot Needed[1]");
    }

    #[test]
    fn an_all_to_all_moves_listed_rows_and_names_mismatched_lists() {
        let group: std::sync::Arc<[usize]> = vec![0, 1].into();
        let a2a = |send: Vec<(usize, Segs)>, recv: Vec<(usize, Segs)>| Op::AllToAllV {
            group: group.clone(),
            send,
            recv,
        };
        // Rank 0 sends its two rows to rank 1; rank 1 sends none and lists no peer to.
        let p = program(vec![
            (0, a2a(vec![(1, rows(Buf::Held, 0, 2))], vec![])),
            (1, a2a(vec![], vec![(0, rows(Buf::Needed, 0, 2))])),
        ]);
        let out = execute(&p, state(2)).expect("completes");
        assert_eq!(out[&1].needed, out[&0].held);
        assert_eq!(out[&0].needed, vec![None; 2]);
        // A send its receiver does not list, and a receive its sender does not list.
        let p = program(vec![
            (0, a2a(vec![(1, rows(Buf::Held, 0, 1))], vec![])),
            (1, a2a(vec![], vec![])),
        ]);
        let e = execute(&p, state(2)).expect_err("rank 1 expects nothing");
        assert!(e.ends_with("rank 0 sends 1 rows to 1 which expects 0"), "{e}");
        let p = program(vec![
            (0, a2a(vec![], vec![])),
            (1, a2a(vec![], vec![(0, rows(Buf::Needed, 0, 1))])),
        ]);
        let e = execute(&p, state(2)).expect_err("rank 0 sends nothing");
        assert!(e.ends_with("rank 1 expects 1 rows from 0 which sends 0"), "{e}");
        // A member listed out of the group.
        let p = program(vec![
            (0, a2a(vec![(2, rows(Buf::Held, 0, 1))], vec![])),
            (1, a2a(vec![], vec![])),
        ]);
        let e = execute(&p, state(2)).expect_err("no member 2");
        assert!(e.ends_with("send list names members [2], not ascending within the group"), "{e}");
    }

    #[test]
    fn a_collective_missing_a_member_deadlocks() {
        let op = Op::Broadcast { group: vec![0, 1], root: 0, rows: rows(Buf::Held, 0, 1) };
        let p = program(vec![(0, op)]);
        let e = execute(&p, state(2)).expect_err("rank 1 never joins");
        assert!(e.starts_with("deadlock: rank 0 at op 0 (broadcast over 0-1 from 0"), "{e}");
    }
}
