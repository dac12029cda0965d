//! Test support (feature `testing`): random pipeline graphs with 1-3 encoders, pp 1-4 each,
//! 1-16 microbatches, colocated or island placements, chains and branches between encoders,
//! interleaving and offload where they apply, and frozen encoders (one in three).

use std::collections::BTreeMap;

use proptest::prelude::{Just, Strategy, any, prop};

use hetpar_layout::{LayoutSpec, ModuleLayout, Span};

use crate::graph::{PipeModule, PipelineGraph};
use crate::work::Work;

/// Raw choices for one encoder, mapped onto a valid layout by [`arb_graph`].
type EncoderChoice = (bool, usize, usize, usize, bool, bool, usize, bool);

fn module(name: &str, span: Span, tp: usize, pp: usize, vpp: usize, offload: bool) -> PipeModule {
    let spec = LayoutSpec { tp, pp, ..LayoutSpec::default() };
    let layout = ModuleLayout::new(name, span, spec).expect("tp * pp divides the span");
    PipeModule { name: name.to_string(), layout, vpp, offload, trainable: true }
}

/// Random graphs: module 0..n are encoders, the last module is the LLM sink.
pub fn arb_graph() -> impl Strategy<Value = PipelineGraph> {
    let encoder = (
        any::<bool>(),
        1usize..=4,
        0usize..2,
        0usize..2,
        any::<bool>(),
        any::<bool>(),
        0usize..3,
        prop::sample::select(vec![true, true, false]),
    );
    (
        1usize..=16,
        (1usize..=4, 0usize..2, 0usize..2, any::<bool>()),
        prop::collection::vec(encoder, 1..=3),
    )
        .prop_map(|(m, (pp, tp_sel, dp_sel, interleave), encoders)| {
            build(m, pp, tp_sel, dp_sel, interleave, &encoders)
        })
}

/// A random graph with random items per encoder replica and microbatch (0, 1 or 2, about
/// half of them 0), so that replicas without items occur in every kind of schedule.
pub fn arb_graph_with_work() -> impl Strategy<Value = (PipelineGraph, Work)> {
    arb_graph().prop_flat_map(|g| {
        let sink = g.sink();
        let shapes: Vec<(usize, usize)> = (0..g.modules().len())
            .filter(|&m| m != sink)
            .map(|m| (m, g.modules()[m].layout.dp()))
            .collect();
        let m = g.microbatches();
        let counts: Vec<_> = shapes
            .iter()
            .map(|&(module, dp)| {
                let n = prop::sample::select(vec![0usize, 0, 1, 2]);
                (Just(module), prop::collection::vec(prop::collection::vec(n, dp), m))
            })
            .collect();
        (Just(g), counts)
            .prop_map(|(g, counts)| (g, Work::new(counts.into_iter().collect::<BTreeMap<_, _>>())))
    })
}

fn build(
    m: usize,
    pp: usize,
    tp_sel: usize,
    dp_sel: usize,
    interleave: bool,
    encoders: &[EncoderChoice],
) -> PipelineGraph {
    let (tp, dp) = (1 + tp_sel, 1 + dp_sel);
    let n_llm = pp * tp * dp;
    let vpp = if interleave && pp > 1 && m.is_multiple_of(pp) { 2 } else { 1 };
    let llm_id = encoders.len();
    let mut modules = Vec::new();
    let mut edges = Vec::new();
    let mut next = n_llm;
    for (i, &(colocated, pp_e, tp_sel, dp_sel, offload, to_llm, hop, trainable)) in
        encoders.iter().enumerate()
    {
        let name = ["vision", "audio", "depth"][i];
        let m = if colocated {
            // A layout of the LLM's span: the largest pp <= pp_e dividing it, tp if it fits.
            let pp_e = (1..=pp_e).rev().find(|p| n_llm.is_multiple_of(*p)).unwrap_or(1);
            let tp_e = if tp_sel == 1 && (n_llm / pp_e).is_multiple_of(2) { 2 } else { 1 };
            module(name, Span::new(0, n_llm), tp_e, pp_e, 1, offload)
        } else {
            let size = pp_e * (1 + tp_sel) * (1 + dp_sel);
            let span = Span::new(next, next + size);
            next += size;
            module(name, span, 1 + tp_sel, pp_e, 1, false)
        };
        modules.push(PipeModule { trainable, ..m });
        // Feed a later encoder (a chain or, with the LLM too, a branch) and/or the LLM.
        let later = i + 1 + hop;
        let feeds_later = later < encoders.len();
        if feeds_later {
            edges.push((i, later));
        }
        if to_llm || !feeds_later {
            edges.push((i, llm_id));
        }
    }
    modules.push(module("llm", Span::new(0, n_llm), tp, pp, vpp, false));
    PipelineGraph::new(modules, edges, m).expect("random graphs are DAGs into the LLM")
}
