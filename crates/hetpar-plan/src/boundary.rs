//! Boundary transfer time of an edge, read from the routing plans `hetpar-layout` builds for
//! the candidate's layouts and spans.
//!
//! Plans are built for a scaled-down microbatch that keeps what decides who sends what to
//! whom: the two layouts and spans, items per sample, and where items sit relative to the
//! LLM's CP and SP chunks. Its samples are the least multiple of the LLM's `dp` whose items
//! split evenly over the encoder's replicas (encoder replicas split items), and it has
//! `lcm(cp*tp of the encoder, 4)` rows per item. On a large cluster the modules' replicas
//! are cut to fewer of the same replicas ([`cut_down`]: colocated by a common factor down to
//! a world of at least [`PLANNED_WORLD`] ranks, islands each side on its own to whole
//! nodes): a rank's traffic per row follows from the replicas' shapes and places, not their
//! number, while planning the full world grows faster than it. Each
//! rank's time is the sum over its plan operations of the rows it sends or receives, scaled
//! to the real rows and width, over the bandwidth of the operation's group (or of the
//! point-to-point link); the edge takes its slowest rank.

use std::collections::{BTreeMap, HashMap};

use hetpar_layout::config::{
    Config, DataConfig, EdgeConfig, ModuleConfig, ModuleKind, ParallelConfig, StrategyName,
    TrainConfig,
};
use hetpar_layout::plan::Op;
use hetpar_layout::{BatchManifest, Direction, EdgePlan, Item, ModelGraph, Sample};

use crate::candidate::{Candidate, Choice, Kind};
use crate::cost::ACT_BYTES;
use crate::error::{PlanError, Result};
use crate::hardware::Hardware;
use crate::workload::Workload;

type Key = (usize, Kind, [usize; 5], [usize; 5]);

/// Per-sample boundary seconds (forward, backward) of plans already built.
#[derive(Debug, Default)]
pub struct BoundaryCache {
    per_row: HashMap<Key, [f64; 2]>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a, b) * b
}

fn sizes(c: &Choice) -> [usize; 5] {
    [c.tp, c.cp, c.pp, c.ranks(), c.start]
}

impl BoundaryCache {
    /// Forward and backward seconds of encoder `i`'s edge for one microbatch of `c`.
    pub fn times(
        &mut self,
        wl: &Workload,
        hw: &Hardware,
        i: usize,
        c: &Candidate,
    ) -> Result<[f64; 2]> {
        let key = (i, c.kind, sizes(&c.encoders[i]), sizes(&c.llm));
        let per_row = match self.per_row.get(&key) {
            Some(t) => *t,
            None => {
                let t = per_row_times(wl, hw, i, c)?;
                self.per_row.insert(key, t);
                t
            }
        };
        let rows =
            wl.encoders[i].rows_per_sample() * wl.global_batch as f64 / c.microbatches as f64;
        Ok([per_row[0] * rows, per_row[1] * rows])
    }
}

/// The least world a colocated boundary plan is cut down to (32 nodes of 8): large enough
/// that groups and peers span nodes as they do in the full world. Islands are cut further
/// ([`cut_down`]).
pub const PLANNED_WORLD: usize = 256;

/// Seconds per boundary row of one microbatch (forward, backward), from the scaled-down plan.
fn per_row_times(wl: &Workload, hw: &Hardware, i: usize, c: &Candidate) -> Result<[f64; 2]> {
    per_row_times_at(wl, hw, i, c, true)
}

