//! The search: every valid layout of every module, colocated and non-colocated placements
//! (island sizes), microbatch counts, recomputation and offload; pruned by memory; ranked
//! by simulated step time (which orders TFLOPS/GPU and tokens/s the same way for one
//! workload).
//!
//! Candidates are enumerated so that the LLM's `dp` divides the samples of a global
//! microbatch (encoders split items, SEMANTICS.md section 3), so each one is a config hetpar
//! can run: colocated encoders take every tp and cp on the LLM's ranks, down to tp 1 on
//! every rank; encoder islands take every size that is a power of two or a multiple of a
//! node, or whose dp divides the microbatch (with several encoders, whose sizes multiply:
//! a power of two or three times one). Each is first costed without simulation; its
//! busiest rank's work bounds its step time from below.
//! Per placement family, candidates are simulated in order of that bound until the bound
//! passes the `top`-th best simulated step: the answer is the same as simulating them all.
//! Islands are searched twice: a subset's best bounds the family's, and the full pass
//! leaves out, before costing, islands and LLM layouts whose own work exceeds that bound
//! (no candidate holding one can beat it).

use std::collections::BTreeMap;

use serde::Serialize;

use crate::candidate::{Candidate, Choice, Kind, Prediction};
use crate::error::{PlanError, Result};
use crate::evaluate::{Evaluator, Prepared};
use crate::hardware::Hardware;
use crate::workload::{Pinned, Workload};

/// Tensor-parallel sizes tried (within a node).
const TP: [usize; 4] = [1, 2, 4, 8];
/// LLM context-parallel sizes tried.
const CP: [usize; 5] = [1, 2, 4, 8, 16];
/// Fewest LLM tokens per CP rank the search considers.
const MIN_CP_CHUNK: usize = 4096;
/// Pipeline sizes tried.
const PP: [usize; 9] = [1, 2, 3, 4, 6, 8, 12, 16, 32];
/// Virtual stages per rank tried when pp > 1.
const VPP: [usize; 3] = [1, 2, 4];
/// LLM samples per replica per microbatch tried.
const MBS: [usize; 3] = [1, 2, 4];
/// Encoder pipeline sizes tried on islands.
const ENC_PP: [usize; 3] = [1, 2, 4];

/// A simulated candidate.
#[derive(Clone, Debug, Serialize)]
pub struct Ranked {
    /// Layouts.
    pub candidate: Candidate,
    /// Prediction.
    pub prediction: Prediction,
}

/// What a search found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Plan {
    /// Per placement family, the best candidates, fastest first (empty when none fits).
    pub best: BTreeMap<Kind, Vec<Ranked>>,
    /// Valid layouts enumerated (a colocated or island encoder counts once keeping and once
    /// recomputing its activations).
    pub considered: usize,
    /// Of them, those that fit the GPU memory with some recomputation of the LLM.
    pub fitting: usize,
    /// Of those, the ones simulated.
    pub simulated: usize,
    /// Valid layouts enumerated per placement family (a family with none has no layout
    /// whose axes split the model and the GPUs, as against none that fits memory).
    pub considered_of: BTreeMap<Kind, usize>,
}

impl Plan {
    /// The fastest candidate of any family.
    pub fn winner(&self) -> Option<&Ranked> {
        self.best
            .values()
            .filter_map(|v| v.first())
            .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s))
    }

    /// The fastest of `kind`.
    pub fn best_of(&self, kind: Kind) -> Option<&Ranked> {
        self.best.get(&kind).and_then(|v| v.first())
    }

    /// Whether the search enumerated a valid layout of `kind` (fitting memory or not).
    pub fn has_valid(&self, kind: Kind) -> bool {
        self.considered_of.get(&kind).is_some_and(|&n| n > 0)
    }

    /// Why `kinds` have no candidate: "no X layout fits memory" where some were valid,
    /// else "no valid X layout" (no split of the model and the GPUs).
    pub fn none_of(&self, kinds: &[Kind], what: &str) -> String {
        if kinds.iter().any(|&k| self.has_valid(k)) {
            format!("no {what} layout fits memory")
        } else {
            format!("no valid {what} layout on these GPUs")
        }
    }
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// The sizes to try for one axis: the pinned one, or every size of `searched`.
fn tried(pin: Option<usize>, searched: &[usize]) -> Vec<usize> {
    pin.map_or_else(|| searched.to_vec(), |p| vec![p])
}

