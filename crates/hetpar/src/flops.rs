//! Model FLOPs of a training step, for MFU: the planner's per-token formulas
//! (`hetpar_plan::ModuleShape`, Megatron's counting) applied to what the step computes: the
//! LLM over every position of every sample, each encoder over the rows of every item the
//! step's manifest holds for it.

use hetpar_layout::{BatchManifest, ModelGraph, ModuleSpec};
use hetpar_plan::{Mlp, ModuleShape};

/// Per module, its shape and how it counts tokens.
pub struct StepFlops {
    shapes: Vec<ModuleShape>,
    seq_len: usize,
    /// Per module: rows per item (encoders), `None` for the LLM.
    rows: Vec<Option<usize>>,
    /// Per module: the edges it feeds.
    edges: Vec<Vec<usize>>,
}

impl StepFlops {
    /// Each module's parameters (the planner's count: layers, embeddings or projector).
    pub fn module_params(&self) -> Vec<f64> {
        self.shapes.iter().map(ModuleShape::params).collect()
    }

    /// The shapes of `graph`'s modules.
    pub fn new(graph: &ModelGraph) -> StepFlops {
        let llm_hidden = graph
            .modules
            .iter()
            .find(|m| matches!(m.spec, ModuleSpec::Llama { .. }))
            .map_or(0, |m| m.dims.hidden);
        let shapes = graph
            .modules
            .iter()
            .map(|m| {
                let d = m.dims;
                let (vocab, kv_heads, experts, top_k) = match m.spec {
                    ModuleSpec::Llama { vocab, kv_heads, experts, top_k } => {
                        (vocab, kv_heads, experts, top_k)
                    }
                    _ => (0, d.heads, 0, 0),
                };
                let encoder = m.kind().is_encoder();
                ModuleShape {
                    name: m.name.clone(),
                    encoder,
                    hidden: d.hidden,
                    layers: d.layers,
                    heads: d.heads,
                    kv_heads,
                    ffn: d.ffn,
                    mlp: if encoder { Mlp::Gelu } else { Mlp::Swiglu },
                    vocab,
                    experts,
                    top_k,
                    out_hidden: if encoder { llm_hidden } else { 0 },
                }
            })
            .collect();
        let edges = (0..graph.modules.len())
            .map(|m| (0..graph.edges.len()).filter(|&e| graph.edges[e].src == m).collect())
            .collect();
        StepFlops {
            shapes,
            seq_len: graph.train.seq_len,
            rows: graph.modules.iter().map(|m| m.rows_per_item()).collect(),
            edges,
        }
    }

    /// Model FLOPs (forward and backward) of each module in the step of `manifest`.
    pub fn per_module(&self, manifest: &BatchManifest) -> Vec<f64> {
        let samples = manifest.samples();
        self.shapes
            .iter()
            .enumerate()
            .map(|(m, shape)| match self.rows[m] {
                None => shape.flops_per_token(self.seq_len) * (samples.len() * self.seq_len) as f64,
                Some(rows) => {
                    let items: usize = samples
                        .iter()
                        .flat_map(|s| &s.items)
                        .filter(|i| self.edges[m].contains(&i.edge))
                        .count();
                    shape.flops_per_token(rows) * (items * rows) as f64
                }
            })
            .collect()
    }
}
