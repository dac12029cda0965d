//! The validator: static matching checks, then simulated execution with durations.
//!
//! Static checks: every message is posted exactly once by each of its participants, with the
//! same participant list and matching roles (a send has its receive); every stage runs each
//! microbatch's forward once, before its backward; every boundary forward has its backward.
//! Then the schedule is executed on a clock: a compute action takes its duration; a
//! communication action posts its messages at its start and ends when all of them complete;
//! a message completes when its last participant posts it, plus its transfer time. A state
//! where no rank can move is a deadlock, reported with every blocked rank, its action and
//! the ranks it waits for.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use hetpar_layout::{Direction, ModuleId};

use crate::action::{Action, MsgId, Pass, Role};
use crate::build::Schedule;
use crate::error::ScheduleError;

/// How long things take.
pub trait Durations {
    /// Local time of `action` on `rank` (compute, step, offload); communication actions
    /// usually 0, their time comes from their messages.
    fn action(&self, rank: usize, action: &Action) -> f64;
    /// Transfer time of a message once every participant has posted it.
    fn message(&self, msg: &MsgId) -> f64;
}

/// Unit durations: every pass, step, offload and reload takes 1; a boundary transform and a
/// gradient reduction take 1; pipeline messages take 0 (they overlap with compute).
#[derive(Clone, Copy, Debug, Default)]
pub struct UnitDurations;

impl Durations for UnitDurations {
    fn action(&self, _rank: usize, action: &Action) -> f64 {
        match action {
            Action::Compute(_) | Action::Step(_) | Action::Offload(_) | Action::Reload(_) => 1.0,
            _ => 0.0,
        }
    }

    fn message(&self, msg: &MsgId) -> f64 {
        match msg {
            MsgId::Boundary { .. } | MsgId::Reduce { .. } => 1.0,
            MsgId::Act { .. } | MsgId::Grad { .. } => 0.0,
        }
    }
}

/// When each action ran.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// Per rank, `(start, end, busy)` of each action in schedule order; `busy` is the part
    /// of `[start, end)` spent working (the rest is waiting), ending at `end`.
    pub spans: BTreeMap<usize, Vec<(f64, f64, f64)>>,
    /// End of the last action.
    pub makespan: f64,
}

impl Timeline {
    /// Time `rank` spends working.
    pub fn busy(&self, rank: usize) -> f64 {
        self.spans[&rank].iter().map(|s| s.2).sum()
    }

    /// Idle time over all ranks divided by `ranks * makespan`.
    pub fn bubble_fraction(&self) -> f64 {
        if self.makespan <= 0.0 {
            return 0.0;
        }
        let idle: f64 = self.spans.keys().map(|&r| self.makespan - self.busy(r)).sum();
        idle / (self.spans.len() as f64 * self.makespan)
    }
}

/// Where a message is posted: rank, action index, role, participants.
type PostSite<'a> = (usize, usize, Role, &'a [usize]);

fn invalid(s: &Schedule, rank: usize, index: usize, problem: String) -> ScheduleError {
    let action =
        s.ranks[&rank].get(index).map_or_else(|| "end".to_string(), |a| s.labels.action(a));
    ScheduleError::Invalid { rank, index, action, problem }
}

fn ascending(parts: &[usize]) -> bool {
    parts.windows(2).all(|w| w[0] < w[1])
}

fn unordered(parts: &[usize], msg: &str) -> String {
    format!("lists participants {parts:?} for {msg}, not ascending")
}

