//! A deterministic synthetic step with structure to learn, from the manifest alone (every
//! rank builds the same step; a rank makes only the items it runs):
//! - text follows a fixed random chain: after token `t` comes one of two successors of `t`,
//!   so a model that learns the chain reaches a loss of ln 2 on text;
//! - every item (image, clip) belongs to one of a few classes, drawn per (step, sample,
//!   item); its input is the class's fixed pattern plus noise, and the token right after it
//!   names the class (one token per class and edge), predicted from the item's last row, so
//!   only a model that reads the encoders' rows predicts it.

use candle_core::{Device, Tensor};
use hetpar_layout::{BatchManifest, EdgeId, ItemRef, ModelGraph, ModuleSpec};
use hetpar_nn::Init;

use crate::data::BatchSource;
use crate::error::RuntimeError;
use crate::stages::encoder::ItemSource;
use crate::stages::llama::{TextBatch, TextSource};

/// Classes of items per edge.
pub const CLASSES: usize = 4;

/// Synthetic text and encoder inputs for a model graph.
#[derive(Clone, Debug)]
pub struct Synthetic {
    graph: ModelGraph,
    seed: u64,
    vocab: usize,
    /// Input shape of each edge's items.
    shapes: Vec<Vec<usize>>,
}

/// A value in `[0, 1)` from a hash of `parts`.
fn unit(parts: &[u64]) -> f64 {
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for &p in parts {
        h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(h << 6).wrapping_add(h >> 2);
        h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^= h >> 31;
    }
    (h >> 11) as f64 / (1u64 << 53) as f64
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
        Synthetic { graph: graph.clone(), seed: graph.train.seed, vocab, shapes }
    }

    /// Tokens the chain uses: ids `1..chain`; the class tokens sit above it.
    fn chain(&self) -> u64 {
        (self.vocab - self.shapes.len() * CLASSES).max(2) as u64
    }

    /// The class token of `class` on `edge`.
    fn class_token(&self, edge: EdgeId, class: usize) -> u32 {
        (self.chain() as usize + edge * CLASSES + class).min(self.vocab - 1) as u32
    }

    /// The class of item `index` of `sample` in `step`.
    pub fn class(&self, step: usize, sample: usize, edge: EdgeId, index: usize) -> usize {
        let u = unit(&[self.seed, 1, step as u64, sample as u64, edge as u64, index as u64]);
        (u * CLASSES as f64) as usize
    }

    /// The token after `t` in the chain: one of its two successors, by `coin`.
    fn next(&self, t: u32, coin: bool) -> u32 {
        let n = self.chain() - 1;
        1 + (unit(&[self.seed, 2, u64::from(t), u64::from(coin)]) * n as f64) as u32
    }
}

impl BatchSource for Synthetic {
    fn manifest(&self, batch: usize) -> Result<BatchManifest, RuntimeError> {
        Ok(BatchManifest::synthetic(&self.graph, batch as u64))
    }
}

impl TextSource for Synthetic {
    fn text(&self, step: usize, manifest: &BatchManifest) -> Result<TextBatch, RuntimeError> {
        let seq = manifest.seq_len();
        let n = manifest.samples().len();
        let (mut tokens, mut targets) = (vec![0u32; n * seq], vec![-1i64; n * seq]);
        for (s, sample) in manifest.samples().iter().enumerate() {
            // Which positions hold item rows, and the class token after each item (items
            // named by their index in the sample, as `ItemRef` names them).
            let mut item_at = vec![false; sample.len];
            let mut class_after: Vec<Option<u32>> = vec![None; sample.len + 1];
            for (index, item) in sample.items.iter().enumerate() {
                item_at[item.pos..item.pos + item.rows].iter_mut().for_each(|x| *x = true);
                let class = self.class(step, s, item.edge, index);
                class_after[item.pos + item.rows] = Some(self.class_token(item.edge, class));
            }
            let mut prev = 1
                + (unit(&[self.seed, 3, step as u64, s as u64]) * (self.chain() - 1) as f64) as u32;
            for p in 0..sample.len {
                if item_at[p] {
                    continue;
                }
                let t = match class_after[p] {
                    Some(c) => c,
                    None if p == 0 => prev,
                    None => self
                        .next(prev, unit(&[self.seed, 4, step as u64, s as u64, p as u64]) < 0.5),
                };
                tokens[s * seq + p] = t;
                // After a class token the chain restarts from a token of its own.
                prev = if t as u64 >= self.chain() { 1 + t % (self.chain() as u32 - 1) } else { t };
            }
            // Next-token targets wherever the next position is text (from an item's last row
            // too: that is where the class token is predicted).
            for p in 0..sample.len.saturating_sub(1) {
                if !item_at[p + 1] {
                    targets[s * seq + p] = i64::from(tokens[s * seq + p + 1]);
                }
            }
        }
        Ok(TextBatch { seq, tokens, targets, score: false })
    }
}

impl ItemSource for Synthetic {
    fn item(
        &self,
        step: usize,
        _manifest: &BatchManifest,
        edge: EdgeId,
        item: ItemRef,
    ) -> Result<Tensor, RuntimeError> {
        let shape = &self.shapes[edge];
        let len: usize = shape.iter().product();
        let class = self.class(step, item.sample, edge, item.index);
        // The class's fixed pattern plus noise of half its scale.
        let pattern = format!("edge{edge}.class{class}");
        let noise = format!("edge{edge}.noise");
        let base = ((step * 4096 + item.sample) * 64 + item.index) * len;
        let v: Vec<f32> = (0..len)
            .map(|i| {
                let p = Init::Normal(1.0).value(self.seed, &pattern, i as u64);
                let e = Init::Normal(0.5).value(self.seed, &noise, (base + i) as u64);
                (p + e) as f32
            })
            .collect();
        Ok(Tensor::from_vec(v, shape.as_slice(), &Device::Cpu)?)
    }
}