/// Searches `wl` on `hw`, keeping the `top` best of each family.
pub fn search(wl: &Workload, hw: &Hardware, top: usize) -> Result<Plan> {
    let top = top.max(1);
    let mut eval = Evaluator::new(wl, hw);
    let mut plan = Plan::default();
    let mut pools: BTreeMap<Kind, Vec<Prepared>> = BTreeMap::new();
    // Per layout, the least LLM recomputation that fits, for each encoder setting (keep
    // its activations, or recompute them all).
    let consider = |eval: &Evaluator<'_>,
                    c: Candidate,
                    plan: &mut Plan,
                    pools: &mut BTreeMap<Kind, Vec<Prepared>>| {
        let enc_levels: &[u8] =
            if c.encoders.is_empty() || c.kind == Kind::Homogeneous { &[0] } else { &[0, 4] };
        for &enc in enc_levels {
            let Ok(fit) = eval.least_recompute(c.clone(), enc) else { continue };
            plan.considered += 1;
            *plan.considered_of.entry(c.kind).or_default() += 1;
            if let Some(p) = fit {
                plan.fitting += 1;
                pools.entry(p.candidate.kind).or_default().push(p);
            }
        }
    };
    let n = wl.gpus;
    let kinds: &[Kind] = if wl.encoders.is_empty() { &[Kind::Homogeneous] } else { &Kind::ALL };
    for &kind in kinds {
        match kind {
            Kind::Homogeneous | Kind::Colocated => {
                for (llm, m) in llm_choices(wl, 0, n, None) {
                    if kind == Kind::Homogeneous {
                        let encoders = wl
                            .encoders
                            .iter()
                            .map(|e| Choice { offload: false, ..enc_base(&llm, e.pinned) })
                            .collect();
                        consider(
                            &eval,
                            Candidate { kind, llm, encoders, microbatches: m },
                            &mut plan,
                            &mut pools,
                        );
                        continue;
                    }
                    for encoders in colocated_encoders(wl, &llm) {
                        consider(
                            &eval,
                            Candidate { kind, llm, encoders, microbatches: m },
                            &mut plan,
                            &mut pools,
                        );
                    }
                }
            }
            Kind::NonColocated => {
                // Islands multiply: each encoder's layouts and island sizes times the
                // others' and the LLM's on the rest. A first pass over a subset (each
                // encoder's power-of-two islands, the layout of least work per size)
                // bounds the family's `top`-th best step; no layout with an island or an
                // LLM whose own work exceeds that bound can beat it, so the full pass
                // leaves them out before costing (the answer is unchanged).
                let mut first = BTreeMap::new();
                islands(&eval, wl, n, hw.gpus_per_node, None, &mut |c| {
                    consider(&eval, c, &mut Plan::default(), &mut first);
                });
                let first = first.remove(&kind).unwrap_or_default();
                let found = rank(&mut eval, first, top, &mut plan.simulated)?;
                let bound = match found.get(top - 1) {
                    Some(r) => r.prediction.step_time_s,
                    None => f64::INFINITY,
                };
                islands(&eval, wl, n, hw.gpus_per_node, Some(bound), &mut |c| {
                    consider(&eval, c, &mut plan, &mut pools);
                });
            }
        }
    }
    for (kind, pool) in pools {
        let best = rank(&mut eval, pool, top, &mut plan.simulated)?;
        plan.best.insert(kind, best);
    }
    if plan.considered == 0 {
        return Err(PlanError(format!(
            "no valid layout of {} on {} GPUs{}: tp (searched {TP:?}), cp ({CP:?}, above 1 only with at least {MIN_CP_CHUNK} tokens per CP rank) and pp ({PP:?}) must split the heads, sequence, layers and GPUs, and the LLM's dp must divide a microbatch",
            wl.name,
            wl.gpus,
            pins(wl)
        )));
    }
    if plan.best.values().all(Vec::is_empty) {
        return Err(PlanError(format!(
            "no layout of {} fits {} GPUs of {:.0} GiB ({} layouts considered): add GPUs or use a larger-memory accelerator",
            wl.name, wl.gpus, hw.memory_gib, plan.considered
        )));
    }
    Ok(plan)
}

