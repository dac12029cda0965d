//! Batch manifests (SEMANTICS.md section 3): per sample and edge how many boundary rows
//! exist and where they sit in the LLM sequence, and which replica owns what: the LLM's
//! replicas split the samples of a microbatch, an encoder's replicas split its items.
//!
//! Every rank computes boundary plans from the same manifest, so no shape handshake is
//! needed. A manifest carries sizes and positions only; payloads live in the data loader.

use std::ops::Range;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

use crate::edge::EdgeId;
use crate::error::{ConfigError, Result};
use crate::graph::ModelGraph;
use crate::ownership::{balanced_part, balanced_start};

/// One encoder input (an image, an audio clip) of a sample: `rows` boundary rows that fill
/// LLM positions `pos .. pos + rows`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    /// The edge that carries the item's rows.
    pub edge: EdgeId,
    /// First LLM position the rows fill.
    pub pos: usize,
    /// Rows the encoder produces for the item (may be 0).
    pub rows: usize,
}

/// One sample: its token count and its encoder items in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Tokens in the sequence, placeholders included (`<= seq_len`; the rest is padding).
    pub len: usize,
    /// Items sorted by position, non-overlapping, inside `0..len`.
    pub items: Vec<Item>,
}

/// An item of a microbatch named by its place in the manifest: `sample` (global index) and
/// `index` into that sample's `items`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ItemRef {
    /// Global sample index.
    pub sample: usize,
    /// Index into the sample's items (all edges).
    pub index: usize,
}

/// The encoder replica of `dp` that owns item `j` of `n` items in canonical order: replica
/// `d` owns `[d*n/dp, (d+1)*n/dp)` (floor division; SEMANTICS.md section 3).
pub fn item_replica(n: usize, dp: usize, j: usize) -> usize {
    balanced_part(n, dp, j)
}

/// The items `[d*n/dp, (d+1)*n/dp)` that replica `d` of `dp` owns out of `n`.
pub fn item_range(n: usize, dp: usize, d: usize) -> Range<usize> {
    assert!(d < dp, "replica {d} of dp {dp}");
    balanced_start(n, dp, d)..balanced_start(n, dp, d + 1)
}

/// Sizes and positions of every sample of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchManifest {
    seq_len: usize,
    n_microbatches: usize,
    samples: Vec<Sample>,
}

impl BatchManifest {
    /// Checks that samples split into `n_microbatches` and that every item fits its sample
    /// and names an edge below `n_edges`.
    pub fn new(
        seq_len: usize,
        n_microbatches: usize,
        n_edges: usize,
        samples: Vec<Sample>,
    ) -> Result<BatchManifest> {
        if n_microbatches == 0 || !samples.len().is_multiple_of(n_microbatches) {
            return Err(ConfigError::new(
                "manifest",
                format!(
                    "{} samples do not split into {n_microbatches} microbatches",
                    samples.len()
                ),
            ));
        }
        for (s, sample) in samples.iter().enumerate() {
            let err = |m: String| Err(ConfigError::new(format!("sample {s}"), m));
            if sample.len > seq_len {
                return err(format!("{} tokens exceed seq_len({seq_len})", sample.len));
            }
            let mut end = 0;
            for item in &sample.items {
                if item.edge >= n_edges {
                    return err(format!(
                        "item names edge {} but the graph has {n_edges}",
                        item.edge
                    ));
                }
                if item.pos < end || item.pos + item.rows > sample.len {
                    return err(format!(
                        "item at positions {}..{} overlaps the previous item (ends at {end}) or passes the sample length {}",
                        item.pos,
                        item.pos + item.rows,
                        sample.len
                    ));
                }
                end = item.pos + item.rows;
            }
        }
        Ok(BatchManifest { seq_len, n_microbatches, samples })
    }

    /// LLM sequence length.
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Global microbatches per step.
    pub fn n_microbatches(&self) -> usize {
        self.n_microbatches
    }

    /// All samples of the step, in canonical order.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Samples per global microbatch.
    pub fn microbatch_size(&self) -> usize {
        self.samples.len() / self.n_microbatches
    }

