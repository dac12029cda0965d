//! Training and held-out batches from files (`hetpar-data`'s [`Dataset`]), for one rank.
//!
//! Every rank builds a batch's manifest, token ids and targets from the records' metadata
//! alone (encoded once when the dataset was opened). Payloads (an image's pixels, a clip's
//! log-mel frames) are decoded only on the ranks that run the item: the first pipeline
//! stage of the encoder replica that owns it, on each of its tp and cp ranks. A loader
//! thread decodes them ahead: asking for batch `b`'s manifest queues `b` and `b + 1`, so
//! the next step's payloads are ready while the current step runs. Time a rank spends
//! blocked on the loader is its data wait ([`BatchSource::waited`]).
//!
//! Batch ids: training step `s` is batch `s`; held-out batch `h` is `HELDOUT + h`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use candle_core::{Device, Tensor};
use hetpar_data::Dataset;
use hetpar_data::dataset::{Answer, Payload};
use hetpar_data::manifest::step_manifest;
use hetpar_layout::{BatchManifest, EdgeId, ItemRef, ModelGraph, ModuleSpec};

use crate::error::RuntimeError;
use crate::stages::encoder::ItemSource;
use crate::stages::llama::{TextBatch, TextSource};

/// The first held-out batch id.
pub const HELDOUT: usize = 1 << 40;

/// What decides a batch: its manifest, the same on every rank.
pub trait BatchSource: Send + Sync {
    /// The manifest of batch `batch`.
    fn manifest(&self, batch: usize) -> Result<BatchManifest, RuntimeError>;
    /// Held-out batches there are (0: no held-out split).
    fn heldout_batches(&self) -> usize {
        0
    }
    /// The answers of each sample of held-out batch `batch` that count (empty for a slot
    /// that repeats a record to fill the batch).
    fn answers(&self, _batch: usize) -> Result<Vec<Vec<Answer>>, RuntimeError> {
        Ok(Vec::new())
    }
    /// Seconds this rank has waited for data so far.
    fn waited(&self) -> f64 {
        0.0
    }
    /// Payloads this rank has decoded so far.
    fn decodes(&self) -> usize {
        0
    }
    /// Of them, clips longer than their audio encoder's input, cut to it.
    fn cuts(&self) -> usize {
        0
    }
}

/// Which records a batch holds.
struct Drawn<'a> {
    dataset: &'a Dataset,
    entries: Vec<usize>,
    scored: Vec<bool>,
}

/// One batch's decoded payloads by (sample, item index in the sample).
type Decoded = HashMap<(usize, usize), Result<Payload, String>>;

/// A loader job: a batch and the (sample, item index) pairs this rank runs in it.
type Job = (usize, Vec<(usize, usize)>);

/// What the loader thread shares with the rank.
struct Shared {
    train: Arc<Dataset>,
    heldout: Option<Arc<Dataset>>,
    seed: u64,
    batch: usize,
    /// Decoded payloads by batch (a batch is present once all of its items are).
    ready: Mutex<BTreeMap<usize, Decoded>>,
    cond: Condvar,
    decodes: AtomicUsize,
    /// Of them, clips cut to their encoder's input.
    cuts: AtomicUsize,
}

impl Shared {
    fn drawn(&self, batch: usize) -> Result<Drawn<'_>, RuntimeError> {
        if batch >= HELDOUT {
            let h = batch - HELDOUT;
            let ds = self.heldout.as_deref().ok_or_else(|| {
                RuntimeError::Data("this run has no held-out records (data.heldout)".into())
            })?;
            if h >= ds.eval_batches(self.batch) {
                return Err(RuntimeError::Data(format!(
                    "held-out batch {h} of {}",
                    ds.eval_batches(self.batch)
                )));
            }
            let (entries, scored) = ds.eval_entries(h, self.batch);
            Ok(Drawn { dataset: ds, entries, scored })
        } else {
            let entries = self.train.step_entries(self.seed, batch, self.batch);
            let scored = vec![false; entries.len()];
            Ok(Drawn { dataset: &self.train, entries, scored })
        }
    }

    fn decode(&self, batch: usize, sample: usize, index: usize) -> Result<Payload, String> {
        let drawn = self.drawn(batch).map_err(|e| e.to_string())?;
        self.decode_drawn(&drawn, sample, index)
    }

    /// Item `index` of `sample` of a batch already drawn.
    fn decode_drawn(
        &self,
        drawn: &Drawn<'_>,
        sample: usize,
        index: usize,
    ) -> Result<Payload, String> {
        self.decodes.fetch_add(1, Ordering::Relaxed);
        let d = drawn.dataset.decode(drawn.entries[sample], index).map_err(|e| e.to_string())?;
        if d.cut > 0 {
            self.cuts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(d.payload)
    }
}

