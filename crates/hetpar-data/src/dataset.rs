//! A LLaVA-format dataset opened for one model: every record checked and encoded once
//! (metadata only: token ids, targets, where each item's rows go), the order records are
//! drawn in, and each item's payload (pixels, log-mel frames) decoded on demand by the
//! ranks that consume it.
//!
//! Opening reads the JSON and the tokenizer and checks what can be checked without
//! decoding a payload (RELIABILITY.md row 9): placeholders against listed media, unknown
//! placeholders, a missing file, a record that cannot fit `seq_len`. Under
//! [`BadData::Error`] the first such record stops the run with an error naming it; under
//! [`BadData::Skip`] it is left out and counted, with its reason, in [`Dataset::skipped`].
//! Either way the records that remain always have their encoder rows where their text
//! says. A file that exists but cannot be decoded is found only by the rank that decodes
//! it, mid-step, when every rank has already built the step's manifest; that is an error
//! naming the record and the file under both policies, since skipping it then would
//! misalign the step.
//!
//! Draw order: sample `j` of step `s` is draw `c = s * global_batch + j`, record
//! `perm_e[c mod n]` of epoch `e = c / n`, where `perm_e` is a shuffle seeded by the seed and
//! `e` alone. The data position is therefore the step: a run resumed at step `s` draws what
//! the uninterrupted run drew, under any layout.

use std::path::PathBuf;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

use crate::chat::{self, Encoded, Kind, Vocab};
use crate::error::{DataError, Result};
use crate::llava::{self, Record};
use crate::mel::{self, LogMel};
use crate::pixels;

/// What to do with a record that cannot be used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BadData {
    /// Stop with an error naming it.
    #[default]
    Error,
    /// Leave it out and count it.
    Skip,
}

/// The front ends the model's encoders need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fronts {
    /// Images: the ViT's square side and rows per image.
    pub image: Option<(u32, usize)>,
    /// Clips: the audio encoder's mel bands, its input frames and rows per clip.
    pub audio: Option<(usize, usize, usize)>,
}

/// Where a dataset is and how the model reads it.
#[derive(Clone, Debug)]
pub struct DatasetSpec {
    /// The LLaVA JSON file.
    pub path: PathBuf,
    /// Directory the records' media paths are relative to.
    pub media_root: PathBuf,
    /// The `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// LLM sequence length.
    pub seq_len: usize,
    /// The LLM's vocabulary size (the tokenizer must fit in it).
    pub vocab: usize,
    /// The encoders' front ends.
    pub fronts: Fronts,
    /// The bad-data policy.
    pub on_bad: BadData,
}

/// A record left out, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// The record's id.
    pub id: String,
    /// Its position in the file.
    pub index: usize,
    /// Why.
    pub reason: String,
}

/// How a record whose media file is not there is reported (its reason begins so).
pub const MISSING: &str = "missing file";

/// One usable record.
#[derive(Clone, Debug)]
pub struct Entry {
    /// The record as read.
    pub record: Record,
    /// Its position in the file.
    pub index: usize,
    /// What the LLM sees of it.
    pub encoded: Encoded,
}

/// A decoded payload: values and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Payload {
    /// Row-major values.
    pub values: Vec<f32>,
    /// `[3, size, size]` or `[n_mels, frames]`.
    pub shape: Vec<usize>,
}

/// A payload decoded, with what was cut to fit its encoder.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    /// The encoder's input.
    pub payload: Payload,
    /// Samples of a clip past the audio encoder's frames, left out (0 for images).
    pub cut: usize,
}

/// One assistant answer of a sample: the positions that predict its tokens (its text and
/// the `<|end|>` closing it) and the kind of the turn it answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Positions `p` whose target (the token at `p + 1`) belongs to the answer.
    pub positions: std::ops::Range<usize>,
    /// "image", "audio" or "text": what the question before it was about.
    pub kind: &'static str,
}

/// An opened dataset.
#[derive(Debug)]
pub struct Dataset {
    spec: DatasetSpec,
    entries: Vec<Entry>,
    skipped: Vec<Skipped>,
    mel: Option<LogMel>,
    /// The id of `<|end|>`.
    end: u32,
}

