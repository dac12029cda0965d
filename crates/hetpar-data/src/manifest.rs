//! A step's `BatchManifest` from records' metadata alone: every rank builds the same one
//! from the encoded sequences (positions and rows of each item), without decoding an image
//! or a clip.
//!
//! Each kind of item goes over the one edge whose source is an encoder of that kind (the
//! ViT takes images, the audio encoder clips); a record with an item the graph has no
//! encoder for is refused, naming the record, as is a graph with two encoders of one kind
//! (which would need a rule saying which image goes where).

use hetpar_layout::config::ModuleKind;
use hetpar_layout::{BatchManifest, EdgeId, ModelGraph, manifest};

use crate::chat::{Encoded, Kind};

/// The edge each kind of item travels on, and the rows one item gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edges {
    /// Images: the ViT's edge and its patches per image.
    pub image: Option<(EdgeId, usize)>,
    /// Clips: the audio encoder's edge and its rows per clip.
    pub audio: Option<(EdgeId, usize)>,
}

impl Edges {
    /// The edges of `graph` by the kind of their source.
    pub fn of(graph: &ModelGraph) -> Result<Edges, String> {
        let mut edges = Edges { image: None, audio: None };
        for (id, e) in graph.edges.iter().enumerate() {
            let src = &graph.modules[e.src];
            let rows = src.rows_per_item().ok_or_else(|| format!("edge {id} leaves the LLM"))?;
            let slot = match src.kind() {
                ModuleKind::Vit => &mut edges.image,
                ModuleKind::Audio => &mut edges.audio,
                ModuleKind::Llama => continue,
            };
            if slot.is_some() {
                return Err(format!(
                    "two {} encoders feed the LLM; a data file cannot say which of them an item is for",
                    src.kind().name()
                ));
            }
            *slot = Some((id, rows));
        }
        Ok(edges)
    }

    /// Rows per image and per clip (0 where the graph has no such encoder).
    pub fn rows(&self) -> (usize, usize) {
        (self.image.map_or(0, |e| e.1), self.audio.map_or(0, |e| e.1))
    }
}

/// The manifest sample of an encoded record (`id` names it in errors).
pub fn sample(id: &str, e: &Encoded, edges: &Edges) -> Result<manifest::Sample, String> {
    let items = e
        .items
        .iter()
        .map(|it| {
            let (edge, rows) = match it.kind {
                Kind::Image => edges.image,
                Kind::Audio => edges.audio,
            }
            .ok_or_else(|| {
                format!(
                    "record {id} has an {} item but the model has no encoder for it",
                    it.kind.name()
                )
            })?;
            if rows != it.rows {
                return Err(format!(
                    "record {id}: {} {} was encoded with {} rows, its encoder gives {rows}",
                    it.kind.name(),
                    it.index,
                    it.rows
                ));
            }
            Ok(manifest::Item { edge, pos: it.position, rows })
        })
        .collect::<Result<_, String>>()?;
    Ok(manifest::Sample { len: e.length - e.truncated, items })
}

/// The manifest of a step whose samples are `records` (id and encoding, in step order).
pub fn step_manifest(
    graph: &ModelGraph,
    records: &[(&str, &Encoded)],
) -> Result<BatchManifest, String> {
    let edges = Edges::of(graph)?;
    let samples =
        records.iter().map(|(id, e)| sample(id, e, &edges)).collect::<Result<Vec<_>, String>>()?;
    BatchManifest::new(graph.train.seq_len, graph.train.microbatches, graph.edges.len(), samples)
        .map_err(|e| e.to_string())
}