/// `c`'s encoder `i` and LLM with their replicas divided down to a smaller world, and the
/// factor each side's replicas were divided by (encoder, LLM).
///
/// Colocated modules share their ranks, so both are divided by one common factor of their
/// replica counts, the largest that leaves at least `world` ranks: they keep their first
/// rank and every replica its place.
///
/// On islands (the encoder's of whole nodes of `gpus_per_node`), each side is divided on its
/// own, by the largest factor of its replica count that leaves it whole nodes (at least one
/// node), its boundary stage too unless each replica's stage group (`tp * cp` ranks) fits
/// in a node or covers whole ones: a stage of part nodes puts replicas across node
/// boundaries at other offsets than the full world's. An LLM of part nodes keeps all its
/// replicas. The `leaders` strategy moves a row between islands once, leader to leader
/// (across nodes, whatever the islands' sizes), and inside a replica's stage before and
/// after, so a rank's traffic per row depends on its own side's replica count and shape
/// only: scaled by its side's factor, it is the full world's. An island whose replica count
/// shares no factor with the other's (a 65,344-GPU encoder island, 2 x 1,021 replicas of
/// 32 ranks, next to 16 LLM replicas) is then planned at one encoder replica rather than
/// 1,021.
///
/// An encoder island of part nodes shares a node with the LLM: nothing is cut.
fn cut_down(
    c: &Candidate,
    i: usize,
    world: usize,
    gpus_per_node: usize,
) -> (Choice, Choice, [usize; 2]) {
    let (ec, lc) = (c.encoders[i], c.llm);
    let cut = |ch: Choice, k: usize| Choice { start: 0, end: ch.ranks() / k, ..ch };
    let whole_nodes = |ranks: usize| ranks.is_multiple_of(gpus_per_node);
    if c.kind == Kind::NonColocated {
        if !whole_nodes(ec.ranks()) {
            return (ec, lc, [1, 1]);
        }
        // The largest factor of `ch`'s replicas that leaves it (and its stages where that
        // matters) whole nodes.
        let side = |ch: Choice| {
            let (dp, group) = (ch.dp(), ch.tp * ch.cp);
            let stages_keep =
                gpus_per_node.is_multiple_of(group) || group.is_multiple_of(gpus_per_node);
            (1..=dp)
                .rev()
                .find(|&k| {
                    let ranks = ch.ranks() / k;
                    dp.is_multiple_of(k)
                        && (k == 1
                            || whole_nodes(ch.ranks())
                                && whole_nodes(ranks)
                                && ranks >= gpus_per_node
                                && (stages_keep || whole_nodes(ranks / ch.pp)))
                })
                .unwrap_or(1)
        };
        let (ke, kl) = (side(ec), side(lc));
        return (cut(ec, ke), cut(lc, kl), [ke, kl]);
    }
    let g = gcd(ec.dp(), lc.dp());
    let most = ec.ranks().max(lc.ranks());
    let k = (1..=g).rev().find(|&k| g.is_multiple_of(k) && most / k >= world).unwrap_or(1);
    (cut(ec, k), cut(lc, k), [k, k])
}

