//! Property tests: every schedule built for a random graph validates, also with encoder
//! replicas that own no item in some microbatches; mutated schedules (a dropped receive, two
//! swapped sends, an empty replica skipping its turn) are rejected with a message naming
//! rank and action; frozen modules run only what they need; the floor of what ranks hold
//! at once is held in every execution.

use std::collections::BTreeMap;

use hetpar_layout::Direction;
use hetpar_schedule::testing::{arb_graph, arb_graph_with_work};
use hetpar_schedule::{
    Action, Compute, Keeps, MsgId, Options, Pass, Role, Schedule, UnitDurations, WorkDurations,
    held, validate,
};
use proptest::prelude::*;
use proptest::sample::Index;

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    #[test]
    fn every_built_schedule_is_valid(g in arb_graph()) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if let Err(e) = validate(&s, &UnitDurations) {
            let desc: Vec<String> = g.modules().iter().map(|m| format!("{} {} {} vpp{}", m.name, m.layout.span(), m.layout.describe(), m.vpp)).collect();
            prop_assert!(false, "{:?} edges {:?} m {}: {e}", desc, g.edges(), g.microbatches());
        }
    }

    /// Every post of a boundary transform or a reduction shares one participant list, so
    /// a schedule over thousands of ranks holds each list once, not once per participant.
    #[test]
    fn the_posts_of_a_collective_share_one_list(g in arb_graph()) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut first: BTreeMap<MsgId, std::sync::Arc<[usize]>> = BTreeMap::new();
        for actions in s.ranks.values() {
            for p in actions.iter().flat_map(Action::posts) {
                if matches!(p.msg, MsgId::Boundary { .. } | MsgId::Reduce { .. }) {
                    let list = first.entry(p.msg).or_insert_with(|| p.participants.clone());
                    prop_assert!(std::sync::Arc::ptr_eq(list, &p.participants), "{:?}", p.msg);
                }
            }
        }
    }

    /// The forward half (evaluation) of every built schedule validates, keeps every forward
    /// in its order, and holds no backward, gradient, reduction or optimizer step.
    #[test]
    fn the_forward_half_of_every_schedule_is_valid(g in arb_graph()) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let f = s.forward_only();
        validate(&f, &UnitDurations).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (r, actions) in &f.ranks {
            let fwd = |a: &[Action]| -> Vec<Action> {
                a.iter().filter(|a| matches!(a, Action::Compute(c) if c.pass == Pass::Forward)).cloned().collect()
            };
            prop_assert_eq!(fwd(actions), fwd(&s.ranks[r]));
            for a in actions {
                let forward = match a {
                    Action::Compute(c) => c.pass == Pass::Forward,
                    Action::Comm(_) | Action::Boundary(_) => a.posts().iter().all(|p| match p.msg {
                        MsgId::Act { .. } => true,
                        MsgId::Boundary { dir, .. } => dir == Direction::Forward,
                        MsgId::Grad { .. } | MsgId::Reduce { .. } => false,
                    }),
                    Action::Reduce(_) | Action::Step(_) | Action::Offload(_) | Action::Reload(_) => false,
                };
                prop_assert!(forward, "rank {} keeps {:?}", r, a);
            }
        }
    }

    #[test]
    fn a_dropped_receive_is_rejected(g in arb_graph(), pick in any::<Index>()) {
        let mut s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let recvs: Vec<(usize, usize, usize)> = s
            .ranks
            .iter()
            .flat_map(|(&r, actions)| {
                actions.iter().enumerate().flat_map(move |(i, a)| {
                    a.posts().iter().enumerate().filter(|(_, p)| p.role == Role::Recv).map(move |(j, _)| (r, i, j))
                })
            })
            .collect();
        prop_assume!(!recvs.is_empty());
        let (rank, i, j) = recvs[pick.index(recvs.len())];
        let actions = s.ranks.get_mut(&rank).expect("rank");
        match &mut actions[i] {
            Action::Comm(posts) => {
                posts.remove(j);
                if posts.is_empty() {
                    actions.remove(i);
                }
            }
            _ => {
                actions.remove(i);
            }
        }
        let err = validate(&s, &UnitDurations).expect_err("a dropped receive must be caught");
        prop_assert!(err.to_string().contains(&format!("rank {rank}")), "{err}");
    }
}