/// The `top` fastest of `pool` by simulation, simulating candidates in order of their lower
/// bound until the bound passes the `top`-th best simulated step (no later one can beat
/// it); counts the simulations in `simulated`.
fn rank(
    eval: &mut Evaluator<'_>,
    mut pool: Vec<Prepared>,
    top: usize,
    simulated: &mut usize,
) -> Result<Vec<Ranked>> {
    pool.sort_by(|a, b| a.lower_bound.total_cmp(&b.lower_bound));
    let mut best: Vec<Ranked> = Vec::new();
    for p in pool {
        if best.len() >= top && p.lower_bound >= best[top - 1].prediction.step_time_s {
            break;
        }
        let candidate = p.candidate.clone();
        *simulated += 1;
        // Every prepared candidate passed the checks its schedule and boundary plans rely
        // on, so a failure here is a planner bug, not a layout to skip.
        let prediction = eval.finish(p)?;
        best.push(Ranked { candidate, prediction });
        best.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
        best.truncate(top);
    }
    Ok(best)
}

/// Visits the non-colocated candidates of `wl` on `n` GPUs: encoder islands one after the
/// other from rank 0, the LLM on the rest, for every microbatch count.
///
/// With `bound`, only those whose every island and LLM does at most `bound` of its own work
/// ([`Evaluator::island_bound`], [`Evaluator::llm_bound`]: a candidate's lower bound is at
/// least each), which includes every candidate whose step can be `bound` or less. Without,
/// a subset to find such a bound: each encoder's power-of-two islands, each size with its
/// layout of least own work.
fn islands(
    eval: &Evaluator<'_>,
    wl: &Workload,
    n: usize,
    per_node: usize,
    bound: Option<f64>,
    visit: &mut dyn FnMut(Candidate),
) {
    for m in divisors(wl.global_batch) {
        let mb = wl.global_batch / m;
        let within = |t: f64| bound.is_none_or(|b| t <= b);
        // The LLM's layouts on the ranks left after `used`, by `used`, computed as needed.
        let mut llms: BTreeMap<usize, std::rc::Rc<[Choice]>> = BTreeMap::new();
        let mut llm_on = |used: usize| {
            llms.entry(used)
                .or_insert_with(|| {
                    llm_choices(wl, used, n, Some(m))
                        .into_iter()
                        .map(|(c, _)| c)
                        .filter(|c| within(eval.llm_bound(c, m)))
                        .collect()
                })
                .clone()
        };
        // The most ranks the islands may take: the LLM needs some layout on the rest.
        let Some(room) = (1..n).rev().find(|&used| bound.is_none() || !llm_on(used).is_empty())
        else {
            continue;
        };
        let options: Vec<Vec<Choice>> = (0..wl.encoders.len())
            .map(|i| {
                let all = island_options(wl, i, mb, n, per_node);
                match bound {
                    Some(_) => {
                        all.into_iter().filter(|c| within(eval.island_bound(i, c, m))).collect()
                    }
                    None => least_work_per_size(eval, i, m, all),
                }
            })
            .collect();
        let mut prefix = Vec::with_capacity(options.len());
        each_combination(&options, 0, room, &mut prefix, &mut |enc, used| {
            for &llm in llm_on(used).iter() {
                visit(Candidate {
                    kind: Kind::NonColocated,
                    llm,
                    encoders: enc.to_vec(),
                    microbatches: m,
                });
            }
        });
    }
}

/// Of encoder `i`'s island `options`, those of power-of-two size, one per size: the layout
/// of least own work in a step of `m` microbatches.
fn least_work_per_size(
    eval: &Evaluator<'_>,
    i: usize,
    m: usize,
    options: Vec<Choice>,
) -> Vec<Choice> {
    let mut best: BTreeMap<usize, (f64, Choice)> = BTreeMap::new();
    for c in options.into_iter().filter(|c| c.ranks().is_power_of_two()) {
        let t = eval.island_bound(i, &c, m);
        if best.get(&c.ranks()).is_none_or(|(b, _)| t < *b) {
            best.insert(c.ranks(), (t, c));
        }
    }
    best.into_values().map(|(_, c)| c).collect()
}

/// Calls `visit` with every combination of one option per encoder from `options[i..]`
/// after `prefix`, islands placed one after the other from rank `used` of the prefix and
/// together at most `room` ranks, and the ranks they use.
fn each_combination(
    options: &[Vec<Choice>],
    used: usize,
    room: usize,
    prefix: &mut Vec<Choice>,
    visit: &mut dyn FnMut(&[Choice], usize),
) {
    let Some((first, rest)) = options.split_first() else {
        visit(prefix, used);
        return;
    };
    for o in first.iter().filter(|o| used + o.ranks() <= room) {
        prefix.push(Choice { start: used, end: used + o.ranks(), ..*o });
        each_combination(rest, used + o.ranks(), room, prefix, visit);
        prefix.pop();
    }
}