/// [`per_row_times`] with the plan's world cut down ([`cut_down`] to [`PLANNED_WORLD`]) or
/// whole.
fn per_row_times_at(
    wl: &Workload,
    hw: &Hardware,
    i: usize,
    c: &Candidate,
    cut: bool,
) -> Result<[f64; 2]> {
    let e = &wl.encoders[i];
    // A rank of the cut-down world carries its share of the microbatch's rows, `k` times
    // what a rank of the full world carries (`k` its side's factor): the time per row of
    // the whole microbatch is its time over `k`.
    let (ec, lc, [ke, kl]) = match cut {
        true => cut_down(c, i, PLANNED_WORLD, hw.gpus_per_node),
        false => (c.encoders[i], c.llm, [1, 1]),
    };
    let (ec, lc) = (&ec, &lc);
    let rows = lcm(ec.cp * ec.tp, 4);
    let items = (e.items_per_sample.round() as usize).max(1);
    // A multiple of the LLM's dp whose items split evenly over the encoder's replicas.
    let samples = lcm(lc.dp(), ec.dp() / gcd(ec.dp(), items));
    let fraction = e.rows_per_sample() / wl.seq_len as f64;
    let unit = 2 * lc.cp * lc.tp;
    let mut seq = ((items * rows) as f64 / fraction).ceil() as usize;
    seq = seq.max(items * (rows + 1) + 1).div_ceil(unit) * unit;
    // One island after the other; colocated modules share the LLM's span.
    let (espan, lspan) = match c.kind {
        Kind::NonColocated => ([0, ec.ranks()], [ec.ranks(), ec.ranks() + lc.ranks()]),
        _ => ([0, lc.ranks()], [0, lc.ranks()]),
    };
    let parallel = |ch: &Choice, ranks: [usize; 2]| ParallelConfig {
        ranks,
        tp: ch.tp,
        cp: ch.cp,
        pp: ch.pp,
        ep: 1,
        etp: None,
        sp: ch.tp > 1,
        vpp: 1,
        offload: false,
        recompute: false,
    };
    // Sizes every tp divides (8 heads, or as many as the larger tp): the plan moves rows,
    // whatever a row holds.
    let wide = lcm(lcm(8, ec.tp), lc.tp) / 8;
    let small = |kind: ModuleKind, layers: usize, p: ParallelConfig| ModuleConfig {
        kind,
        image_size: None,
        patch_size: None,
        n_mels: (kind == ModuleKind::Audio).then_some(1),
        frames: (kind == ModuleKind::Audio).then_some(2 * rows),
        vocab: (kind == ModuleKind::Llama).then_some(64 * wide),
        hidden: 64 * wide,
        layers,
        heads: 8 * wide,
        kv_heads: None,
        ffn: 64 * wide,
        experts: None,
        top_k: None,
        trainable: None,
        lr: None,
        parallel: p,
    };
    let cfg = Config {
        name: "boundary".into(),
        train: TrainConfig { seed: 0, steps: 1, ..TrainConfig::with_sizes(samples, 1, seq) },
        data: DataConfig::default(),
        modules: BTreeMap::from([
            ("enc".to_string(), small(ModuleKind::Audio, ec.pp, parallel(ec, espan))),
            ("llm".to_string(), small(ModuleKind::Llama, lc.pp, parallel(lc, lspan))),
        ]),
        edges: vec![EdgeConfig {
            from: "enc".into(),
            to: "llm".into(),
            strategy: StrategyName::Auto,
            stripes: 1,
        }],
    };
    let graph = ModelGraph::from_config(&cfg)
        .map_err(|e| PlanError(format!("boundary plan: {}: {}", e.field, e.message)))?;
    let slot = seq / items;
    let sample = Sample {
        len: seq,
        items: (0..items).map(|k| Item { edge: 0, pos: k * slot + 1, rows }).collect(),
    };
    let manifest = BatchManifest::new(seq, 1, 1, vec![sample; samples])
        .map_err(|e| PlanError(format!("boundary plan: {}: {}", e.field, e.message)))?;
    let plan = EdgePlan::for_edge(&graph, 0, &manifest, 0);
    let planned_rows = (samples * items * rows) as f64;
    let row_bytes = wl.llm.hidden as f64 * ACT_BYTES;
    let mut out = [0.0; 2];
    for (d, dir) in [Direction::Forward, Direction::Backward].into_iter().enumerate() {
        let prog = plan.program(dir);
        let mut worst: f64 = 0.0;
        for (&rank, ops) in &prog.ops {
            // On islands the encoder's ranks come first; colocated, `ke == kl`.
            let k = if rank < espan[1] { ke } else { kl };
            let mut t = 0.0;
            for op in ops {
                let (sent, recv) = op.traffic(rank);
                let moved = sent.max(recv) as f64;
                if moved == 0.0 {
                    continue;
                }
                let bw = match op {
                    Op::Send { peer, .. } | Op::Recv { peer, .. } => {
                        let same_node = rank / hw.gpus_per_node == peer / hw.gpus_per_node;
                        hw.group_bandwidth(if same_node { 1 } else { usize::MAX })
                    }
                    _ => {
                        let g = op.group().unwrap_or(&[]);
                        let span = g.iter().max().unwrap_or(&0) - g.iter().min().unwrap_or(&0) + 1;
                        hw.group_bandwidth(span)
                    }
                };
                // Per planned row: the real microbatch scales `moved` by real rows / planned.
                t += moved / planned_rows * row_bytes / bw;
            }
            worst = worst.max(t / k as f64);
        }
        out[d] = worst;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::builtin;
    use crate::workload::Workload;

    /// A workload file's text with `gpus` GPUs.
    fn workload(gpus: usize) -> Workload {
        let text = include_str!("../../../examples/workloads/mm-1b-7b-64k.toml").replacen(
            "gpus = 32",
            &format!("gpus = {gpus}"),
            1,
        );
        Workload::from_toml(&text).expect("workload")
    }

    fn choice(start: usize, end: usize, tp: usize, cp: usize, pp: usize) -> Choice {
        Choice { start, end, tp, cp, pp, vpp: 1, ep: 1, recompute: 0, offload: false }
    }

    #[test]
    fn a_cut_down_world_plans_the_same_time_per_row() {
        // Colocated (the encoder at tp 1 or 2 on every rank): the plan cut down to 256 ranks
        // by a common factor gives each rank the traffic per row of the full one. On
        // islands each side is cut on its own, to whole nodes: the 16-rank encoder island
        // to 8 next to an LLM of 1,024 ranks cut to one 8-rank replica; replica counts with
        // no common factor (24 and 125) cut as far; encoders of two stages. An encoder
        // island of part nodes (12 ranks) is not cut at all, or an LLM replica would
        // straddle a node it does not straddle in the full world.
        let hw = builtin("h100").expect("h100");
        let cases = [
            (1024, Kind::Colocated, choice(0, 1024, 1, 1, 1), choice(0, 1024, 2, 8, 1), [4, 4]),
            (1024, Kind::Colocated, choice(0, 1024, 2, 1, 1), choice(0, 1024, 4, 2, 2), [4, 4]),
            (
                1024,
                Kind::NonColocated,
                choice(0, 512, 1, 1, 1),
                choice(512, 1024, 4, 2, 1),
                [64, 64],
            ),
            (1040, Kind::NonColocated, choice(0, 16, 1, 1, 1), choice(16, 1040, 4, 2, 1), [2, 128]),
            (1024, Kind::NonColocated, choice(0, 24, 1, 1, 1), choice(24, 1024, 4, 2, 1), [3, 125]),
            (1024, Kind::NonColocated, choice(0, 64, 2, 1, 2), choice(64, 1024, 8, 1, 2), [8, 60]),
            // Stage groups of 6 ranks on nodes of 8, two stages: cut to 2 replicas, the last
            // stage's groups would sit at 2 of the 4 offsets in a node they take.
            (1024, Kind::NonColocated, choice(0, 48, 2, 3, 2), choice(48, 1024, 8, 1, 1), [1, 122]),
            (1036, Kind::NonColocated, choice(0, 12, 1, 1, 1), choice(12, 1036, 4, 2, 1), [1, 1]),
        ];
        for (gpus, kind, enc, llm, want) in cases {
            let wl = workload(gpus);
            let c = Candidate { kind, encoders: vec![enc], llm, microbatches: 1 };
            let (_, _, k) = cut_down(&c, 0, PLANNED_WORLD, hw.gpus_per_node);
            assert_eq!(k, want, "{gpus} GPUs, {kind:?}");
            let full = per_row_times_at(&wl, &hw, 0, &c, false).expect("full");
            let cut = per_row_times_at(&wl, &hw, 0, &c, true).expect("cut");
            for d in 0..2 {
                let rel = (cut[d] - full[d]).abs() / full[d];
                assert!(
                    rel < 1e-9,
                    "{gpus} {kind:?} {}: {cut:?} against {full:?}",
                    ["fwd", "bwd"][d]
                );
            }
        }
    }

    /// A tensor-parallel size above 8 (a pin the LLM's 32 heads allow) plans: the stand-in
    /// model of the boundary plan has heads and widths every tp of the pair divides.
    #[test]
    fn tp_above_eight_plans_its_boundary() {
        let hw = builtin("h100").expect("h100");
        let wl = workload(64);
        for (enc_tp, llm_tp) in [(1, 16), (16, 8), (2, 32)] {
            let c = Candidate {
                kind: Kind::Colocated,
                encoders: vec![choice(0, 64, enc_tp, 1, 1)],
                llm: choice(0, 64, llm_tp, 1, 1),
                microbatches: 1,
            };
            let t = per_row_times_at(&wl, &hw, 0, &c, false).expect("plans");
            assert!(t.iter().all(|x| x.is_finite() && *x >= 0.0), "{t:?}");
        }
    }
}