/// Where each message is posted: message -> [(rank, action index)].
fn post_sites(s: &Schedule) -> std::collections::HashMap<MsgId, Vec<(usize, usize)>> {
    let mut m: std::collections::HashMap<MsgId, Vec<(usize, usize)>> =
        std::collections::HashMap::new();
    for (&r, actions) in &s.ranks {
        for (i, a) in actions.iter().enumerate() {
            for p in a.posts() {
                m.entry(p.msg).or_default().push((r, i));
            }
        }
    }
    m
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

    /// Two sends from one rank to one peer, swapped, where the peer receives them in two
    /// different actions: the peer waits for the first while the sender offers the second.
    #[test]
    fn swapped_sends_are_rejected(g in arb_graph(), pick in any::<Index>()) {
        let mut s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let sites = post_sites(&s);
        let action_of = |msg: &MsgId, rank: usize| sites[msg].iter().find(|x| x.0 == rank).map(|x| x.1);
        let mut candidates = Vec::new();
        for (&r, actions) in &s.ranks {
            let sends: Vec<(usize, usize, MsgId, usize)> = actions
                .iter()
                .enumerate()
                .flat_map(|(i, a)| a.posts().iter().enumerate().map(move |(j, p)| (i, j, p)))
                .filter_map(|(i, j, p)| match p.msg {
                    MsgId::Act { to, .. } | MsgId::Grad { to, .. } if p.role == Role::Send => Some((i, j, p.msg, to)),
                    _ => None,
                })
                .collect();
            for (x, &(i1, j1, m1, to1)) in sends.iter().enumerate() {
                for &(i2, j2, m2, to2) in &sends[x + 1..] {
                    let (a1, a2) = (action_of(&m1, to1), action_of(&m2, to2));
                    if to1 == to2 && i1 < i2 && a1 < a2 {
                        candidates.push((r, i1, j1, i2, j2));
                    }
                }
            }
        }
        prop_assume!(!candidates.is_empty());
        let (r, i1, j1, i2, j2) = candidates[pick.index(candidates.len())];
        let actions = s.ranks.get_mut(&r).expect("rank");
        let (Action::Comm(first), Action::Comm(second)) = (actions[i1].clone(), actions[i2].clone()) else {
            unreachable!("sends live in communication actions")
        };
        let (mut first, mut second) = (first, second);
        std::mem::swap(&mut first[j1], &mut second[j2]);
        actions[i1] = Action::Comm(first);
        actions[i2] = Action::Comm(second);
        let err = validate(&s, &UnitDurations).expect_err("swapped sends must be caught");
        prop_assert!(err.to_string().starts_with("deadlock: ") && err.to_string().contains(&format!("rank {r} ")), "{err}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Encoder replicas with no item in a microbatch pass empty (no time) but keep their
    /// place in every boundary transform and reduction: the schedule still validates.
    #[test]
    fn replicas_without_items_keep_the_schedule_valid((g, work) in arb_graph_with_work()) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let d = WorkDurations { inner: UnitDurations, work: &work, graph: &g };
        let t = validate(&s, &d).map_err(|e| TestCaseError::fail(e.to_string()))?;
        // Empty passes take no time: the step is never longer than with unit work.
        let full = validate(&s, &UnitDurations).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(t.makespan <= full.makespan + 1e-9);
        // Each empty replica's passes of that microbatch take no time, and its ranks still
        // post every boundary transform of the encoder's edges and its reduction.
        for (module, mb, replica) in work.empty() {
            let layout = &g.modules()[module].layout;
            let out_edges: Vec<usize> = (0..g.edges().len()).filter(|&e| g.edges()[e].0 == module).collect();
            for r in (0..layout.pp()).flat_map(|p| layout.stage_ranks(replica, p)) {
                let actions = &s.ranks[&r];
                for (a, span) in actions.iter().zip(&t.spans[&r]) {
                    if let Action::Compute(c) = a && c.module == module && c.mb == mb {
                        prop_assert!(span.2 == 0.0, "rank {r}: {a:?} took {}", span.2);
                    }
                }
                let posts: Vec<MsgId> = actions.iter().flat_map(|a| a.posts().iter().map(|p| p.msg)).collect();
                let reduces = posts.iter().any(|m| matches!(m, MsgId::Reduce { module: x, .. } if *x == module));
                prop_assert!(reduces == g.modules()[module].trainable, "rank {r}: reduction {reduces}, trainable {}", g.modules()[module].trainable);
                if layout.coords(r).expect("rank").pp_idx + 1 == layout.pp() {
                    for &e in &out_edges {
                        prop_assert!(posts.iter().any(|m| matches!(m, MsgId::Boundary { edge, mb: k, .. } if *edge == e && *k == mb)), "rank {r} lost the boundary of edge {e} mb {mb}");
                    }
                }
            }
        }
    }

    /// A frozen module has no reduction and no optimizer step; one that nothing trainable
    /// feeds runs forwards only, and its edges carry no gradients back; every other module
    /// runs every backward.
    #[test]
    fn frozen_modules_run_what_they_need(g in arb_graph()) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (m, module) in g.modules().iter().enumerate() {
            let backward = g.has_backward(m);
            prop_assert!(backward || !module.trainable);
            prop_assert_eq!(s.backward[m], backward);
            let upstream_trains = g.edges().iter().any(|e| e.1 == m && g.has_backward(e.0));
            prop_assert_eq!(backward, module.trainable || upstream_trains);
            for (r, actions) in &s.ranks {
                for a in actions {
                    match a {
                        Action::Compute(c) if c.module == m && c.pass == Pass::Backward => {
                            prop_assert!(backward, "rank {r}: {a:?} of a forward-only module")
                        }
                        Action::Step(x) if *x == m => prop_assert!(module.trainable, "rank {r} steps frozen {m}"),
                        Action::Reduce(p) if matches!(p.msg, MsgId::Reduce { module: x, .. } if x == m) => {
                            prop_assert!(module.trainable, "rank {r} reduces frozen {m}")
                        }
                        _ => {}
                    }
                    for p in a.posts() {
                        if let MsgId::Boundary { edge, dir: Direction::Backward, .. } = p.msg {
                            prop_assert!(g.has_backward(g.edges()[edge].0), "rank {r}: gradients into a forward-only module");
                        }
                    }
                }
            }
        }
    }

    /// A runtime that skipped an empty replica's turn in a microbatch (its passes, pipeline
    /// messages and boundary transforms) would hang the ranks that wait for it in those
    /// collectives: the validator rejects that schedule, naming a rank of the replica. (A
    /// replica that shares its transforms with no other rank, a one-rank world, may skip.)
    #[test]
    fn skipping_an_empty_replica_is_rejected((g, work) in arb_graph_with_work(), pick in any::<Index>()) {
        let empty = work.empty();
        prop_assume!(!empty.is_empty());
        let (module, mb, replica) = empty[pick.index(empty.len())];
        let mut s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let layout = &g.modules()[module].layout;
        let ranks: Vec<usize> = (0..layout.pp()).flat_map(|p| layout.stage_ranks(replica, p)).collect();
        let out_edges: Vec<usize> = (0..g.edges().len()).filter(|&e| g.edges()[e].0 == module).collect();
        prop_assume!(out_edges.iter().any(|&e| g.boundary_participants(e).iter().any(|r| !ranks.contains(r))));
        let skipped = |msg: &MsgId| match *msg {
            MsgId::Act { module: m, mb: k, .. } | MsgId::Grad { module: m, mb: k, .. } => m == module && k == mb,
            MsgId::Boundary { edge, mb: k, .. } => k == mb && out_edges.contains(&edge),
            MsgId::Reduce { .. } => false,
        };
        for r in &ranks {
            let actions = s.ranks.get_mut(r).expect("rank");
            actions.retain_mut(|a| match a {
                Action::Compute(c) => !(c.module == module && c.mb == mb),
                Action::Comm(posts) => {
                    posts.retain(|p| !skipped(&p.msg));
                    !posts.is_empty()
                }
                Action::Boundary(p) => !skipped(&p.msg),
                _ => true,
            });
        }
        let err = validate(&s, &WorkDurations { inner: UnitDurations, work: &work, graph: &g })
            .expect_err("skipping an empty replica must be caught");
        let text = err.to_string();
        prop_assert!(ranks.iter().any(|r| text.contains(&format!("rank {r} "))), "{text} (replica ranks {ranks:?})");
    }
}

