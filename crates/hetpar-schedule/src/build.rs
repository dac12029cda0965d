//! Schedule builders: three-phase colocated and graph-aware 1F1B (SEMANTICS.md section 5).
//!
//! A builder decides compute orders per stage (`order.rs`); communication follows from them.
//! Before each compute a rank posts what it must receive, together with what the previous
//! compute produced for others, as one communication action (a batch of isend/irecv and a
//! wait, Megatron's `send_forward_recv_backward` generalized). Posting sends and receives
//! together is never more constrained than posting them one by one in either order, so a
//! deadlock can only come from the compute orders themselves, which the validator checks.
//! A boundary transform is different: a program of blocking steps, not a message that
//! completes with the others. So an action carrying one and anything else is split into
//! pieces in an order derived from the schedule itself (`one_transform_per_action`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hetpar_layout::{Direction, ModuleId};

use crate::action::{Action, Compute, Labels, MsgId, Pass, Post, Role};
use crate::error::ScheduleError;
use crate::graph::{PipelineGraph, ScheduleKind};
use crate::{order, warmup};

/// What to schedule besides the passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Append gradient reduction and the optimizer step of every module.
    pub optimizer: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { optimizer: true }
    }
}

/// One training step as per-rank action lists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Which family built it.
    pub kind: ScheduleKind,
    /// Microbatches per step.
    pub microbatches: usize,
    /// Names for printing.
    pub labels: Labels,
    /// Per module: whether it runs backward passes (frozen modules that nothing trainable
    /// feeds run forwards only, and their outgoing edges carry no gradients).
    pub backward: Vec<bool>,
    /// Every rank's actions, in order.
    pub ranks: BTreeMap<usize, Vec<Action>>,
}

impl Schedule {
    /// The forward half of this schedule, for evaluation: every forward and the messages
    /// and boundary transforms that carry activations, in the same order on each rank;
    /// backwards, gradient messages, reductions, optimizer steps and offloads dropped. It
    /// deadlocks no more than the whole does: both sides of every message it keeps are
    /// kept, and each rank runs them in the order the whole ran them.
    pub fn forward_only(&self) -> Schedule {
        let forward = |p: &Post| match p.msg {
            MsgId::Act { .. } => true,
            MsgId::Boundary { dir, .. } => dir == Direction::Forward,
            MsgId::Grad { .. } | MsgId::Reduce { .. } => false,
        };
        let ranks = self
            .ranks
            .iter()
            .map(|(&r, actions)| {
                let kept = actions
                    .iter()
                    .filter_map(|a| match a {
                        Action::Compute(c) if c.pass == Pass::Forward => Some(a.clone()),
                        Action::Comm(posts) => {
                            let p: Vec<Post> =
                                posts.iter().filter(|p| forward(p)).cloned().collect();
                            (!p.is_empty()).then_some(Action::Comm(p))
                        }
                        Action::Boundary(p) if forward(p) => Some(a.clone()),
                        _ => None,
                    })
                    .collect();
                (r, kept)
            })
            .collect();
        Schedule { ranks, backward: vec![false; self.backward.len()], ..self.clone() }
    }

    /// The schedule of `graph`: three-phase when modules share ranks, graph-aware 1F1B when
    /// every module has its own island.
    pub fn build(graph: &PipelineGraph, opts: Options) -> Result<Schedule, ScheduleError> {
        let mut b = Builder::new(graph);
        match graph.kind() {
            ScheduleKind::ThreePhase => b.three_phase(),
            ScheduleKind::GraphAware => b.graph_aware()?,
        }
        one_transform_per_action(&mut b.out);
        if opts.optimizer {
            b.optimizer();
        }
        Ok(Schedule {
            kind: graph.kind(),
            microbatches: graph.microbatches(),
            labels: graph.labels(),
            backward: (0..graph.modules().len()).map(|m| graph.has_backward(m)).collect(),
            ranks: b.out,
        })
    }
}

struct Builder<'g> {
    g: &'g PipelineGraph,
    out: BTreeMap<usize, Vec<Action>>,
    /// Each edge's boundary participants, worked out once and shared by every post.
    boundary: Vec<Arc<[usize]>>,
}

impl<'g> Builder<'g> {
    fn new(g: &'g PipelineGraph) -> Self {
        Builder {
            g,
            out: g.ranks().into_iter().map(|r| (r, Vec::new())).collect(),
            boundary: (0..g.edges().len()).map(|e| g.boundary_participants(e).into()).collect(),
        }
    }