    /// Samples of global microbatch `k`.
    pub fn microbatch(&self, k: usize) -> Range<usize> {
        let mb = self.microbatch_size();
        k * mb..(k + 1) * mb
    }

    /// Samples owned by replica `dp_idx` of a module that splits samples (the LLM) with `dp`
    /// replicas in microbatch `k`: `[k*MB + d*MB/dp, k*MB + (d+1)*MB/dp)`. Panics unless `dp`
    /// divides `MB` (validated for the LLM).
    pub fn replica_samples(&self, dp: usize, dp_idx: usize, k: usize) -> Range<usize> {
        let mb = self.microbatch_size();
        assert!(
            mb.is_multiple_of(dp) && dp_idx < dp,
            "dp {dp} (replica {dp_idx}) does not split MB {mb}"
        );
        let per = mb / dp;
        k * mb + dp_idx * per..k * mb + (dp_idx + 1) * per
    }

    /// The replica of a `dp`-way module that splits samples (the LLM) owning `sample`.
    pub fn replica_of(&self, dp: usize, sample: usize) -> usize {
        let mb = self.microbatch_size();
        (sample % mb) / (mb / dp)
    }

    /// The items on `edge` of global microbatch `k` in canonical order: by sample, then by
    /// position in the sample. Encoder replicas split this list.
    pub fn microbatch_items(&self, edge: EdgeId, k: usize) -> Vec<ItemRef> {
        self.microbatch(k)
            .flat_map(|sample| {
                self.samples[sample]
                    .items
                    .iter()
                    .enumerate()
                    .filter(move |(_, it)| it.edge == edge)
                    .map(move |(index, _)| ItemRef { sample, index })
            })
            .collect()
    }

    /// Positions in [`Self::microbatch_items`] owned by replica `dp_idx` of an encoder with
    /// `dp` replicas: `[d*n/dp, (d+1)*n/dp)`; empty when the replica owns no item.
    pub fn replica_items(&self, edge: EdgeId, dp: usize, dp_idx: usize, k: usize) -> Range<usize> {
        item_range(self.microbatch_items(edge, k).len(), dp, dp_idx)
    }

    /// The item `r` names.
    pub fn item(&self, r: ItemRef) -> &Item {
        &self.samples[r.sample].items[r.index]
    }

    /// Items of `sample` on `edge`, in position order.
    pub fn edge_items(&self, sample: usize, edge: EdgeId) -> impl Iterator<Item = &Item> {
        self.samples[sample].items.iter().filter(move |i| i.edge == edge)
    }

    /// Boundary rows of `sample` on `edge`.
    pub fn edge_rows(&self, sample: usize, edge: EdgeId) -> usize {
        self.edge_items(sample, edge).map(|i| i.rows).sum()
    }

