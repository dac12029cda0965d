//! What ranks must hold at once: the activations a forward keeps for its backward, summed
//! over a set of ranks that share memory, at the moment of the step where every execution
//! of the schedule holds the most.
//!
//! A rank holds, after its first `j` actions, the weights of the forwards among them whose
//! backward is not among them (modules that run no backward hold nothing). One rank alone
//! passes through every such prefix, so its largest prefix is held in every execution. For
//! several ranks the schedule fixes only a partial order: when rank `r` has done exactly `i`
//! actions, rank `r'` has done at least the actions that must precede them (a receive
//! follows its send; a gradient reduction completes after every member joined) and at most
//! those that need nothing `r` has not posted yet. So `r'` holds at least its least prefix
//! in that window, and the sum over the set at `r`'s moment is a floor of what any execution
//! holds then; the rank whose moment it is may hold more inside its next pass
//! ([`Keeps::during`]). Passes that run collectives inside them order their ranks too,
//! where the caller says so ([`Keeps::lockstep`]: a tensor-parallel group's forward
//! completes on no rank before every rank of the group has begun it). Boundary transforms
//! and completed sends add no order: which ranks a boundary rank exchanges with depends on
//! the routing plan, and a send may complete before its receive is posted. Leaving order
//! out widens the windows, so the floor stays a floor.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::action::{Action, Compute, MsgId, Pass, Role};
use crate::build::Schedule;

/// The most a set of ranks holds at once in every execution of a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Held {
    /// The sum over the set at that moment (the weights' unit).
    pub total: f64,
    /// The moment: this rank has completed `after` of its actions.
    pub rank: usize,
    /// Actions of `rank` completed at the moment.
    pub after: usize,
    /// What `rank` holds then inside its next pass on top of its completed actions
    /// ([`Keeps::during`]; included in `total`).
    pub during: f64,
    /// The floor of each rank of the set at that moment.
    pub per_rank: BTreeMap<usize, f64>,
}

/// What each pass of a schedule keeps, and which ranks run a pass together: the input of
/// [`held`].
pub trait Keeps {
    /// What forward `c` on `rank` keeps until the backward of the same module, virtual
    /// stage and microbatch on that rank.
    fn kept(&self, rank: usize, c: &Compute) -> f64;

    /// What `rank` holds on top of that, at some moment while it runs pass `c` (a
    /// recomputed forward's activations, alive when its backward begins). None by default.
    fn during(&self, _rank: usize, _c: &Compute) -> f64 {
        0.0
    }

    /// The ranks pass `c` of `rank` waits for inside it (collectives), so that it completes
    /// only after each of them has begun the same pass. None by default. Where every rank
    /// of such a group names all the others, the group's moments count too (just before its
    /// first rank completes the pass, all are inside it).
    fn lockstep(&self, _rank: usize, _c: &Compute) -> Vec<usize> {
        Vec::new()
    }
}