    fn push(&mut self, rank: usize, a: Action) {
        self.out.get_mut(&rank).expect("rank of the graph").push(a);
    }

    fn boundary_post(&self, edge: usize, mb: usize, dir: Direction, role: Role) -> Post {
        Post {
            msg: MsgId::Boundary { edge, mb, dir },
            role,
            participants: Arc::clone(&self.boundary[edge]),
        }
    }

    fn edges_into(&self, m: ModuleId) -> Vec<usize> {
        (0..self.g.edges().len()).filter(|&e| self.g.edges()[e].1 == m).collect()
    }

    fn edges_out_of(&self, m: ModuleId) -> Vec<usize> {
        (0..self.g.edges().len()).filter(|&e| self.g.edges()[e].0 == m).collect()
    }

    /// What `rank` must receive before `c`. Boundary messages only when `inline`.
    fn recvs(&self, rank: usize, c: &Compute, inline: bool) -> Vec<Post> {
        let m = &self.g.modules()[c.module];
        let last = m.n_vstages() - 1;
        let p2p = |peer: usize, msg: MsgId| Post {
            msg,
            role: Role::Recv,
            participants: sorted(rank, peer),
        };
        match c.pass {
            Pass::Forward if c.vstage > 0 => {
                let from = m.peer(rank, c.vstage - 1);
                vec![p2p(
                    from,
                    MsgId::Act { module: c.module, vstage: c.vstage - 1, mb: c.mb, from, to: rank },
                )]
            }
            Pass::Backward if c.vstage < last => {
                let from = m.peer(rank, c.vstage + 1);
                vec![p2p(
                    from,
                    MsgId::Grad {
                        module: c.module,
                        vstage: c.vstage + 1,
                        mb: c.mb,
                        from,
                        to: rank,
                    },
                )]
            }
            Pass::Forward if inline => self
                .edges_into(c.module)
                .into_iter()
                .map(|e| self.boundary_post(e, c.mb, Direction::Forward, Role::Recv))
                .collect(),
            Pass::Backward if inline => self
                .edges_out_of(c.module)
                .into_iter()
                .map(|e| self.boundary_post(e, c.mb, Direction::Backward, Role::Recv))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What `rank` sends after `c`. Boundary messages only when `inline`.
    fn sends(&self, rank: usize, c: &Compute, inline: bool) -> Vec<Post> {
        let m = &self.g.modules()[c.module];
        let last = m.n_vstages() - 1;
        let p2p = |peer: usize, msg: MsgId| Post {
            msg,
            role: Role::Send,
            participants: sorted(rank, peer),
        };
        match c.pass {
            Pass::Forward if c.vstage < last => {
                let to = m.peer(rank, c.vstage + 1);
                vec![p2p(
                    to,
                    MsgId::Act { module: c.module, vstage: c.vstage, mb: c.mb, from: rank, to },
                )]
            }
            Pass::Backward if c.vstage > 0 => {
                let to = m.peer(rank, c.vstage - 1);
                vec![p2p(
                    to,
                    MsgId::Grad { module: c.module, vstage: c.vstage, mb: c.mb, from: rank, to },
                )]
            }
            Pass::Forward if inline => self
                .edges_out_of(c.module)
                .into_iter()
                .map(|e| self.boundary_post(e, c.mb, Direction::Forward, Role::Send))
                .collect(),
            Pass::Backward if inline => self
                .edges_into(c.module)
                .into_iter()
                .filter(|&e| self.g.has_backward(self.g.edges()[e].0))
                .map(|e| self.boundary_post(e, c.mb, Direction::Backward, Role::Send))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Appends, on every rank of `module`, the compute order `order(stage)` with its
    /// communication; everything posted inside the segment completes inside it.
    fn segment(
        &mut self,
        module: ModuleId,
        inline: bool,
        order: impl Fn(usize) -> Vec<Vec<Compute>>,
    ) {
        let layout = self.g.modules()[module].layout.clone();
        for rank in layout.span().ranks() {
            let stage = layout.coords(rank).expect("rank of the module").pp_idx;
            let mut pending: Vec<Post> = Vec::new();
            for group in order(stage) {
                for c in &group {
                    pending.extend(self.recvs(rank, c, inline));
                }
                if !pending.is_empty() {
                    self.push(rank, Action::Comm(std::mem::take(&mut pending)));
                }
                for c in &group {
                    self.push(rank, Action::Compute(*c));
                    pending.extend(self.sends(rank, c, inline));
                }
            }
            if !pending.is_empty() {
                self.push(rank, Action::Comm(pending));
            }
        }
    }

    /// Standalone boundary transforms of `edges` for every microbatch, edge-major; backward
    /// ones only for edges whose source runs backwards.
    fn boundaries(&mut self, edges: &[usize], dir: Direction) {
        for &e in edges {
            if dir == Direction::Backward && !self.g.has_backward(self.g.edges()[e].0) {
                continue;
            }
            for mb in 0..self.g.microbatches() {
                for &rank in self.boundary[e].clone().iter() {
                    let (src, _) = self.g.edges()[e];
                    let on_src = self.g.modules()[src].layout.span().contains(rank);
                    let role = match (dir, on_src) {
                        (Direction::Forward, true) | (Direction::Backward, false) => Role::Send,
                        _ => Role::Recv,
                    };
                    let post = self.boundary_post(e, mb, dir, role);
                    self.push(rank, Action::Boundary(post));
                }
            }
        }
    }

    fn module_vstages(&self, module: ModuleId, stage: usize) -> Vec<usize> {
        let m = &self.g.modules()[module];
        (0..m.vpp).map(|chunk| chunk * m.layout.pp() + stage).collect()
    }

    /// The sink's pipeline order for `stage` with `warmup` plain-1F1B warmup forwards.
    fn sink_order(&self, stage: usize, warmup: usize) -> Vec<Vec<Compute>> {
        let sink = self.g.sink();
        let m = &self.g.modules()[sink];
        let n = self.g.microbatches();
        if m.vpp > 1 {
            order::interleaved(sink, stage, m.layout.pp(), m.vpp, n)
        } else {
            order::one_f_one_b(sink, stage, n, warmup)
        }
    }

    /// (1) encoder forwards and forward transforms, (2) the LLM pipeline, (3) backward
    /// transforms and encoder backwards, in dependency order.
    fn three_phase(&mut self) {
        let sink = self.g.sink();
        let n = self.g.microbatches();
        let encoders: Vec<ModuleId> =
            self.g.topo_order().iter().copied().filter(|&m| m != sink).collect();
        for &m in &encoders {
            self.boundaries(&self.edges_into(m), Direction::Forward);
            let vstages = |s| self.module_vstages(m, s);
            let orders: Vec<Vec<usize>> =
                (0..self.g.modules()[m].layout.pp()).map(vstages).collect();
            self.segment(m, false, |s| order::forwards(m, &orders[s], n));
        }
        self.boundaries(&self.edges_into(sink), Direction::Forward);
        for &m in &encoders {
            if self.g.modules()[m].offload {
                for r in self.g.modules()[m].layout.span().ranks() {
                    self.push(r, Action::Offload(m));
                }
            }
        }
        let p = self.g.modules()[sink].layout.pp();
        let orders: Vec<Vec<Vec<Compute>>> =
            (0..p).map(|s| self.sink_order(s, p - s - 1)).collect();
        self.segment(sink, false, |s| orders[s].clone());
        for &m in &encoders {
            if self.g.modules()[m].offload {
                for r in self.g.modules()[m].layout.span().ranks() {
                    self.push(r, Action::Reload(m));
                }
            }
        }
        self.boundaries(&self.edges_into(sink), Direction::Backward);
        for &m in encoders.iter().rev().filter(|&&m| self.g.has_backward(m)) {
            let vstages = |s| self.module_vstages(m, s);
            let orders: Vec<Vec<usize>> =
                (0..self.g.modules()[m].layout.pp()).map(vstages).collect();
            self.segment(m, false, |s| order::backwards(m, &orders[s], n));
            self.boundaries(&self.edges_into(m), Direction::Backward);
        }
    }

    /// One 1F1B over the stage graph, warmups from `warmup.rs`. Boundary transforms are
    /// posted inline: a merge waits for all its inputs, a branch feeds all its outputs.
    /// A module that runs no backward keeps only its forwards, in the same order.
    fn graph_aware(&mut self) -> Result<(), ScheduleError> {
        let mut orders = warmup::graph_aware_orders(self.g)?;
        for (&(m, _), order) in orders.iter_mut() {
            if !self.g.has_backward(m) {
                order.retain_mut(|group| {
                    group.retain(|c| c.pass == Pass::Forward);
                    !group.is_empty()
                });
            }
        }
        for &m in self.g.topo_order() {
            self.segment(m, true, |s| orders[&(m, s)].clone());
        }
        Ok(())
    }

    /// Gradient reduction over each trainable module's dp x cp group, then every optimizer
    /// step; a frozen module has neither.
    fn optimizer(&mut self) {
        let order: Vec<ModuleId> = self
            .g
            .topo_order()
            .iter()
            .copied()
            .filter(|&m| self.g.modules()[m].trainable)
            .collect();
        for &m in &order {
            // Each group's list once, shared by its members' posts, each rank's in rank order.
            let mut of_rank: BTreeMap<usize, Arc<[usize]>> = BTreeMap::new();
            for group in self.g.reduce_groups(m) {
                let shared: Arc<[usize]> = group.into();
                of_rank.extend(shared.iter().map(|&r| (r, Arc::clone(&shared))));
            }
            for (r, participants) in of_rank {
                let msg = MsgId::Reduce { module: m, group: participants[0] };
                self.push(r, Action::Reduce(Post { msg, role: Role::Member, participants }));
            }
        }
        for &m in &order {
            for r in self.g.modules()[m].layout.span().ranks() {
                self.push(r, Action::Step(m));
            }
        }
    }
}

/// Splits every communication action that carries a boundary transform and anything else
/// into pieces run one after another: each transform alone, its point-to-point messages in
/// one batch per completion round. The rounds come from running the schedule with the
/// validator's semantics (a message completes once every participant is at an action
/// posting it; an action ends when all its messages have); every rank orders its pieces by
/// (round, point-to-point before transforms, message), one global order, so the pieces of a
/// round only ever wait on pieces of the same round.
fn one_transform_per_action(out: &mut BTreeMap<usize, Vec<Action>>) {
    let is_transform = |p: &Post| matches!(p.msg, MsgId::Boundary { .. });
    let mixed = |a: &Action| {
        let n = a.posts().iter().filter(|p| is_transform(p)).count();
        n > 0 && a.posts().len() > 1
    };
    if !out.values().flatten().any(mixed) {
        return;
    }
    let ranks: Vec<usize> = out.keys().copied().collect();
    let mut at: BTreeMap<usize, usize> = ranks.iter().map(|&r| (r, 0)).collect();
    // Messages of each rank's current action not yet complete.
    let mut open: BTreeMap<usize, Vec<MsgId>> = BTreeMap::new();
    let mut round_of: HashMap<(usize, usize, MsgId), usize> = HashMap::new();
    let mut round = 0;
    loop {
        let mut progress = false;
        for &r in &ranks {
            while let Some(a) = out[&r].get(at[&r]) {
                let msgs =
                    open.entry(r).or_insert_with(|| a.posts().iter().map(|p| p.msg).collect());
                if !msgs.is_empty() {
                    break;
                }
                open.remove(&r);
                *at.get_mut(&r).expect("rank") += 1;
                progress = true;
            }
        }
        // A message completes once every participant is at an action posting it: as many
        // ranks offer it as it has participants (each posts it once; the validator names a
        // rank that posts a message it is not a participant of). Counted once per message,
        // not per participant pair: boundary transforms span thousands of ranks.
        let mut offered: HashMap<MsgId, usize> = HashMap::new();
        for m in open.values().flatten() {
            *offered.entry(*m).or_insert(0) += 1;
        }
        let mut done: Vec<(usize, MsgId)> = Vec::new();
        for (&r, msgs) in &open {
            let a = &out[&r][at[&r]];
            for m in msgs {
                let p = a.posts().iter().find(|p| p.msg == *m).expect("posted");
                if offered[m] == p.participants.len() {
                    done.push((r, *m));
                }
            }
        }
        for (r, m) in done {
            round_of.insert((r, at[&r], m), round);
            open.get_mut(&r).expect("open").retain(|x| *x != m);
            progress = true;
        }
        round += 1;
        if !progress {
            break;
        }
    }
    for (&r, actions) in out.iter_mut() {
        let mut split = Vec::with_capacity(actions.len());
        for (i, a) in std::mem::take(actions).into_iter().enumerate() {
            if !mixed(&a) {
                split.push(a);
                continue;
            }
            // Pieces keyed by (round, transform?, message); a never-completed message (a
            // deadlock the validator names) sorts last.
            let mut pieces: BTreeMap<(usize, bool, Option<MsgId>), Vec<Post>> = BTreeMap::new();
            for p in a.posts() {
                let k = round_of.get(&(r, i, p.msg)).copied().unwrap_or(usize::MAX);
                let key = if is_transform(p) { (k, true, Some(p.msg)) } else { (k, false, None) };
                pieces.entry(key).or_default().push(p.clone());
            }
            split.extend(pieces.into_values().map(Action::Comm));
        }
        *actions = split;
    }
}

fn sorted(a: usize, b: usize) -> Arc<[usize]> {
    Arc::new(if a < b { [a, b] } else { [b, a] })
}