/// One rank's file-backed data: manifests and text for every rank, payloads for the items
/// it runs, decoded ahead on a loader thread.
pub struct FileData {
    shared: Arc<Shared>,
    graph: ModelGraph,
    /// This rank's encoder replicas that read items: (edge, dp, dp_idx).
    consumes: Vec<(EdgeId, usize, usize)>,
    jobs: Mutex<Sender<Job>>,
    /// Batches already queued.
    queued: Mutex<Vec<usize>>,
    /// Nanoseconds waited.
    waited: AtomicUsize,
}

impl std::fmt::Debug for FileData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileData({} records)", self.shared.train.entries().len())
    }
}

impl FileData {
    /// Rank `rank`'s view of `train` (and `heldout`) for `graph`.
    pub fn new(
        graph: &ModelGraph,
        rank: usize,
        train: Arc<Dataset>,
        heldout: Option<Arc<Dataset>>,
    ) -> FileData {
        let consumes = graph
            .edges
            .iter()
            .enumerate()
            .filter_map(|(e, edge)| {
                let layout = &graph.modules[edge.src].layout;
                let c = layout.coords(rank)?;
                (c.pp_idx == 0).then_some((e, layout.dp(), c.dp_idx))
            })
            .collect();
        let shared = Arc::new(Shared {
            train,
            heldout,
            seed: graph.train.seed,
            batch: graph.train.global_batch,
            ready: Mutex::new(BTreeMap::new()),
            cond: Condvar::new(),
            decodes: AtomicUsize::new(0),
            cuts: AtomicUsize::new(0),
        });
        let (tx, rx) = channel();
        let worker = shared.clone();
        std::thread::Builder::new()
            .name(format!("hetpar-loader-{rank}"))
            .spawn(move || load(&worker, &rx))
            .expect("spawning the loader thread");
        FileData {
            shared,
            graph: graph.clone(),
            consumes,
            jobs: Mutex::new(tx),
            queued: Mutex::new(Vec::new()),
            waited: AtomicUsize::new(0),
        }
    }

    fn build(&self, batch: usize) -> Result<BatchManifest, RuntimeError> {
        let drawn = self.shared.drawn(batch)?;
        manifest_of(&self.graph, drawn.dataset, &drawn.entries)
    }

    /// Queues the decoding of this rank's items of `batch` (once).
    fn queue(&self, batch: usize) -> Result<(), RuntimeError> {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if queued.contains(&batch) {
            return Ok(());
        }
        let manifest = match self.build(batch) {
            Ok(m) => m,
            // Past the last held-out batch: nothing to prefetch.
            Err(_) if batch > HELDOUT => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut items = Vec::new();
        for &(edge, dp, d) in &self.consumes {
            for mb in 0..manifest.n_microbatches() {
                let all = manifest.microbatch_items(edge, mb);
                items.extend(
                    all[manifest.replica_items(edge, dp, d, mb)]
                        .iter()
                        .map(|r| (r.sample, r.index)),
                );
            }
        }
        queued.push(batch);
        // Keep the two newest batches' payloads.
        if queued.len() > 2 {
            let old = queued.remove(0);
            self.shared.ready.lock().unwrap_or_else(|e| e.into_inner()).remove(&old);
        }
        let _ = self.jobs.lock().unwrap_or_else(|e| e.into_inner()).send((batch, items));
        Ok(())
    }
}

/// The manifest of the records `entries` of `dataset`, in that order.
fn manifest_of(
    graph: &ModelGraph,
    dataset: &Dataset,
    entries: &[usize],
) -> Result<BatchManifest, RuntimeError> {
    let records: Vec<(&str, &hetpar_data::chat::Encoded)> = entries
        .iter()
        .map(|&e| {
            let entry = &dataset.entries()[e];
            (entry.record.id.as_str(), &entry.encoded)
        })
        .collect();
    step_manifest(graph, &records).map_err(RuntimeError::Data)
}

/// The manifest of training step `step` of a run of `graph` on `train`: the records it
/// draws, as every rank's [`FileData`] builds it, without a loader or any decoding (for
/// commands that plan a step of the run's data).
pub fn train_manifest(
    graph: &ModelGraph,
    train: &Dataset,
    step: usize,
) -> Result<BatchManifest, RuntimeError> {
    let entries = train.step_entries(graph.train.seed, step, graph.train.global_batch);
    manifest_of(graph, train, &entries)
}

/// The loader thread: decodes each queued batch's items, publishing a batch when all are
/// done; it ends when its rank drops the sender.
fn load(shared: &Shared, jobs: &Receiver<Job>) {
    while let Ok((batch, items)) = jobs.recv() {
        // The batch's records are drawn once for all its items.
        let done: Decoded = match shared.drawn(batch) {
            Ok(drawn) => items
                .into_iter()
                .map(|(s, i)| ((s, i), shared.decode_drawn(&drawn, s, i)))
                .collect(),
            Err(e) => items.into_iter().map(|(s, i)| ((s, i), Err(e.to_string()))).collect(),
        };
        shared.ready.lock().unwrap_or_else(|e| e.into_inner()).insert(batch, done);
        shared.cond.notify_all();
    }
}

impl BatchSource for FileData {
    fn manifest(&self, batch: usize) -> Result<BatchManifest, RuntimeError> {
        let start = Instant::now();
        let m = self.build(batch)?;
        self.queue(batch)?;
        self.queue(batch + 1)?;
        self.waited.fetch_add(start.elapsed().as_nanos() as usize, Ordering::Relaxed);
        Ok(m)
    }