impl Dataset {
    /// Reads, checks and encodes every record of `spec.path`.
    pub fn open(spec: DatasetSpec) -> Result<Dataset> {
        let vocab = Vocab::load(&spec.tokenizer)?;
        if vocab.len() > spec.vocab {
            return Err(DataError::Options(format!(
                "{} holds {} tokens; the LLM's vocabulary (modules.llm.vocab = {}) must hold at least as many",
                spec.tokenizer.display(),
                vocab.len(),
                spec.vocab
            )));
        }
        let records = llava::read_each(&spec.path)?;
        let (image_rows, audio_rows) =
            (spec.fronts.image.map_or(0, |f| f.1), spec.fronts.audio.map_or(0, |f| f.2));
        let (mut entries, mut skipped) = (Vec::new(), Vec::new());
        for (index, read) in records.into_iter().enumerate() {
            let usable = match read {
                Err(u) => Err((u.id, u.message)),
                Ok(record) => match Self::usable(&spec, &record).and_then(|()| {
                    chat::encode(&vocab, &record, image_rows, audio_rows, spec.seq_len)
                }) {
                    Ok(encoded) => Ok((record, encoded)),
                    Err(reason) => Err((record.id, reason)),
                },
            };
            match usable {
                Ok((record, encoded)) => entries.push(Entry { record, index, encoded }),
                Err((id, reason)) if spec.on_bad == BadData::Skip => {
                    skipped.push(Skipped { id, index, reason });
                }
                Err((id, message)) => {
                    return Err(DataError::Record {
                        path: spec.path.clone(),
                        index,
                        id,
                        message: format!(
                            "{message} (data.on_bad = \"skip\" leaves such records out)"
                        ),
                    });
                }
            }
        }
        // Every record with media gone for missing files, under `skip`, is a media root
        // that points elsewhere, not a few bad records: training on the text alone would
        // run and say little.
        let missing = skipped.iter().find(|s| s.reason.starts_with(MISSING));
        let with_media = |e: &Entry| !(e.record.image.is_empty() && e.record.audio.is_empty());
        if let Some(first) = missing
            && !entries.iter().any(with_media)
        {
            return Err(DataError::Options(format!(
                "every record with media was left out, {} of them for missing files (the first, record {} (id {:?}): {}), leaving {} text-only records: is the media root {} right (data.image_root, default the records' directory)?",
                skipped.iter().filter(|s| s.reason.starts_with(MISSING)).count(),
                first.index,
                first.id,
                first.reason,
                entries.len(),
                spec.media_root.display()
            )));
        }
        if entries.is_empty() {
            let first = skipped.first().map_or_else(String::new, |s| {
                format!("; the first, record {} (id {:?}): {}", s.index, s.id, s.reason)
            });
            // An option error: the caller names the file first.
            return Err(DataError::Options(format!(
                "no usable record ({} left out{first})",
                skipped.len()
            )));
        }
        let mel = spec.fronts.audio.map(|(n_mels, _, _)| LogMel::new(n_mels));
        let end = vocab.id(chat::END).expect("a special token");
        Ok(Dataset { spec, entries, skipped, mel, end })
    }

    /// Whether `record` can be used by this model, short of decoding its payloads.
    fn usable(spec: &DatasetSpec, record: &Record) -> std::result::Result<(), String> {
        record.check()?;
        for (kind, media, front) in [
            ("image", &record.image, spec.fronts.image.is_some()),
            ("audio clip", &record.audio, spec.fronts.audio.is_some()),
        ] {
            if !media.is_empty() && !front {
                return Err(format!("it has an {kind} but the model has no encoder for it"));
            }
            for p in media.paths() {
                if let Some(missing) = llava::not_a_file(&spec.media_root.join(p)) {
                    return Err(missing);
                }
            }
        }
        Ok(())
    }

