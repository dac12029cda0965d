//! Test support (feature `testing`): proptest generators of random worlds and manifests, and
//! the checks every boundary plan must pass. Shared with the runtime's executor tests.

use std::collections::BTreeMap;

use proptest::prelude::{Just, any, prop};
use proptest::strategy::Strategy as Gen;

use crate::edge::{Direction, PlacementMode, Strategy};
use crate::geometry::EdgeGeometry;
use crate::layout::{LayoutSpec, ModuleLayout, Span};
use crate::manifest::{BatchManifest, Item, Sample};
use crate::plan::EdgePlan;
use crate::symbolic::{Buffers, execute, initial_state};

/// A random world: an LLM fed by one or two encoders, each colocated with it or on its own
/// island, and a step's manifest.
#[derive(Clone, Debug)]
pub struct World {
    /// `layouts[0]` is the LLM, the others are encoders; edge `i` goes from `layouts[i+1]`.
    pub layouts: Vec<ModuleLayout>,
    /// Sizes and positions of the step's samples.
    pub manifest: BatchManifest,
}

impl World {
    /// Geometry of edge `edge` (from encoder `edge + 1` into the LLM) in microbatch `k`.
    pub fn geometry(&self, edge: usize, k: usize) -> EdgeGeometry {
        EdgeGeometry::new(&self.layouts[edge + 1], &self.layouts[0], &self.manifest, edge, k)
    }

    /// Strategies that apply to edge `edge`, leaders with 1 and with the most stripes.
    pub fn strategies(&self, edge: usize) -> Vec<Strategy> {
        let (src, dst) = (&self.layouts[edge + 1], &self.layouts[0]);
        let mode = if src.span() == dst.span() {
            PlacementMode::Colocated
        } else {
            PlacementMode::NonColocated
        };
        Strategy::all_for(mode, src.stage_width().min(dst.stage_width()))
    }
}

/// `(tp, cp, pp, sp)` choices whose product divides `n`.
fn factorizations(n: usize) -> Vec<(usize, usize, usize, bool)> {
    let mut out = Vec::new();
    for tp in [1, 2, 4, 8] {
        for cp in [1, 2, 3, 4] {
            for pp in [1, 2, 3, 4] {
                if n.is_multiple_of(tp * cp * pp) {
                    out.push((tp, cp, pp, false));
                    if tp > 1 {
                        out.push((tp, cp, pp, true));
                    }
                }
            }
        }
    }
    out
}

fn layout(name: &str, span: Span, (tp, cp, pp, sp): (usize, usize, usize, bool)) -> ModuleLayout {
    let spec = LayoutSpec { tp, cp, pp, sp, ..LayoutSpec::default() };
    ModuleLayout::new(name, span, spec).expect("factorization divides the span")
}

/// Random worlds of at most 64 ranks with random manifests: every sample draws 0..=4 items
/// over the edges, each of `0..=max_rows` rows. Only the LLM's dp divides the samples of a
/// microbatch; encoders (dp 1 up to 32) split items, so microbatches often hold fewer items
/// than an encoder has replicas.
pub fn arb_world(max_rows: usize) -> impl Gen<Value = World> {
    let shape = (1usize..=32, prop::collection::vec((any::<bool>(), 1usize..=32), 1..=2));
    shape
        .prop_flat_map(|(n_llm, encoders)| {
            let llm = prop::sample::select(factorizations(n_llm));
            let encs: Vec<_> = encoders
                .iter()
                .map(|&(colocated, n)| {
                    let n = if colocated { n_llm } else { n };
                    prop::sample::select(factorizations(n)).prop_map(move |f| (colocated, n, f))
                })
                .collect();
            (Just(n_llm), llm, encs)
        })
        .prop_filter_map("world too large for the manifest budget", |(n_llm, llm_f, encs)| {
            let mut layouts = vec![layout("llm", Span::new(0, n_llm), llm_f)];
            let mut next = n_llm;
            for (i, (colocated, n, f)) in encs.into_iter().enumerate() {
                let span = if colocated { Span::new(0, n_llm) } else { Span::new(next, next + n) };
                if !colocated {
                    next += n;
                }
                layouts.push(layout(&format!("enc{i}"), span, f));
            }
            let llm_dp = layouts[0].dp();
            (next <= 64 && llm_dp <= 24).then_some((layouts, llm_dp))
        })
        .prop_flat_map(move |(layouts, llm_dp)| {
            let n_edges = layouts.len() - 1;
            let item = (0..n_edges, 0..=max_rows, 0usize..=3);
            let sample = (prop::collection::vec(item, 0..=4), 0usize..=3);
            let per_mb = 1..=(48 / llm_dp).clamp(1, 2);
            (Just(layouts), Just(llm_dp), per_mb, 1usize..=2).prop_flat_map(
                move |(layouts, llm_dp, f, m)| {
                    let samples = prop::collection::vec(sample.clone(), llm_dp * f * m);
                    (Just(layouts), Just(m), samples)
                },
            )
        })
        .prop_map(|(layouts, m, raw)| {
            let llm = &layouts[0];
            let unit =
                if llm.cp() > 1 { 2 * llm.cp() } else { 1 } * if llm.sp() { llm.tp() } else { 1 };
            let samples: Vec<Sample> = raw
                .into_iter()
                .map(|(items, tail)| {
                    let mut pos = 0;
                    let items = items
                        .into_iter()
                        .map(|(edge, rows, gap)| {
                            pos += gap;
                            let it = Item { edge, pos, rows };
                            pos += rows;
                            it
                        })
                        .collect();
                    Sample { len: pos + tail, items }
                })
                .collect();
            let longest = samples.iter().map(|s| s.len).max().unwrap_or(0).max(1);
            let seq_len = longest.div_ceil(unit) * unit;
            let manifest = BatchManifest::new(seq_len, m, layouts.len() - 1, samples)
                .expect("generated manifests are valid");
            World { layouts, manifest }
        })
}

