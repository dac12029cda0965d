//! Property tests: every schedule built for a random graph validates; mutated schedules (a
//! dropped receive, two swapped sends) are rejected with a message naming rank and action.

use hetpar_schedule::testing::arb_graph;
use hetpar_schedule::{Action, MsgId, Options, Role, Schedule, UnitDurations, validate};
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