/// The workload's pins, as ` (llm pinned to tp 3 pp 2)` (empty without pins).
fn pins(wl: &Workload) -> String {
    let one = |name: &str, p: &Pinned| {
        let sizes: Vec<String> =
            [("tp", p.tp), ("cp", p.cp), ("pp", p.pp), ("ep", p.ep), ("vpp", p.vpp)]
                .into_iter()
                .filter_map(|(k, v)| v.map(|v| format!("{k} {v}")))
                .collect();
        (!sizes.is_empty()).then(|| format!("{name} pinned to {}", sizes.join(" ")))
    };
    let all: Vec<String> = std::iter::once(one(&wl.llm_name, &wl.llm_pinned))
        .chain(wl.encoders.iter().map(|e| one(&e.shape.name, &e.pinned)))
        .flatten()
        .collect();
    if all.is_empty() { String::new() } else { format!(" ({})", all.join(", ")) }
}

/// LLM layouts on ranks `[start, end)`, each with its microbatch count (`m` fixed when
/// given): every tp, cp, pp, vpp, ep the shapes allow, samples per replica per microbatch in
/// [`MBS`].
fn llm_choices(wl: &Workload, start: usize, end: usize, m: Option<usize>) -> Vec<(Choice, usize)> {
    let n = end - start;
    let pin = wl.llm_pinned;
    let mut out = Vec::new();
    let eps: Vec<usize> = match pin.ep {
        Some(e) => vec![e],
        None if wl.llm.experts > 0 => divisors(wl.llm.experts).collect(),
        None => vec![1],
    };
    for tp in tried(pin.tp, &TP) {
        // Context parallelism only where each rank keeps a long sequence (no published
        // measurement calibrates it on short chunks); cp 1 splits nothing, whatever the
        // length.
        for cp in tried(pin.cp, &CP)
            .into_iter()
            .filter(|&c| pin.cp.is_some() || c == 1 || wl.seq_len / c >= MIN_CP_CHUNK)
        {
            for pp in tried(pin.pp, &PP).into_iter().filter(|&p| p <= wl.llm.layers) {
                let block = tp * cp * pp;
                if !n.is_multiple_of(block) {
                    continue;
                }
                let dp = n / block;
                for mbs in MBS {
                    if !wl.global_batch.is_multiple_of(dp * mbs) {
                        continue;
                    }
                    let micro = wl.global_batch / (dp * mbs);
                    if m.is_some_and(|m| m != micro) {
                        continue;
                    }
                    for vpp in tried(pin.vpp, &VPP) {
                        if vpp > 1 && (pp == 1 || !micro.is_multiple_of(pp))
                            || pp * vpp > wl.llm.layers
                        {
                            continue;
                        }
                        for &ep in eps.iter().filter(|&&e| (tp * cp * dp).is_multiple_of(e)) {
                            let c = Choice {
                                start,
                                end,
                                tp,
                                cp,
                                pp,
                                vpp,
                                ep,
                                recompute: 0,
                                offload: false,
                            };
                            out.push((c, micro));
                        }
                    }
                }
            }
        }
    }
    out
}

fn enc_base(llm: &Choice, pin: Pinned) -> Choice {
    Choice {
        start: llm.start,
        end: llm.end,
        tp: llm.tp,
        cp: 1,
        pp: 1,
        vpp: 1,
        ep: 1,
        recompute: 0,
        offload: pin.offload.unwrap_or(false),
    }
}

/// Encoder context-parallel sizes worth trying: only for long items.
fn enc_cp(seq: usize, pin: Option<usize>) -> Vec<usize> {
    let all: &[usize] = if seq >= 4096 { &[1, 2, 4] } else { &[1] };
    match pin {
        Some(p) => vec![p],
        None => all.to_vec(),
    }
}

/// Every combination of colocated encoder layouts on the LLM's ranks.
fn colocated_encoders(wl: &Workload, llm: &Choice) -> Vec<Vec<Choice>> {
    let mut combos: Vec<Vec<Choice>> = vec![Vec::new()];
    for e in &wl.encoders {
        let pin = e.pinned;
        let mut options = Vec::new();
        for tp in tried(pin.tp, &TP) {
            for cp in enc_cp(e.seq, pin.cp) {
                if !llm.ranks().is_multiple_of(tp * cp) {
                    continue;
                }
                for offload in
                    [false, true].into_iter().filter(|&o| pin.offload.is_none_or(|p| p == o))
                {
                    options.push(Choice { tp, cp, offload, ..enc_base(llm, pin) });
                }
            }
        }
        combos = combos
            .into_iter()
            .flat_map(|prefix| {
                options.iter().map(move |o| {
                    let mut v = prefix.clone();
                    v.push(*o);
                    v
                })
            })
            .collect();
    }
    combos
}