fn labels(
    state: &BTreeMap<usize, Buffers>,
    rank: usize,
    dir: Direction,
) -> Vec<Option<crate::symbolic::Label>> {
    let b = &state[&rank];
    match dir {
        Direction::Forward => b.needed.clone(),
        Direction::Backward => b.held.clone(),
    }
}

/// Runs both directions of `plan` symbolically and checks the contract: every destination
/// rank ends with exactly its rows in order; every source holder ends with one complete
/// gradient replica per row (its own when it consumed the row; the canonical one under
/// `exact` and `gather`), never a sum; `exact` moves exactly the lower bound.
pub fn check_plan(plan: &EdgePlan) -> Result<(), String> {
    let geo = &plan.geometry;
    for dir in [Direction::Forward, Direction::Backward] {
        let out = execute(plan.program(dir), initial_state(plan, dir))
            .map_err(|e| format!("{dir:?}: {e}"))?;
        for r in geo.ranks() {
            let want = match dir {
                Direction::Forward => &geo.needed[&r],
                Direction::Backward => &geo.held[&r],
            };
            let got = labels(&out, r, dir);
            if got.len() != want.len() {
                return Err(format!(
                    "{dir:?}: rank {r} has {} slots for {} rows",
                    got.len(),
                    want.len()
                ));
            }
            for (slot, (&row, label)) in want.iter().zip(&got).enumerate() {
                let info = &geo.rows[row];
                let Some(label) = label else {
                    return Err(format!(
                        "{dir:?}: rank {r} slot {slot} ({}) never filled",
                        info.id
                    ));
                };
                if label.row != info.id {
                    return Err(format!(
                        "{dir:?}: rank {r} slot {slot} holds {} instead of {}",
                        label.row, info.id
                    ));
                }
                let ok = match dir {
                    Direction::Forward => geo.holders(info).contains(&label.origin),
                    Direction::Backward => {
                        let exact_like =
                            matches!(plan.strategy, Strategy::Exact | Strategy::Gather);
                        if geo.needers(info).contains(&r) {
                            label.origin == r
                        } else if exact_like {
                            label.origin == info.canonical
                        } else {
                            geo.needers(info).contains(&label.origin)
                        }
                    }
                };
                if !ok {
                    return Err(format!(
                        "{dir:?}: rank {r} slot {slot} row {} came from rank {}, not an allowed replica",
                        info.id, label.origin
                    ));
                }
            }
        }
        let traffic = plan.program(dir).traffic();
        let lower = match dir {
            Direction::Forward => geo.forward_lower_bound(),
            Direction::Backward => geo.backward_lower_bound(),
        };
        let (moved, bound): (usize, usize) = (traffic.total(), lower.values().sum());
        if traffic.sent.values().sum::<usize>() != moved {
            return Err(format!(
                "{dir:?}: {} rows sent but {moved} received",
                traffic.sent.values().sum::<usize>()
            ));
        }
        if moved < bound {
            return Err(format!("{dir:?}: moved {moved} rows, below the lower bound {bound}"));
        }
        if plan.strategy == Strategy::Exact && traffic.received != lower {
            return Err(format!(
                "{dir:?}: exact strategy received {:?} per rank, lower bound {:?}",
                traffic.received, lower
            ));
        }
    }
    Ok(())
}