/// What `ranks` (of `s`) hold at once at the worst moment every execution passes through,
/// by what each pass `keeps`. Ranks outside the schedule hold nothing. See the module docs
/// for what "every execution" allows.
pub fn held(s: &Schedule, ranks: &[usize], keeps: &dyn Keeps) -> Held {
    let set: Vec<usize> = ranks.iter().copied().filter(|r| s.ranks.contains_key(r)).collect();
    let prefix: BTreeMap<usize, Vec<f64>> =
        set.iter().map(|&r| (r, prefix_held(s, r, keeps))).collect();
    let mins: BTreeMap<usize, RangeMin> =
        prefix.iter().map(|(&r, p)| (r, RangeMin::new(p))).collect();
    let clocks = Clocks::new(s, &set, keeps);
    let position: HashMap<usize, usize> = set.iter().enumerate().map(|(x, &r)| (r, x)).collect();
    // The floor at a moment where each rank of `fixed` has completed exactly its count of
    // actions (and may be inside the next).
    let at = |fixed: &[(usize, usize)]| -> BTreeMap<usize, f64> {
        set.iter()
            .enumerate()
            .map(|(y, &o)| {
                if let Some(&(_, i)) = fixed.iter().find(|f| f.0 == o) {
                    return (o, prefix[&o][i]);
                }
                let lo = fixed.iter().map(|&(g, i)| clocks.known(g, i, y)).max().unwrap_or(0);
                let hi = fixed
                    .iter()
                    .filter_map(|&(g, i)| position.get(&g).map(|&x| clocks.possible(o, x, i)))
                    .min()
                    .unwrap_or(usize::MAX);
                (o, mins[&o].min(lo, hi.max(lo)))
            })
            .collect()
    };
    let mut best = Held {
        total: 0.0,
        rank: set.first().copied().unwrap_or(0),
        after: 0,
        during: 0.0,
        per_rank: BTreeMap::new(),
    };
    let mut consider = |fixed: &[(usize, usize)], during: f64| {
        let mut per_rank = at(fixed);
        if let Some(own) = per_rank.get_mut(&fixed[0].0) {
            *own += during;
        }
        let total: f64 = per_rank.values().sum();
        if total > best.total
            && let Some(&(rank, after)) = fixed.iter().find(|f| position.contains_key(&f.0))
        {
            let during = if rank == fixed[0].0 { during } else { 0.0 };
            best = Held { total, rank, after, during, per_rank };
        }
    };
    // One rank after each prefix of its actions, at its most inside the next.
    for &r in &set {
        for i in 0..prefix[&r].len() {
            let during = match s.ranks[&r].get(i) {
                Some(Action::Compute(c)) => keeps.during(r, c),
                _ => 0.0,
            };
            consider(&[(r, i)], during);
        }
    }
    // Just before the first rank of a lockstep group completes a pass: every rank of the
    // group has begun it and none has completed it. Only where every rank of the group
    // waits for all the others (a group as one rank's `lockstep` names it, that each of
    // the others names too).
    let group = |r: usize, c: &Compute| -> Vec<usize> {
        let mut g = keeps.lockstep(r, c);
        g.push(r);
        g.sort_unstable();
        g.dedup();
        g
    };
    let mut groups = BTreeSet::new();
    for &r in &set {
        for a in &s.ranks[&r] {
            let Action::Compute(c) = a else { continue };
            let g = group(r, c);
            if g.len() < 2 || groups.contains(&(g.clone(), *c)) {
                continue;
            }
            let mutual = g.iter().all(|&m| {
                let theirs = group(m, c);
                g.iter().all(|x| theirs.contains(x))
            });
            let fixed: Option<Vec<(usize, usize)>> =
                g.iter().map(|&m| clocks.pass(m, c).map(|i| (m, i))).collect();
            if let (true, Some(fixed)) = (mutual, fixed) {
                groups.insert((g.clone(), *c));
                consider(&fixed, 0.0);
            }
        }
    }
    best
}

/// What `rank` holds after each prefix of its actions (`len + 1` values, the first 0).
fn prefix_held(s: &Schedule, rank: usize, keeps: &dyn Keeps) -> Vec<f64> {
    let actions = &s.ranks[&rank];
    let mut out = Vec::with_capacity(actions.len() + 1);
    let mut now = 0.0;
    out.push(now);
    for a in actions {
        if let Action::Compute(c) = a
            && s.backward.get(c.module).copied().unwrap_or(false)
        {
            let w = keeps.kept(rank, &Compute { pass: Pass::Forward, ..*c });
            match c.pass {
                Pass::Forward => now += w,
                // Subtracting exactly what was added: a floor never goes below zero.
                Pass::Backward => now = (now - w).max(0.0),
            }
        }
        out.push(now);
    }
    out
}

/// Minimum over an inclusive range of a fixed sequence, in constant time (a sparse table).
struct RangeMin {
    levels: Vec<Vec<f64>>,
}

impl RangeMin {
    fn new(v: &[f64]) -> RangeMin {
        let mut levels = vec![v.to_vec()];
        let mut width = 1;
        while 2 * width <= v.len() {
            let last = levels.last().expect("a level");
            let next = (0..=v.len() - 2 * width).map(|i| last[i].min(last[i + width])).collect();
            levels.push(next);
            width *= 2;
        }
        RangeMin { levels }
    }

    /// Minimum of `v[lo..=hi]` (`hi` clamped to the end).
    fn min(&self, lo: usize, hi: usize) -> f64 {
        let hi = hi.min(self.levels[0].len() - 1);
        let lo = lo.min(hi);
        let k = (usize::BITS - 1 - (hi - lo + 1).leading_zeros()) as usize;
        self.levels[k][lo].min(self.levels[k][hi + 1 - (1 << k)])
    }
}