/// Per-action durations of 1 to 8 drawn from a hash of the action and a seed, and message
/// transfers of 1 to 4, a quarter of each a hundred times longer: every action takes time,
/// so an action that needs another rank's post ends after that post.
struct Hashed(u64);

impl Hashed {
    fn draw(&self, what: impl std::hash::Hash, range: u64) -> f64 {
        use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
        let h = BuildHasherDefault::<DefaultHasher>::default().hash_one((self.0, what));
        // One in four takes a hundred times longer: ranks drift far apart, as the floor
        // allows.
        let slow = if (h >> 32).is_multiple_of(4) { 100.0 } else { 1.0 };
        slow * (1 + h % range) as f64
    }
}

impl hetpar_schedule::Durations for Hashed {
    fn action(&self, rank: usize, action: &Action) -> f64 {
        match action {
            Action::Compute(_) | Action::Step(_) | Action::Offload(_) | Action::Reload(_) => {
                self.draw((rank, format!("{action:?}")), 8)
            }
            _ => 0.0,
        }
    }

    fn message(&self, msg: &MsgId) -> f64 {
        self.draw(msg, 4)
    }
}

/// What each pass keeps, from closures: the test's [`Keeps`].
struct Weights<'a> {
    kept: &'a dyn Fn(usize, &Compute) -> f64,
    during: &'a dyn Fn(usize, &Compute) -> f64,
    lockstep: &'a dyn Fn(usize, &Compute) -> Vec<usize>,
}

