//! The boundary executor: walks one rank's program of an edge plan over a communicator.
//!
//! Rows are `width` values of one element type (f32 or f64). A forward reads the held buffer (source layout) and fills
//! the needed buffer (destination layout); a backward reads gradients from the needed buffer
//! and fills the held buffer. The executor re-derives nothing: it checks the buffers against
//! the plan, allocates the stage, and performs each op in order. Point-to-point messages go
//! over the world communicator with the caller's tag; collectives over the plan's groups,
//! created up front by [`Groups::prepare`] in one global order.

use std::collections::BTreeMap;

use hetpar_comm::{CommExt, Communicator, Element};
use hetpar_layout::plan::{Buf, Op, Program, Segs};
use hetpar_layout::{Direction, EdgePlan};

use crate::error::RuntimeError;

/// Sub-communicators for the groups plans use, keyed by their world ranks.
#[derive(Default)]
pub struct Groups {
    map: BTreeMap<Vec<usize>, Box<dyn Communicator>>,
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.map.keys()).finish()
    }
}

impl Groups {
    /// No groups yet.
    pub fn new() -> Groups {
        Groups::default()
    }

    /// Creates every group of `programs` that this rank belongs to and does not have yet,
    /// in ascending order of their rank lists. A collective sits in the program of every
    /// member, so each member of a group finds it in the same step from its own share of
    /// the plans (or every rank's), and members create the groups they share in one global
    /// order: creation only involves a group's members, and a wait for the least group
    /// still unmade cannot block (no deadlock on collective creation).
    pub fn prepare<'p>(
        &mut self,
        world: &dyn Communicator,
        programs: impl IntoIterator<Item = &'p Program>,
    ) -> Result<(), RuntimeError> {
        let me = world.global_rank();
        // Borrowed, not copied: the members of a colocated world's all-to-all-v share one
        // list of every rank, which a copy per op would repeat once per member.
        let lists: std::collections::BTreeSet<&[usize]> = programs
            .into_iter()
            .flat_map(|p| p.ops.values().flatten().filter_map(Op::group))
            .collect();
        for list in lists {
            if list.contains(&me) && !self.map.contains_key(list) {
                let g = world.subgroup(list)?;
                self.map.insert(list.to_vec(), g);
            }
        }
        Ok(())
    }

    fn get(&self, list: &[usize]) -> &dyn Communicator {
        self.map.get(list).map(|b| b.as_ref()).unwrap_or_else(|| {
            panic!("group {list:?} was not prepared: call Groups::prepare with this plan first")
        })
    }
}

/// The three row buffers of a rank.
struct Rows<'a, T> {
    held: &'a mut [T],
    needed: &'a mut [T],
    stage: Vec<T>,
    width: usize,
}

impl<T: Element> Rows<'_, T> {
    fn buf(&self, b: Buf) -> &[T] {
        match b {
            Buf::Held => self.held,
            Buf::Needed => self.needed,
            Buf::Stage => &self.stage,
        }
    }

    fn buf_mut(&mut self, b: Buf) -> &mut [T] {
        match b {
            Buf::Held => self.held,
            Buf::Needed => self.needed,
            Buf::Stage => &mut self.stage,
        }
    }

    /// The rows of `segs`, concatenated.
    fn gather(&self, segs: &Segs) -> Vec<T> {
        let w = self.width;
        let mut out = Vec::with_capacity(segs.rows() * w);
        for s in &segs.0 {
            out.extend_from_slice(&self.buf(s.buf)[s.start * w..(s.start + s.len) * w]);
        }
        out
    }

    /// Writes `data` (concatenated rows) into the rows of `segs`.
    fn scatter(&mut self, segs: &Segs, data: &[T]) {
        let w = self.width;
        let mut at = 0;
        for s in &segs.0 {
            let n = s.len * w;
            self.buf_mut(s.buf)[s.start * w..s.start * w + n].copy_from_slice(&data[at..at + n]);
            at += n;
        }
        debug_assert_eq!(at, data.len());
    }
}

