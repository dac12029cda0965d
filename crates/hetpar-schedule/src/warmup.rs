//! Warmup depths of graph-aware 1F1B under rendezvous messages.
//!
//! The stage graph rule (SEMANTICS.md section 5) gives a stage at depth `d` (longest path
//! from a root, in stages) `total_depth - d - 1` warmup forwards: one more than the stage
//! after it. With blocking sends that rule fails when an edge skips levels (an encoder
//! feeding both a deeper encoder and the LLM) or the consumer is an interleaved LLM. So
//! warmups are derived from the consumers instead. Each edge producer `P` -> consumer `C`
//! must satisfy, for every microbatch `j`:
//!
//! - `P` has sent enough inputs for `C` to reach its backward `j`:
//!   `min(W_P + j + 1, m) >= N_C(j)`, the forwards `C` runs before backward `j`;
//! - `P` does not block on a send `C` only accepts after the gradient `P` waits for:
//!   `min(W_P + j, m) - 1 <= K_C(j)`, the last input `C` posts by the time it sends `j`'s
//!   gradient.
//!
//! Walking the stages from the sink back, a producer gets one warmup forward more than the
//! least its consumers need (the chain case gives exactly the depth rule), lowered to fit
//! an interleaved consumer; if that cannot be made consistent, no extra forward at all. Then producers are raised to meet the first condition and
//! consumers to meet the second until nothing changes; warmups only grow and `W = m` (all
//! forwards first) satisfies both, so this terminates.

use std::collections::BTreeMap;

use hetpar_layout::ModuleId;

use crate::action::{Compute, Pass};
use crate::error::ScheduleError;
use crate::graph::PipelineGraph;
use crate::order;

/// A stage of the stage graph: `(module, physical stage)`.
type Node = (ModuleId, usize);

/// Compute orders (in groups) of every stage of a graph-aware schedule: with one forward of
/// slack per stage (the depth rule) when that is feasible, else with the least warmups.
pub(crate) fn graph_aware_orders(
    g: &PipelineGraph,
) -> Result<BTreeMap<Node, Vec<Vec<Compute>>>, ScheduleError> {
    solve(g, 1).or_else(|_| solve(g, 0))
}

fn solve(
    g: &PipelineGraph,
    slack: usize,
) -> Result<BTreeMap<Node, Vec<Vec<Compute>>>, ScheduleError> {
    let n = g.microbatches();
    let modules = g.modules();
    let sink = g.sink();
    let interleaved = |node: Node| node.0 == sink && modules[sink].vpp > 1;
    let order_of = |node: Node, w: usize| -> Vec<Vec<Compute>> {
        let m = &modules[node.0];
        if interleaved(node) {
            order::interleaved(node.0, node.1, m.layout.pp(), m.vpp, n)
        } else {
            order::one_f_one_b(node.0, node.1, n, w)
        }
    };
    // (producer, consumer, consumer's input virtual stage)
    let mut edges: Vec<(Node, Node, usize)> = Vec::new();
    for (m, module) in modules.iter().enumerate() {
        for s in 0..module.layout.pp() - 1 {
            if !interleaved((m, s)) {
                edges.push(((m, s), (m, s + 1), s + 1));
            }
        }
    }
    for &(a, b) in g.edges() {
        edges.push(((a, modules[a].layout.pp() - 1), (b, 0), 0));
    }
    let mut warmup: BTreeMap<Node, usize> = BTreeMap::new();
    for &m in g.topo_order().iter().rev() {
        for s in (0..modules[m].layout.pp()).rev() {
            let node = (m, s);
            let mut w = 0;
            let mut cap = n;
            for &(_, c, x) in edges.iter().filter(|e| e.0 == node) {
                let (needs, posted) = consumer_profile(&order_of(c, warmup[&c]), x, n);
                w = w.max(lower_bound(&needs) + slack);
                if interleaved(c) {
                    cap = cap.min((0..=n).rev().find(|&w| fits(w, &posted, n)).unwrap_or(0));
                }
            }
            warmup.insert(node, w.min(cap));
        }
    }
    loop {
        let mut changed = false;
        for &(p, c, x) in &edges {
            let (needs, posted) = consumer_profile(&order_of(c, warmup[&c]), x, n);
            let lo = lower_bound(&needs);
            if warmup[&p] < lo {
                warmup.insert(p, lo);
                changed = true;
            }
            let w = warmup[&p];
            if !fits(w, &posted, n) {
                if interleaved(c) || warmup[&c] >= n {
                    return Err(ScheduleError::Graph(format!(
                        "{} stage {} runs {w} forwards ahead, more than {} stage {} accepts before returning gradients; give the LLM vpp = 1 or place the modules together",
                        modules[p.0].name, p.1, modules[c.0].name, c.1
                    )));
                }
                *warmup.get_mut(&c).expect("node") += 1;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    Ok(warmup.iter().map(|(&node, &w)| (node, order_of(node, w))).collect())
}

/// The fewest warmup forwards that feed a consumer needing `needs[j]` inputs before its
/// backward `j`.
fn lower_bound(needs: &[usize]) -> usize {
    needs.iter().enumerate().map(|(j, &n)| n.saturating_sub(j + 1)).max().unwrap_or(0)
}

/// Whether a producer with `w` warmup forwards never blocks on a send its consumer only
/// accepts after returning a gradient the producer is still waiting for.
fn fits(w: usize, posted: &[usize], m: usize) -> bool {
    (0..m).all(|j| (w + j).min(m) <= posted[j] + 1)
}

/// For input virtual stage `x` of a consumer's grouped order: per microbatch `j`, the
/// forwards it runs before backward `j`, and the last input microbatch it has asked for by
/// the time it sends backward `j`'s gradient (inputs are asked for right before the group
/// that uses them; a gradient is sent right before the group after its backward).
fn consumer_profile(order: &[Vec<Compute>], x: usize, m: usize) -> (Vec<usize>, Vec<usize>) {
    let mut f_group = vec![usize::MAX; m];
    let mut needs = vec![0; m];
    let mut b_group = vec![usize::MAX; m];
    let mut seen_f = 0;
    for (g, group) in order.iter().enumerate() {
        for c in group.iter().filter(|c| c.vstage == x) {
            match c.pass {
                Pass::Forward => {
                    f_group[c.mb] = g;
                    seen_f += 1;
                }
                Pass::Backward => {
                    b_group[c.mb] = g;
                    needs[c.mb] = seen_f;
                }
            }
        }
    }
    let posted = (0..m)
        .map(|j| {
            let limit = b_group[j].saturating_add(1);
            f_group.iter().rposition(|&g| g <= limit).unwrap_or(0)
        })
        .collect();
    (needs, posted)
}