    /// The synthetic manifest of `step` for `graph`: per edge, each sample carries no item
    /// with probability 1/4 (so text-only samples occur) and otherwise `1..=max_items` items
    /// (`[data] max_items`, uniformly), placed between random text runs. Deterministic in
    /// `(train.seed, step)`; the synthetic dataset uses the same function.
    pub fn synthetic(graph: &ModelGraph, step: u64) -> BatchManifest {
        let seq_len = graph.train.seq_len;
        let max_items = graph.data.max_items;
        let mut rng =
            ChaCha8Rng::seed_from_u64(graph.train.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut below = |n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
        let samples = (0..graph.train.global_batch)
            .map(|_| {
                let mut sizes: Vec<(EdgeId, usize)> = Vec::new();
                for (id, e) in graph.edges.iter().enumerate() {
                    let rows = graph.modules[e.src].rows_per_item().expect("encoder source");
                    // One draw per edge when max_items is 1, so that default keeps the
                    // manifests of earlier releases.
                    let n = match (below(4), max_items) {
                        (0, _) => 0,
                        (_, 1) => 1,
                        (_, k) => 1 + below(k),
                    };
                    sizes.extend(std::iter::repeat_n((id, rows), n));
                }
                let rows: usize = sizes.iter().map(|&(_, r)| r).sum();
                let room = seq_len - rows; // >= 2, checked by the graph validation
                // At least two text tokens, so that the sample has a target (the same draws
                // as before wherever the room is 3 tokens or more).
                let text = room - below(room / 2 + 1).min(room.saturating_sub(2));
                // Item i starts after cuts[i] text tokens (at least one: a BOS comes first).
                let mut cuts: Vec<usize> = sizes.iter().map(|_| 1 + below(text)).collect();
                cuts.sort_unstable();
                let mut before = 0;
                let mut items = Vec::with_capacity(sizes.len());
                for (&(edge, rows), cut) in sizes.iter().zip(cuts) {
                    items.push(Item { edge, pos: cut + before, rows });
                    before += rows;
                }
                Sample { len: text + rows, items }
            })
            .collect();
        BatchManifest::new(seq_len, graph.train.microbatches, graph.edges.len(), samples)
            .expect("synthetic manifests are valid by construction")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize, items: &[(usize, usize)]) -> Sample {
        Sample {
            len,
            items: items.iter().map(|&(pos, rows)| Item { edge: 0, pos, rows }).collect(),
        }
    }

    #[test]
    fn replicas_own_contiguous_ranges_per_microbatch() {
        let m = BatchManifest::new(16, 2, 1, vec![sample(4, &[]); 12]).expect("valid");
        assert_eq!(m.microbatch_size(), 6);
        assert_eq!(m.replica_samples(3, 1, 1), 8..10);
        assert_eq!(m.replica_samples(2, 1, 0), 3..6);
        assert_eq!(m.replica_of(3, 9), 1);
        assert_eq!(m.replica_of(2, 9), 1);
        assert_eq!(m.replica_of(2, 8), 0);
    }

    #[test]
    fn encoder_replicas_own_contiguous_item_ranges() {
        // EXAMPLES.md case 6: 12 items over 8 replicas, then 3.
        let ranges = |n: usize| (0..8).map(|d| item_range(n, 8, d)).collect::<Vec<_>>();
        assert_eq!(ranges(12), [0..1, 1..3, 3..4, 4..6, 6..7, 7..9, 9..10, 10..12]);
        assert_eq!(ranges(3), [0..0, 0..0, 0..1, 1..1, 1..1, 1..2, 2..2, 2..3]);
        for n in 0..20 {
            for dp in 1..12 {
                for j in 0..n {
                    assert!(item_range(n, dp, item_replica(n, dp, j)).contains(&j), "{n} {dp} {j}");
                }
            }
        }
    }

    #[test]
    fn microbatch_items_follow_sample_then_position_per_edge() {
        let it = |edge, pos| Item { edge, pos, rows: 2 };
        let samples = vec![
            Sample { len: 12, items: vec![it(0, 1), it(1, 3), it(0, 6)] },
            Sample { len: 4, items: vec![] },
            Sample { len: 8, items: vec![it(0, 2)] },
            Sample { len: 8, items: vec![it(1, 1), it(0, 4)] },
        ];
        let m = BatchManifest::new(16, 2, 2, samples).expect("valid");
        let refs = |edge, k| {
            m.microbatch_items(edge, k).iter().map(|r| (r.sample, r.index)).collect::<Vec<_>>()
        };
        assert_eq!(refs(0, 0), [(0, 0), (0, 2)]);
        assert_eq!(refs(1, 0), [(0, 1)]);
        assert_eq!(refs(0, 1), [(2, 0), (3, 1)]);
        assert_eq!(m.replica_items(0, 3, 2, 1), 1..2);
        assert_eq!(m.replica_items(1, 3, 0, 0), 0..0);
    }

    #[test]
    fn overlapping_items_are_rejected_with_the_sample() {
        let e =
            BatchManifest::new(16, 1, 1, vec![sample(10, &[(1, 4), (3, 2)])]).expect_err("overlap");
        assert_eq!(
            e.to_string(),
            "sample 0: item at positions 3..5 overlaps the previous item (ends at 5) or passes the sample length 10"
        );
        let e = BatchManifest::new(8, 1, 1, vec![sample(9, &[])]).expect_err("too long");
        assert_eq!(e.to_string(), "sample 0: 9 tokens exceed seq_len(8)");
    }
}
