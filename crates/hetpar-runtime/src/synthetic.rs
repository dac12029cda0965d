//! A deterministic synthetic step: token ids drawn per (step, sample, position), encoder
//! inputs per (step, sample, item), both from the manifest alone, so every rank builds the
//! same step and a rank decodes only the items it runs.

use candle_core::{Device, Tensor};
use hetpar_layout::{BatchManifest, EdgeId, ItemRef, ModelGraph, ModuleSpec};
use hetpar_nn::Init;

use crate::error::RuntimeError;
use crate::stages::encoder::ItemSource;
use crate::stages::llama::{TextBatch, TextSource};

/// Synthetic text and encoder inputs for a model graph.
#[derive(Clone, Debug)]
pub struct Synthetic {
    seed: u64,
    vocab: usize,
    /// Input shape of each edge's items.
    shapes: Vec<Vec<usize>>,
}

impl Synthetic {
    /// The synthetic data of `graph` (its seed, vocabulary and encoder input shapes).
    pub fn new(graph: &ModelGraph) -> Synthetic {
        let vocab = graph
            .modules
            .iter()
            .find_map(|m| match m.spec {
                ModuleSpec::Llama { vocab, .. } => Some(vocab),
                _ => None,
            })
            .expect("a validated graph has an LLM");
        let shapes = graph
            .edges
            .iter()
            .map(|e| match graph.modules[e.src].spec {
                ModuleSpec::Vit { image_size, .. } => vec![3, image_size, image_size],
                ModuleSpec::Audio { n_mels, frames } => vec![n_mels, frames],
                ModuleSpec::Llama { .. } => unreachable!("an edge starts at an encoder"),
            })
            .collect();
        Synthetic { seed: graph.train.seed, vocab, shapes }
    }

    fn draw(&self, what: &str, step: usize, index: u64) -> f64 {
        Init::Normal(1.0).value(self.seed ^ (step as u64).wrapping_mul(0x9E37_79B9), what, index)
    }
}

impl TextSource for Synthetic {
    fn text(&self, step: usize, manifest: &BatchManifest) -> Result<TextBatch, RuntimeError> {
        let seq = manifest.seq_len();
        let n = manifest.samples().len();
        let (mut tokens, mut targets) = (vec![0u32; n * seq], vec![-1i64; n * seq]);
        for (s, sample) in manifest.samples().iter().enumerate() {
            let mut text = vec![true; sample.len];
            for item in &sample.items {
                text[item.pos..item.pos + item.rows].iter_mut().for_each(|t| *t = false);
            }
            for p in 0..sample.len {
                if text[p] {
                    let u = self.draw("tokens", step, (s * seq + p) as u64).abs();
                    tokens[s * seq + p] = 1 + (u * 1e6) as u32 % (self.vocab as u32 - 1);
                }
            }
            // Next-token targets between text positions only.
            for p in 0..sample.len.saturating_sub(1) {
                if text[p] && text[p + 1] {
                    targets[s * seq + p] = i64::from(tokens[s * seq + p + 1]);
                }
            }
        }
        Ok(TextBatch { seq, tokens, targets })
    }
}

impl ItemSource for Synthetic {
    fn item(
        &self,
        step: usize,
        manifest: &BatchManifest,
        edge: EdgeId,
        item: ItemRef,
    ) -> Result<Tensor, RuntimeError> {
        let shape = &self.shapes[edge];
        let len: usize = shape.iter().product();
        let base = ((item.sample * 64 + item.index) * len) as u64;
        let _ = manifest;
        let v: Vec<f32> = (0..len)
            .map(|i| self.draw(&format!("edge{edge}"), step, base + i as u64) as f32)
            .collect();
        Ok(Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?)
    }
}
