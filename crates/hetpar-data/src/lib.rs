//! Multimodal training data in the format the ecosystem uses.
//!
//! - [`llava`]: LLaVA JSON records (`id`, `image` as one path or a list, `audio` likewise,
//!   `conversations` of `{from, value}` turns with one `<image>` or `<audio>` placeholder
//!   per item), read with errors that name the record, and checked so that placeholders
//!   and files agree (RELIABILITY.md row 9).
//! - [`chat`]: the tokenizer (`tokenizer.json`; a byte-level BPE trained for the
//!   synthetic set), the chat template, targets on assistant turns only, placeholders
//!   expanded to the encoders' rows, and truncation that never cuts an item's rows.
//! - [`files`]: reading the files a user or a run names: regular files only, or text
//!   capped at a size, so that a device or a FIFO in a file's place is refused, not read
//!   without end.
//! - [`dataset`]: a dataset opened for a model: records checked and encoded once, the
//!   order steps draw them in, a bad-data policy, payloads decoded on demand.
//! - [`manifest`]: a step's `BatchManifest` from the encoded records' metadata (each
//!   item's edge, position and rows), the same on every rank, no payload decoded.
//! - [`mel`]: the audio encoder's front end, Whisper's log-mel features of a 16 kHz WAV clip.
//! - [`pixels`]: the vision encoder's front end, an image file resized and normalized.
//! - [`synth`]: a deterministic synthetic dataset in that format: PNG images of coloured
//!   shapes and 16 kHz WAV clips of tones and chirps, with questions whose answers name
//!   what the image shows and what the clip sounds like, and a held-out split.

pub mod chat;
pub mod dataset;
pub mod error;
pub mod files;
pub mod llava;
pub mod manifest;
pub mod mel;
pub mod pixels;
pub mod synth;

pub use dataset::{BadData, Dataset, DatasetSpec};
pub use error::DataError;
pub use llava::{Record, Turn};
pub use synth::{SynthOptions, SynthSummary};