impl Keeps for Weights<'_> {
    fn kept(&self, rank: usize, c: &Compute) -> f64 {
        (self.kept)(rank, c)
    }

    fn during(&self, rank: usize, c: &Compute) -> f64 {
        (self.during)(rank, c)
    }

    fn lockstep(&self, rank: usize, c: &Compute) -> Vec<usize> {
        (self.lockstep)(rank, c)
    }
}

/// What `rank` holds after each prefix of its actions, and inside each action: the oracle
/// the floor is checked against.
fn prefix_held(s: &Schedule, rank: usize, w: &Weights<'_>) -> (Vec<f64>, Vec<f64>) {
    let mut now = 0.0;
    let (mut after, mut inside) = (vec![now], Vec::new());
    for a in &s.ranks[&rank] {
        let mut during = 0.0;
        if let Action::Compute(c) = a
            && s.backward[c.module]
        {
            let kept = w.kept(rank, &Compute { pass: Pass::Forward, ..*c });
            during = w.during(rank, c);
            now += if c.pass == Pass::Forward { kept } else { -kept };
        }
        inside.push(after[after.len() - 1] + during);
        after.push(now);
    }
    (after, inside)
}

/// Runs `s` on the clock of `d` under the least order [`held`] assumes, every other order
/// left free: a receive of an activation or gradient ends after its send was posted, a
/// gradient reduction after every member posted it, a pass after every rank of `peers`
/// began it (each a while after); sends, boundary transforms and everything else end on
/// their own time. Each
/// rank's `(start, end)` of each action.
fn eager(
    s: &Schedule,
    d: &Hashed,
    peers: &dyn Fn(usize, &Compute) -> Vec<usize>,
) -> Result<BTreeMap<usize, Vec<(f64, f64)>>, TestCaseError> {
    use hetpar_schedule::Durations;
    let mut spans: BTreeMap<usize, Vec<(f64, f64)>> =
        s.ranks.keys().map(|&r| (r, Vec::new())).collect();
    let mut posted: BTreeMap<MsgId, Vec<(usize, Role, f64)>> = BTreeMap::new();
    let mut began: BTreeMap<(usize, Compute), f64> = BTreeMap::new();
    let mut reached: BTreeMap<usize, usize> = BTreeMap::new();
    loop {
        let mut progressed = false;
        for (&r, actions) in &s.ranks {
            while let Some(a) = actions.get(spans[&r].len()) {
                let start = spans[&r].last().map_or(0.0, |x| x.1);
                if reached.get(&r) != Some(&spans[&r].len()) {
                    reached.insert(r, spans[&r].len());
                    for p in a.posts() {
                        posted.entry(p.msg).or_default().push((r, p.role, start));
                    }
                    if let Action::Compute(c) = a {
                        began.insert((r, *c), start);
                    }
                }
                let mut end = Some(start + d.action(r, a));
                let mut wait = |t: Option<f64>| end = end.zip(t).map(|(e, t)| e.max(t));
                if let Action::Compute(c) = a {
                    for p in peers(r, c).into_iter().filter(|&p| p != r) {
                        // The pass's collectives need the peer inside it a while.
                        if s.ranks[&p].contains(a) {
                            wait(began.get(&(p, *c)).map(|t| t + 1.0));
                        }
                    }
                }
                for p in a.posts() {
                    let got = posted.get(&p.msg).map_or(&[][..], |v| &v[..]);
                    let ready = match (p.msg, p.role) {
                        (MsgId::Act { .. } | MsgId::Grad { .. }, Role::Recv) => {
                            got.iter().find(|x| x.1 == Role::Send).map(|x| x.2)
                        }
                        (MsgId::Reduce { .. }, _) if got.len() == p.participants.len() => {
                            Some(got.iter().map(|x| x.2).fold(0.0, f64::max))
                        }
                        (MsgId::Reduce { .. }, _) => None,
                        _ => Some(start),
                    };
                    wait(ready.map(|t| t + d.message(&p.msg)));
                }
                let Some(end) = end else { break };
                spans.get_mut(&r).expect("rank").push((start, end));
                progressed = true;
            }
        }
        if s.ranks.iter().all(|(r, a)| spans[r].len() == a.len()) {
            return Ok(spans);
        }
        if !progressed {
            return Err(TestCaseError::fail("the eager run is stuck"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The floor of what a set of ranks holds at once is held in every execution: run on
    /// random durations under only the order it assumes ([`eager`]), with each stage's
    /// tensor-parallel ranks in lockstep for each pass (or each forward) when `lockstep`
    /// says so, and some backwards holding more while they run, the set's largest sum at
    /// any moment is at least the floor. One rank
    /// alone holds exactly its most, and a set never less than its largest member alone
    /// nor more than its members' most together.
    #[test]
    fn what_ranks_hold_at_once_is_held_in_every_execution(
        g in arb_graph(),
        seed in any::<u64>(),
        pick in prop::collection::vec(any::<bool>(), 64),
        scale in prop::collection::vec(1u32..5, 4),
        lockstep in 0usize..3,
        transient in any::<bool>(),
    ) {
        let s = Schedule::build(&g, Options::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let kept = |r: usize, c: &Compute| {
            f64::from(scale[c.module % scale.len()]) * (1 + c.vstage + c.mb % 3 + r % 2) as f64
        };
        // Backwards of every other module and microbatch hold twice their forward's
        // weight more while they run (as a recomputed forward's activations do).
        let during = |r: usize, c: &Compute| {
            let on = transient && c.pass == Pass::Backward && (c.module + c.mb).is_multiple_of(2);
            if on { 2.0 * kept(r, c) } else { 0.0 }
        };
        let peers = |r: usize, c: &Compute| -> Vec<usize> {
            let l = &g.modules()[c.module].layout;
            // None, every pass, or forwards only.
            match l.coords(r) {
                Some(at) if lockstep == 1 || (lockstep == 2 && c.pass == Pass::Forward) => {
                    l.stage_ranks(at.dp_idx, at.pp_idx)
                }
                _ => Vec::new(),
            }
        };
        let w = Weights { kept: &kept, during: &during, lockstep: &peers };
        let all: Vec<usize> = s.ranks.keys().copied().collect();
        let mut set: Vec<usize> = all.iter().copied().filter(|&r| pick[r % pick.len()]).collect();
        if set.is_empty() {
            set.push(all[0]);
        }
        let floor = held(&s, &set, &w);
        let peak = |r: usize| {
            let (after, inside) = prefix_held(&s, r, &w);
            after.iter().chain(&inside).copied().fold(0.0, f64::max)
        };
        for &r in &set {
            prop_assert_eq!(held(&s, &[r], &w).total, peak(r));
        }
        let most = set.iter().map(|&r| peak(r)).fold(0.0, f64::max);
        let sum: f64 = set.iter().map(|&r| peak(r)).sum();
        prop_assert!(floor.total >= most && floor.total <= sum + 1e-9, "floor {} outside [{most}, {sum}]", floor.total);
        prop_assert!((floor.per_rank.values().sum::<f64>() - floor.total).abs() < 1e-9);
        let spans = eager(&s, &Hashed(seed), &peers)?;
        let ran: BTreeMap<usize, (Vec<f64>, Vec<f64>)> = set.iter().map(|&r| (r, prefix_held(&s, r, &w))).collect();
        // Every moment an action starts or ends; a rank inside an action holds what it
        // holds there.
        let mut moments: Vec<f64> = spans.values().flatten().flat_map(|x| [x.0, x.1]).collect();
        moments.push(0.0);
        let realized = moments
            .iter()
            .map(|&at| {
                set.iter()
                    .map(|r| {
                        let spans = &spans[r];
                        let k = spans.iter().filter(|x| x.1 <= at).count();
                        match spans.get(k) {
                            Some(x) if x.0 <= at => ran[r].1[k],
                            _ => ran[r].0[k],
                        }
                    })
                    .sum::<f64>()
            })
            .fold(0.0, f64::max);
        prop_assert!(realized >= floor.total - 1e-9, "an execution held {realized} at most, below the floor {}", floor.total);
    }
}