/// Vector clocks of the schedule's order, restricted to the ranks of the set: for each
/// rank and each of its actions, how many actions of each ranked member of the set must
/// have completed (or, for the one a message matched, been posted) before it completes.
struct Clocks {
    /// Per rank: per action, the clock at its completion (one entry per member of the set).
    at: BTreeMap<usize, Vec<Vec<u32>>>,
    /// Members of the set.
    members: usize,
    /// Where each rank runs each pass.
    passes: HashMap<(usize, Compute), usize>,
}

impl Clocks {
    fn new(s: &Schedule, set: &[usize], keeps: &dyn Keeps) -> Clocks {
        let position: HashMap<usize, usize> =
            set.iter().enumerate().map(|(x, &r)| (r, x)).collect();
        // Where each message is posted (rank, action index, role), and each pass.
        let mut sites: HashMap<MsgId, Vec<(usize, usize, Role)>> = HashMap::new();
        let mut passes: HashMap<(usize, Compute), usize> = HashMap::new();
        for (&r, actions) in &s.ranks {
            for (i, a) in actions.iter().enumerate() {
                for p in a.posts() {
                    sites.entry(p.msg).or_default().push((r, i, p.role));
                }
                if let Action::Compute(c) = a {
                    // A valid schedule runs each pass once on a rank (`check`).
                    let earlier = passes.insert((r, *c), i);
                    debug_assert!(earlier.is_none(), "rank {r} runs {c:?} twice");
                }
            }
        }
        // The sites an action's completion waits for besides its reductions: a receive's
        // send, the same pass on the ranks it runs in lockstep with.
        let waits = |r: usize, a: &Action| -> Vec<(usize, usize)> {
            let mut out = Vec::new();
            if let Action::Compute(c) = a {
                out.extend(
                    keeps
                        .lockstep(r, c)
                        .into_iter()
                        .filter(|&o| o != r)
                        .filter_map(|o| passes.get(&(o, *c)).map(|&j| (o, j))),
                );
            }
            for p in a.posts() {
                if let (MsgId::Act { .. } | MsgId::Grad { .. }, Role::Recv) = (p.msg, p.role) {
                    let sends = sites[&p.msg].iter().filter(|x| x.0 != r && x.2 == Role::Send);
                    out.extend(sends.map(|x| (x.0, x.1)));
                }
            }
            out
        };
        // A reduction completes for every member at once, after every member posted it: its
        // members' clocks merged once, when the last arrives, and shared. (Merged member by
        // member, a reduction over thousands of ranks costs the square of them.)
        let reductions = |a: &Action| -> Vec<MsgId> {
            let members = a.posts().iter().filter(|p| p.role == Role::Member);
            members.map(|p| p.msg).filter(|m| matches!(m, MsgId::Reduce { .. })).collect()
        };
        let n = set.len();
        let mut at: BTreeMap<usize, Vec<Vec<u32>>> =
            s.ranks.iter().map(|(&r, a)| (r, Vec::with_capacity(a.len()))).collect();
        // Members that posted each reduction so far, each rank's actions counted (the index
        // below which its reductions are), and each completed reduction's merged clock.
        let mut arrived: HashMap<MsgId, usize> = HashMap::new();
        let mut counted: BTreeMap<usize, usize> = s.ranks.keys().map(|&r| (r, 0)).collect();
        let mut merged: HashMap<MsgId, Vec<u32>> = HashMap::new();
        // Actions in an order where what each waits for comes first; a schedule that
        // deadlocks leaves its stuck actions without the order they would have had.
        let mut stuck = false;
        loop {
            let mut progressed = false;
            let mut done = true;
            for (&r, actions) in &s.ranks {
                while at[&r].len() < actions.len() {
                    let i = at[&r].len();
                    if counted[&r] == i {
                        for m in reductions(&actions[i]) {
                            *arrived.entry(m).or_insert(0) += 1;
                        }
                        counted.insert(r, i + 1);
                    }
                    let sources = if stuck { Vec::new() } else { waits(r, &actions[i]) };
                    let joined = if stuck { Vec::new() } else { reductions(&actions[i]) };
                    if sources.iter().any(|&(o, j)| o != r && at[&o].len() < j)
                        || joined.iter().any(|m| arrived[m] < sites[m].len())
                    {
                        break;
                    }
                    let mut clock = at[&r].last().cloned().unwrap_or_else(|| vec![0; n]);
                    let merge = |clock: &mut Vec<u32>, o: usize, j: usize| {
                        // `o` has completed its first `j` actions and posted action `j`.
                        if j > 0 {
                            for (c, &v) in clock.iter_mut().zip(&at[&o][j - 1]) {
                                *c = (*c).max(v);
                            }
                        }
                        if let Some(&x) = position.get(&o) {
                            clock[x] = clock[x].max(j as u32);
                        }
                    };
                    for m in joined {
                        let all = merged.entry(m).or_insert_with(|| {
                            let mut all = vec![0; n];
                            for &(o, j, _) in &sites[&m] {
                                merge(&mut all, o, j);
                            }
                            all
                        });
                        for (c, &v) in clock.iter_mut().zip(all.iter()) {
                            *c = (*c).max(v);
                        }
                    }
                    for (o, j) in sources {
                        merge(&mut clock, o, j);
                    }
                    if let Some(&x) = position.get(&r) {
                        clock[x] = (i + 1) as u32;
                    }
                    at.get_mut(&r).expect("rank").push(clock);
                    progressed = true;
                }
                done &= at[&r].len() == actions.len();
            }
            if done {
                break;
            }
            stuck |= !progressed;
        }
        Clocks { at, members: n, passes }
    }