/// Static checks; see the module docs.
pub fn check(s: &Schedule) -> Result<(), ScheduleError> {
    // Every post of every message.
    let mut posts: BTreeMap<MsgId, Vec<PostSite<'_>>> = BTreeMap::new();
    for (&rank, actions) in &s.ranks {
        for (i, a) in actions.iter().enumerate() {
            for p in a.posts() {
                // Membership by binary search, which needs the ascending order the
                // participants are listed in: a list out of order is named as such.
                if p.participants.binary_search(&rank).is_err() {
                    let msg = s.labels.message(&p.msg);
                    let parts = &p.participants;
                    let problem = if ascending(parts) {
                        format!("posts {msg} but is not among its participants {parts:?}")
                    } else {
                        unordered(parts, &msg)
                    };
                    return Err(invalid(s, rank, i, problem));
                }
                posts.entry(p.msg).or_default().push((rank, i, p.role, &p.participants));
            }
        }
    }
    for (msg, list) in &posts {
        let (r0, i0, _, parts) = list[0];
        if !ascending(parts) {
            return Err(invalid(s, r0, i0, unordered(parts, &s.labels.message(msg))));
        }
        let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
        for &(rank, i, role, p) in list {
            // Posts built from one shared list are equal without a look at thousands of ranks.
            if !std::ptr::eq(p, parts) && p != parts {
                return Err(invalid(
                    s,
                    rank,
                    i,
                    format!(
                        "lists participants {p:?} for {}, rank {r0} lists {parts:?}",
                        s.labels.message(msg)
                    ),
                ));
            }
            if let Some(first) = seen.insert(rank, i) {
                return Err(invalid(
                    s,
                    rank,
                    i,
                    format!("posts {} again (first at action {first})", s.labels.message(msg)),
                ));
            }
            let expected = match *msg {
                MsgId::Act { from, .. } | MsgId::Grad { from, .. } => {
                    Some(if rank == from { Role::Send } else { Role::Recv })
                }
                // Every member of a reduction takes part alike (the activation floor's clocks
                // count its members).
                MsgId::Reduce { .. } => Some(Role::Member),
                MsgId::Boundary { .. } => None,
            };
            if expected.is_some_and(|e| e != role) {
                return Err(invalid(
                    s,
                    rank,
                    i,
                    format!("has the wrong side of {}", s.labels.message(msg)),
                ));
            }
        }
        if let Some(&missing) = parts.iter().find(|r| !seen.contains_key(r)) {
            return Err(invalid(
                s,
                r0,
                i0,
                format!("rank {missing} never posts {}", s.labels.message(msg)),
            ));
        }
    }
    // Passes: per (rank, module, vstage) each microbatch forward once, then backward once.
    for (&rank, actions) in &s.ranks {
        let mut fwd: HashMap<(ModuleId, usize, usize), usize> = HashMap::new();
        let mut bwd: HashMap<(ModuleId, usize, usize), usize> = HashMap::new();
        for (i, a) in actions.iter().enumerate() {
            if let Action::Compute(c) = a {
                let key = (c.module, c.vstage, c.mb);
                let map = if c.pass == Pass::Forward { &mut fwd } else { &mut bwd };
                if let Some(first) = map.insert(key, i) {
                    return Err(invalid(s, rank, i, format!("repeats action {first}")));
                }
                if c.pass == Pass::Backward && !fwd.contains_key(&key) {
                    return Err(invalid(
                        s,
                        rank,
                        i,
                        "runs before the forward of the same microbatch and stage".into(),
                    ));
                }
            }
        }
        let stages: BTreeSet<(ModuleId, usize)> =
            fwd.keys().chain(bwd.keys()).map(|k| (k.0, k.1)).collect();
        for (module, vstage) in stages {
            let backward = s.backward.get(module).copied().unwrap_or(true);
            if !backward && let Some(&i) = bwd.keys().find(|k| k.0 == module).map(|k| &bwd[k]) {
                return Err(invalid(
                    s,
                    rank,
                    i,
                    format!(
                        "runs a backward of {}, which runs forwards only",
                        s.labels.modules[module]
                    ),
                ));
            }
            for mb in 0..s.microbatches {
                let passes: &[(&HashMap<_, _>, &str)] = if backward {
                    &[(&fwd, "forward"), (&bwd, "backward")]
                } else {
                    &[(&fwd, "forward")]
                };
                for &(map, what) in passes {
                    if !map.contains_key(&(module, vstage, mb)) {
                        return Err(invalid(
                            s,
                            rank,
                            actions.len(),
                            format!(
                                "never runs the {what} of {} stage {vstage} mb {mb}",
                                s.labels.modules[module]
                            ),
                        ));
                    }
                }
            }
        }
    }
    // Boundary transforms: each forward has its backward exactly when the edge's source
    // runs backwards.
    for msg in posts.keys() {
        if let MsgId::Boundary { edge, mb, dir } = *msg {
            let src = s.labels.edge_src[edge];
            let backward = s.backward.get(src).copied().unwrap_or(true);
            let (r, i, _, _) = posts[msg][0];
            let has_bwd =
                posts.contains_key(&MsgId::Boundary { edge, mb, dir: Direction::Backward });
            if dir == Direction::Forward && backward && !has_bwd {
                return Err(invalid(s, r, i, "this boundary forward has no backward".into()));
            }
            if dir == Direction::Backward && !backward {
                return Err(invalid(
                    s,
                    r,
                    i,
                    format!(
                        "carries gradients into {}, which runs forwards only",
                        s.labels.modules[src]
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Runs `s` on a clock with `durations`. Run [`check`] first: this only finds deadlocks.
pub fn simulate(s: &Schedule, durations: &dyn Durations) -> Result<Timeline, ScheduleError> {
    let mut pc: BTreeMap<usize, usize> = s.ranks.keys().map(|&r| (r, 0)).collect();
    let mut clock: BTreeMap<usize, f64> = s.ranks.keys().map(|&r| (r, 0.0)).collect();
    let mut spans: BTreeMap<usize, Vec<(f64, f64, f64)>> =
        s.ranks.keys().map(|&r| (r, Vec::new())).collect();
    // Post times of each message so far, and whether each rank posted its current action.
    let mut posted: HashMap<MsgId, Vec<(usize, f64)>> = HashMap::new();
    let mut has_posted: BTreeMap<usize, bool> = s.ranks.keys().map(|&r| (r, false)).collect();
    loop {
        let mut progressed = false;
        for (&rank, actions) in &s.ranks {
            while let Some(action) = actions.get(pc[&rank]) {
                let start = clock[&rank];
                if !has_posted[&rank] {
                    for p in action.posts() {
                        posted.entry(p.msg).or_default().push((rank, start));
                    }
                    has_posted.insert(rank, true);
                }
                // Completion time of each posted message, if complete.
                let mut end = start + durations.action(rank, action);
                let mut comm: f64 = 0.0;
                let mut done = true;
                for p in action.posts() {
                    let got = &posted[&p.msg];
                    if got.len() < p.participants.len() {
                        done = false;
                        break;
                    }
                    let d = durations.message(&p.msg);
                    let ready = got.iter().map(|x| x.1).fold(0.0, f64::max) + d;
                    end = end.max(ready);
                    comm = comm.max(d);
                }
                if !done {
                    break;
                }
                let busy = durations.action(rank, action).max(comm).min(end - start);
                spans.get_mut(&rank).expect("rank").push((start, end, busy));
                clock.insert(rank, end);
                *pc.get_mut(&rank).expect("rank") += 1;
                has_posted.insert(rank, false);
                progressed = true;
            }
        }
        if s.ranks.iter().all(|(r, a)| pc[r] == a.len()) {
            let makespan = clock.values().copied().fold(0.0, f64::max);
            return Ok(Timeline { spans, makespan });
        }
        if !progressed {
            return Err(deadlock(s, &pc, &posted));
        }
    }
}

/// Describes a stuck state by its wait-for cycle (or the finished rank that never posted),
/// then counts the other blocked ranks.
fn deadlock(
    s: &Schedule,
    pc: &BTreeMap<usize, usize>,
    posted: &HashMap<MsgId, Vec<(usize, f64)>>,
) -> ScheduleError {
    let waits_for = |rank: usize| -> Vec<usize> {
        let Some(action) = s.ranks[&rank].get(pc[&rank]) else { return Vec::new() };
        let mut w: BTreeSet<usize> = BTreeSet::new();
        for p in action.posts() {
            let got: BTreeSet<usize> =
                posted.get(&p.msg).map(|v| v.iter().map(|x| x.0).collect()).unwrap_or_default();
            w.extend(p.participants.iter().filter(|r| !got.contains(r)));
        }
        w.into_iter().collect()
    };
    let describe = |rank: usize| -> String {
        let action = &s.ranks[&rank][pc[&rank]];
        let w: Vec<String> = waits_for(rank).iter().map(ToString::to_string).collect();
        format!(
            "rank {rank} at action {} ({}) waits for rank {}",
            pc[&rank],
            s.labels.action(action),
            w.join(", ")
        )
    };
    let blocked: Vec<usize> =
        s.ranks.iter().filter(|(r, a)| pc[*r] < a.len()).map(|(r, _)| *r).collect();
    let mut path = vec![blocked[0]];
    let lines = loop {
        let here = *path.last().expect("non-empty path");
        let next = waits_for(here)[0];
        if pc[&next] >= s.ranks[&next].len() {
            break vec![
                describe(here),
                format!("rank {next} has finished without posting its part"),
            ];
        }
        if let Some(i) = path.iter().position(|&r| r == next) {
            break path[i..].iter().map(|&r| describe(r)).collect::<Vec<_>>();
        }
        path.push(next);
    };
    let others = blocked.len().saturating_sub(lines.len());
    let more = if others > 0 { format!(" ({others} more ranks blocked)") } else { String::new() };
    ScheduleError::Deadlock(format!("{}{more}", lines.join("; ")))
}

/// [`check`], then [`simulate`].
pub fn validate(s: &Schedule, durations: &dyn Durations) -> Result<Timeline, ScheduleError> {
    check(s)?;
    simulate(s, durations)
}