    /// The usable records, in file order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Records left out under [`BadData::Skip`].
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }

    /// The spec it was opened with.
    pub fn spec(&self) -> &DatasetSpec {
        &self.spec
    }

    /// The entries of training step `step`: `batch` draws from the shuffled epochs of
    /// `seed` (see the module docs).
    pub fn step_entries(&self, seed: u64, step: usize, batch: usize) -> Vec<usize> {
        let n = self.entries.len();
        let mut cached: Option<(usize, Vec<usize>)> = None;
        (0..batch)
            .map(|j| {
                let c = step * batch + j;
                let epoch = c / n;
                if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    cached = Some((epoch, shuffle(n, seed, epoch as u64)));
                }
                cached.as_ref().map(|(_, p)| p[c % n]).expect("filled above")
            })
            .collect()
    }

    /// The entries of evaluation batch `b` of `batch` records: every record once, in file
    /// order; the last batch is filled up from the start, and `scored` says which slots
    /// count (each record counts once).
    pub fn eval_entries(&self, b: usize, batch: usize) -> (Vec<usize>, Vec<bool>) {
        let n = self.entries.len();
        (0..batch).map(|j| ((b * batch + j) % n, b * batch + j < n)).unzip()
    }

    /// Evaluation batches of `batch` records that cover every record.
    pub fn eval_batches(&self, batch: usize) -> usize {
        self.entries.len().div_ceil(batch.max(1))
    }

    /// The payload of item `k` (in sequence order) of entry `e`: an image's pixels or a
    /// clip's log-mel frames (the clip zero-padded or cut to the encoder's frames first,
    /// as Whisper pads or cuts to 30 s). An unreadable file is an error naming the record.
    pub fn payload(&self, e: usize, k: usize) -> Result<Payload> {
        self.decode(e, k).map(|d| d.payload)
    }

    /// [`Self::payload`], with the samples of a clip past the audio encoder's frames, cut
    /// off.
    pub fn decode(&self, e: usize, k: usize) -> Result<Decoded> {
        let entry = &self.entries[e];
        let item = entry.encoded.items.get(k).ok_or_else(|| {
            self.record_error(
                entry,
                format!("has no item {k} ({} in all)", entry.encoded.items.len()),
            )
        })?;
        let named = |err: DataError| self.record_error(entry, err.to_string());
        match item.kind {
            Kind::Image => {
                let (size, _) = self.spec.fronts.image.expect("checked at open");
                let file = self.spec.media_root.join(entry.record.image.paths()[item.index]);
                let values = pixels::load_image(&file, size).map_err(named)?;
                let s = size as usize;
                Ok(Decoded { payload: Payload { values, shape: vec![3, s, s] }, cut: 0 })
            }
            Kind::Audio => {
                let (n_mels, frames, _) = self.spec.fronts.audio.expect("checked at open");
                let file = self.spec.media_root.join(entry.record.audio.paths()[item.index]);
                let mut clip = mel::read_wav(&file).map_err(named)?;
                let cut = clip.len().saturating_sub(mel::clip_samples(frames));
                clip.resize(mel::clip_samples(frames), 0.0);
                let mel = self.mel.as_ref().expect("made at open");
                let values = mel.compute(&clip).map_err(named)?;
                Ok(Decoded { payload: Payload { values, shape: vec![n_mels, frames] }, cut })
            }
        }
    }

    /// The answers of entry `e` (only those whose every position fits `seq_len`).
    pub fn answers(&self, e: usize) -> Vec<Answer> {
        let enc = &self.entries[e].encoded;
        let targets = enc.targets();
        let mut out = Vec::new();
        let mut p = 0;
        while p < targets.len() {
            if targets[p] < 0 {
                p += 1;
                continue;
            }
            let start = p;
            while p < targets.len() && targets[p] >= 0 {
                p += 1;
            }
            // The question is the user turn before the answer: its items sit between the
            // previous answer and this one.
            let before = out.last().map_or(0, |a: &Answer| a.positions.end);
            let kind = enc
                .items
                .iter()
                .filter(|i| (before..start).contains(&i.position))
                .map(|i| match i.kind {
                    Kind::Image => "image",
                    Kind::Audio => "audio",
                })
                .next()
                .unwrap_or("text");
            // An answer cut by truncation (no closing marker) would count as wrong for
            // tokens it never had.
            if targets[p - 1] == i64::from(self.end) {
                out.push(Answer { positions: start..p, kind });
            }
        }
        out
    }

    fn record_error(&self, entry: &Entry, message: String) -> DataError {
        DataError::Record {
            path: self.spec.path.clone(),
            index: entry.index,
            id: entry.record.id.clone(),
            message,
        }
    }
}

/// A permutation of `0..n` seeded by `seed` and `epoch` (Fisher-Yates).
fn shuffle(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (epoch + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}