    /// Where rank `r` runs pass `c`, if it does.
    fn pass(&self, r: usize, c: &Compute) -> Option<usize> {
        self.passes.get(&(r, *c)).copied()
    }

    /// Actions of the set's member `y` that completed before rank `r` completed its first
    /// `i` actions.
    fn known(&self, r: usize, i: usize, y: usize) -> usize {
        debug_assert!(y < self.members);
        if i == 0 { 0 } else { self.at[&r][i - 1][y] as usize }
    }

    /// The most actions rank `o` can have completed while the set's member `x` has
    /// completed exactly `i`: up to the first that needs `x`'s action `i` posted.
    fn possible(&self, o: usize, x: usize, i: usize) -> usize {
        self.at[&o].partition_point(|c| (c[x] as usize) <= i)
    }
}

#[cfg(test)]
mod tests {
    use hetpar_layout::{Config, ModelGraph};

    use super::*;
    use crate::{Options, PipelineGraph};

    struct Nothing;

    impl Keeps for Nothing {
        fn kept(&self, _: usize, _: &Compute) -> f64 {
            0.0
        }
    }

    /// A gradient reduction orders its members: once a member completes it, its clock
    /// knows that every other member had posted it. An LLM at dp 3 on its own exchanges
    /// nothing else, so the reduction is all that orders its ranks.
    #[test]
    fn a_reduction_tells_each_member_the_others_posted_it() {
        let toml = "name = \"t\"\n[train]\nglobal_batch = 6\nmicrobatches = 2\nseq_len = 16\n\
            [modules.llm]\nkind = \"llama\"\nvocab = 32\nhidden = 16\nlayers = 2\nheads = 2\n\
            ffn = 32\n[modules.llm.parallel]\nranks = [0, 3]\n";
        let graph =
            ModelGraph::from_config(&Config::from_toml(toml).expect("parses")).expect("valid");
        let s = Schedule::build(&PipelineGraph::from_model(&graph), Options::default())
            .expect("builds");
        let set = [0, 1, 2];
        let clocks = Clocks::new(&s, &set, &Nothing);
        let reduce = |r: usize| {
            s.ranks[&r].iter().position(|a| matches!(a, Action::Reduce(_))).expect("reduces")
        };
        for &r in &set {
            for (y, &o) in set.iter().enumerate() {
                let before = clocks.known(r, reduce(r), y);
                let after = clocks.known(r, reduce(r) + 1, y);
                if o == r {
                    assert_eq!(after, reduce(r) + 1, "rank {r} counts itself");
                } else {
                    assert_eq!((before, after), (0, reduce(o)), "rank {r} of rank {o}");
                }
            }
        }
    }
}