    fn heldout_batches(&self) -> usize {
        self.shared.heldout.as_ref().map_or(0, |h| h.eval_batches(self.shared.batch))
    }

    fn answers(&self, batch: usize) -> Result<Vec<Vec<Answer>>, RuntimeError> {
        let drawn = self.shared.drawn(batch)?;
        Ok(drawn
            .entries
            .iter()
            .zip(&drawn.scored)
            .map(|(&e, &s)| if s { drawn.dataset.answers(e) } else { Vec::new() })
            .collect())
    }

    fn waited(&self) -> f64 {
        self.waited.load(Ordering::Relaxed) as f64 * 1e-9
    }

    fn decodes(&self) -> usize {
        self.shared.decodes.load(Ordering::Relaxed)
    }

    fn cuts(&self) -> usize {
        self.shared.cuts.load(Ordering::Relaxed)
    }
}

impl TextSource for FileData {
    fn text(&self, batch: usize, manifest: &BatchManifest) -> Result<TextBatch, RuntimeError> {
        let drawn = self.shared.drawn(batch)?;
        let seq = manifest.seq_len();
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        // Held-out batches score each target: whether the model's top token is it. A slot
        // that repeats a record to fill the last held-out batch has no target, so each
        // record counts once in the loss and the scores.
        let score = batch >= HELDOUT;
        for (&e, &scored) in drawn.entries.iter().zip(&drawn.scored) {
            let enc = &drawn.dataset.entries()[e].encoded;
            enc.extend_ids(&mut tokens, seq);
            if score && !scored {
                targets.extend(std::iter::repeat_n(-1, seq));
            } else {
                enc.extend_targets(&mut targets, seq);
            }
        }
        Ok(TextBatch { seq, tokens, targets, score })
    }
}

impl ItemSource for FileData {
    fn item(
        &self,
        batch: usize,
        _manifest: &BatchManifest,
        edge: EdgeId,
        item: ItemRef,
    ) -> Result<Tensor, RuntimeError> {
        let start = Instant::now();
        let queued = self.queued.lock().unwrap_or_else(|e| e.into_inner()).contains(&batch);
        let payload = if queued {
            let mut ready = self.shared.ready.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                // Kept until the batch is evicted: a recomputed forward asks again.
                if let Some(done) = ready.get(&batch) {
                    break done.get(&(item.sample, item.index)).cloned();
                }
                // The loader holds the other reference while it runs.
                if Arc::strong_count(&self.shared) < 2 {
                    return Err(RuntimeError::Data("the loader thread has ended".into()));
                }
                let wait = self.shared.cond.wait_timeout(ready, std::time::Duration::from_secs(1));
                ready = wait.unwrap_or_else(|e| e.into_inner()).0;
            }
        } else {
            None
        };
        // An item the loader was not asked for (a batch not queued) is decoded here.
        let payload = match payload {
            Some(p) => p,
            None => self.shared.decode(batch, item.sample, item.index),
        }
        .map_err(RuntimeError::Data)?;
        self.waited.fetch_add(start.elapsed().as_nanos() as usize, Ordering::Relaxed);
        let want = match self.graph.modules[self.graph.edges[edge].src].spec {
            ModuleSpec::Vit { image_size, .. } => vec![3, image_size, image_size],
            ModuleSpec::Audio { n_mels, frames } => vec![n_mels, frames],
            ModuleSpec::Llama { .. } => Vec::new(),
        };
        if payload.shape != want {
            return Err(RuntimeError::Data(format!(
                "item {} of sample {} decoded to {:?}, edge {edge} takes {want:?}",
                item.index, item.sample, payload.shape
            )));
        }
        Ok(Tensor::from_vec(payload.values, payload.shape.as_slice(), &Device::Cpu)?)
    }
}