/// Island sizes worth trying for a block of `block` ranks (one replica's tp x cp x pp) out of
/// `n`: every `dp` whose island is a power of two or a whole number of nodes, or leaves the
/// LLM whole nodes (on 31 GPUs of 8 a node, an island of 7 next to an LLM on 24), or
/// divides the microbatch `mb` (islands of other sizes only split nodes unevenly). With
/// several encoders (`several`) their sizes multiply, and whole nodes give thousands of
/// near-equal splits on a large cluster: a power of two or three times one (each size
/// within 1.5x of the next), or a `dp` dividing the microbatch.
fn island_dps(block: usize, n: usize, mb: usize, per_node: usize, several: bool) -> Vec<usize> {
    let geometric = |size: usize| {
        size.is_power_of_two() || (size.is_multiple_of(3) && (size / 3).is_power_of_two())
    };
    (1..n.div_ceil(block))
        .filter(|&dp| {
            let size = dp * block;
            let sized = if several {
                geometric(size)
            } else {
                size.is_multiple_of(per_node) || (n - size).is_multiple_of(per_node)
            };
            size.is_power_of_two() || sized || mb.is_multiple_of(dp)
        })
        .collect()
}

/// Encoder `i`'s island layouts on up to `n - 1` ranks (placed from rank 0; the caller
/// moves them): every tp, cp and pp with every island size [`island_dps`] keeps.
fn island_options(wl: &Workload, i: usize, mb: usize, n: usize, per_node: usize) -> Vec<Choice> {
    let e = &wl.encoders[i];
    let pin = e.pinned;
    let mut out = Vec::new();
    for tp in tried(pin.tp, &TP) {
        for cp in enc_cp(e.seq, pin.cp) {
            for pp in tried(pin.pp, &ENC_PP).into_iter().filter(|&p| p <= e.shape.layers) {
                let several = wl.encoders.len() > 1;
                for dp in island_dps(tp * cp * pp, n, mb, per_node, several) {
                    let size = dp * tp * cp * pp;
                    out.push(Choice {
                        start: 0,
                        end: size,
                        tp,
                        cp,
                        pp,
                        vpp: 1,
                        ep: 1,
                        recompute: 0,
                        offload: false,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::builtin;
    use crate::validation;

    /// The non-colocated family's `top` best of every candidate, simulating them all, and
    /// how many there are.
    fn exhaustive(wl: &Workload, top: usize) -> (Vec<Ranked>, usize) {
        let hw = builtin("h100").expect("h100");
        let mut eval = Evaluator::new(wl, &hw);
        let mut all = Vec::new();
        islands(&eval, wl, wl.gpus, hw.gpus_per_node, Some(f64::INFINITY), &mut |c| {
            for enc in [0, 4] {
                if let Ok(Some(p)) = eval.least_recompute(c.clone(), enc) {
                    all.push(p);
                }
            }
        });
        let mut ranked: Vec<Ranked> = all
            .into_iter()
            .map(|p| {
                let candidate = p.candidate.clone();
                Ranked { candidate, prediction: eval.finish(p).expect("simulates") }
            })
            .collect();
        let count = ranked.len();
        ranked.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
        ranked.truncate(top);
        (ranked, count)
    }

    fn times(r: &[Ranked]) -> Vec<f64> {
        r.iter().map(|r| r.prediction.step_time_s).collect()
    }

    #[test]
    fn islands_bounded_by_a_first_pass_find_what_simulating_every_candidate_finds() {
        let hw = builtin("h100").expect("h100");
        // Fewer microbatch counts than the file's, so that simulating everything is quick.
        let two = Workload {
            global_batch: 16,
            ..validation::workload("vision-audio-8b").expect("workload")
        };
        let mut one = two.clone();
        one.encoders.truncate(1);
        for (wl, gpus) in [(&two, 16), (&one, 24)] {
            let wl = Workload { gpus, ..wl.clone() };
            let top = 3;
            let plan = search(&wl, &hw, top).expect("plan");
            let found = &plan.best[&Kind::NonColocated];
            let (every, count) = exhaustive(&wl, top);
            let what = format!("{} encoders on {gpus} GPUs", wl.encoders.len());
            assert_eq!(times(found), times(&every), "{what}");
            assert!(plan.simulated * 4 < count, "{what}: {} of {count} simulated", plan.simulated);
        }
    }
}
