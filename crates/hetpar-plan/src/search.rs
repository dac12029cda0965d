//! The search: every valid layout of every module, colocated and non-colocated placements
//! (island sizes), microbatch counts, recomputation and offload; pruned by memory; ranked
//! by simulated step time (which orders TFLOPS/GPU and tokens/s the same way for one
//! workload).
//!
//! Candidates are enumerated so that the LLM's `dp` divides the samples of a global
//! microbatch (encoders split items, SEMANTICS.md section 3), so each one is a config hetpar
//! can run: colocated encoders take every tp and cp on the LLM's ranks, down to tp 1 on
//! every rank; encoder islands take every size that is a power of two or a multiple of a
//! node, or whose dp divides the microbatch. Each is first costed without simulation; its
//! busiest rank's work bounds its step time from below.
//! Per placement family, candidates are simulated in order of that bound until the bound
//! passes the `top`-th best simulated step: the answer is the same as simulating them all.

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
                for m in divisors(wl.global_batch) {
                    let mb = wl.global_batch / m;
                    for (enc, used) in island_encoders(wl, mb, n, hw.gpus_per_node) {
                        if used >= n {
                            continue;
                        }
                        for (llm, lm) in llm_choices(wl, used, n, Some(m)) {
                            debug_assert_eq!(lm, m);
                            consider(
                                &eval,
                                Candidate { kind, llm, encoders: enc.clone(), microbatches: m },
                                &mut plan,
                                &mut pools,
                            );
                        }
                    }
                }
            }
        }
    }
    for (kind, mut pool) in pools {
        pool.sort_by(|a, b| a.lower_bound.total_cmp(&b.lower_bound));
        let mut best: Vec<Ranked> = Vec::new();
        for p in pool {
            if best.len() >= top && p.lower_bound >= best[top - 1].prediction.step_time_s {
                break;
            }
            let candidate = p.candidate.clone();
            plan.simulated += 1;
            // Every prepared candidate passed the checks its schedule and boundary plans
            // rely on, so a failure here is a planner bug, not a layout to skip.
            let prediction = eval.finish(p)?;
            best.push(Ranked { candidate, prediction });
            best.sort_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
            best.truncate(top);
        }
        plan.best.insert(kind, best);
    }
    if plan.considered == 0 {
        return Err(PlanError(format!(
            "no valid layout of {} on {} GPUs{}: tp (searched {TP:?}), cp ({CP:?}, at least {MIN_CP_CHUNK} tokens per CP rank) and pp ({PP:?}) must split the heads, sequence, layers and GPUs, and the LLM's dp must divide a microbatch",
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
        // measurement calibrates it on short chunks).
        for cp in tried(pin.cp, &CP)
            .into_iter()
            .filter(|&c| pin.cp.is_some() || wl.seq_len / c >= MIN_CP_CHUNK)
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
/// `n`: every `dp` whose island is a power of two or a whole number of nodes, or divides the
/// microbatch `mb` (islands of other sizes only split nodes unevenly).
fn island_dps(block: usize, n: usize, mb: usize, per_node: usize) -> Vec<usize> {
    (1..n.div_ceil(block))
        .filter(|&dp| {
            let size = dp * block;
            size.is_power_of_two() || size.is_multiple_of(per_node) || mb.is_multiple_of(dp)
        })
        .collect()
}

/// Every combination of encoder islands (layout and size, one after the other from rank 0),
/// with the ranks they use.
fn island_encoders(
    wl: &Workload,
    mb: usize,
    n: usize,
    per_node: usize,
) -> Vec<(Vec<Choice>, usize)> {
    let mut combos: Vec<(Vec<Choice>, usize)> = vec![(Vec::new(), 0)];
    for e in &wl.encoders {
        let pin = e.pinned;
        let mut next = Vec::new();
        for (prefix, used) in &combos {
            for tp in tried(pin.tp, &TP) {
                for cp in enc_cp(e.seq, pin.cp) {
                    for pp in tried(pin.pp, &ENC_PP).into_iter().filter(|&p| p <= e.shape.layers) {
                        for dp in island_dps(tp * cp * pp, n, mb, per_node) {
                            let size = dp * tp * cp * pp;
                            if used + size >= n {
                                break;
                            }
                            let c = Choice {
                                start: *used,
                                end: used + size,
                                tp,
                                cp,
                                pp,
                                vpp: 1,
                                ep: 1,
                                recompute: 0,
                                offload: false,
                            };
                            let mut v = prefix.clone();
                            v.push(c);
                            next.push((v, used + size));
                        }
                    }
                }
            }
        }
        combos = next;
    }
    combos
}