/// Runs this rank's `dir` program of `plan` on `held` / `needed` (rows of `width` values). P2P
/// messages use `tag` on `world` (its ranks must be world ranks). Buffers that disagree with
/// the plan are rejected before anything moves.
#[allow(clippy::too_many_arguments)]
pub fn run_boundary<T: Element>(
    world: &dyn Communicator,
    groups: &Groups,
    plan: &EdgePlan,
    dir: Direction,
    edge: &str,
    width: usize,
    tag: u32,
    held: &mut [T],
    needed: &mut [T],
) -> Result<(), RuntimeError> {
    let rank = world.global_rank();
    let geo = &plan.geometry;
    let rows_of = |m: &BTreeMap<usize, Vec<usize>>| m.get(&rank).map_or(0, Vec::len);
    for (name, len, rows) in
        [("held", held.len(), rows_of(&geo.held)), ("needed", needed.len(), rows_of(&geo.needed))]
    {
        if len != rows * width {
            return Err(RuntimeError::Boundary {
                edge: edge.to_string(),
                message: format!(
                    "rank {rank} passes {len} values as its {name} rows, the plan has {rows} rows of width {width} = {}",
                    rows * width
                ),
            });
        }
    }
    let program = plan.program(dir);
    let Some(ops) = program.ops.get(&rank) else { return Ok(()) };
    let stage = vec![T::zeroed(); program.stage_rows.get(&rank).copied().unwrap_or(0) * width];
    let mut rows = Rows { held, needed, stage, width };
    for op in ops {
        match op {
            Op::Copy { from, to } => {
                let data = rows.gather(from);
                rows.scatter(to, &data);
            }
            Op::Send { peer, rows: segs } => world.send(&rows.gather(segs), *peer, tag)?,
            Op::Recv { peer, rows: segs } => {
                let mut data = vec![T::zeroed(); segs.rows() * width];
                world.recv(&mut data, *peer, tag)?;
                rows.scatter(segs, &data);
            }
            Op::AllToAllV { group, send, recv } => {
                let g = groups.get(group);
                // The plan lists only the members a rank exchanges rows with, ascending; the
                // communicator takes a count for every member, in member order.
                let counts = |list: &[(usize, Segs)]| {
                    let mut c = vec![0; group.len()];
                    for (i, s) in list {
                        c[*i] = s.rows() * width;
                    }
                    c
                };
                debug_assert!(
                    [send, recv].iter().all(|l| l.windows(2).all(|w| w[0].0 < w[1].0)),
                    "an all-to-all-v's lists ascend by member"
                );
                let (sc, rc) = (counts(send), counts(recv));
                let data: Vec<T> = send.iter().flat_map(|(_, s)| rows.gather(s)).collect();
                let mut incoming = vec![T::zeroed(); rc.iter().sum()];
                g.all_to_all_v(&data, &sc, &mut incoming, &rc)?;
                let mut at = 0;
                for (_, segs) in recv {
                    let n = segs.rows() * width;
                    rows.scatter(segs, &incoming[at..at + n]);
                    at += n;
                }
            }
            Op::AllGatherV { group, send, counts, into } => {
                let g = groups.get(group);
                let data = rows.gather(send);
                let counts: Vec<usize> = counts.iter().map(|c| c * width).collect();
                let mut all = vec![T::zeroed(); counts.iter().sum()];
                g.all_gather_v(&data, &mut all, &counts)?;
                rows.scatter(&Segs(vec![*into]), &all);
            }
            Op::Broadcast { group, root, rows: segs } => {
                let g = groups.get(group);
                let root_idx = group.iter().position(|r| r == root).expect("root is a member");
                let mut data = if rank == *root {
                    rows.gather(segs)
                } else {
                    vec![T::zeroed(); segs.rows() * width]
                };
                g.broadcast(&mut data, root_idx)?;
                if rank != *root {
                    rows.scatter(segs, &data);
                }
            }
        }
    }
    Ok(())
}
