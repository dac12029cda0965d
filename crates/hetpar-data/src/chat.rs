//! From a LLaVA record to the LLM's sequence: the tokenizer, the chat template, the
//! training targets and the encoder rows' positions.
//!
//! **Tokenizer**: a `tokenizer.json` read and written by the `tokenizers` crate; for the
//! synthetic set [`Vocab::train`] trains a byte-level BPE on its texts. Its special tokens
//! ([`SPECIAL`]) are the template's markers and the two placeholders.
//!
//! **Template**: each turn is its role marker (`<|user|>`, `<|assistant|>`, `<|system|>`),
//! its text and `<|end|>`; the text of each turn, and of each piece of a turn between
//! placeholders, is tokenized on its own, so no token spans a marker or a placeholder.
//!
//! **Targets**: only assistant turns are learned: their text and the `<|end|>` closing
//! them. `targets[i]` is what position `i` predicts, the token at `i + 1` where that token
//! is learned, and -1 elsewhere (the runtime's convention).
//!
//! **Placeholders**: each `<image>` becomes the image's encoder rows, each `<audio>` the
//! clip's, as that many copies of the placeholder's id; [`Item`] says where each starts.
//! The LLM's first stage replaces those positions with the rows the edge delivers.
//!
//! **Truncation** to `seq_len`: a sequence too long is cut at the end, but only where every
//! encoder row stays whole and at least one learned token remains; otherwise the record is
//! refused, naming why (RELIABILITY.md row 9: never a row of an item cut off from its
//! text). A shorter sequence is padded with `<|pad|>`, never learned.

use std::path::Path;

use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::error::{DataError, Result, io};
use crate::llava::{AUDIO, IMAGE, Record, Role};

/// Padding after the sequence's end.
pub const PAD: &str = "<|pad|>";
/// Opens a user turn.
pub const USER: &str = "<|user|>";
/// Opens an assistant turn.
pub const ASSISTANT: &str = "<|assistant|>";
/// Opens a system turn.
pub const SYSTEM: &str = "<|system|>";
/// Closes any turn.
pub const END: &str = "<|end|>";
/// The special tokens, in id order (0..7) in a trained vocabulary.
pub const SPECIAL: [&str; 7] = [PAD, USER, ASSISTANT, SYSTEM, END, IMAGE, AUDIO];

/// A tokenizer with the template's special tokens.
#[derive(Debug)]
pub struct Vocab {
    tokenizer: Tokenizer,
    special: [u32; 7],
}

impl Vocab {
    /// A byte-level BPE of at most `size` tokens trained on `texts`, the special tokens
    /// first.
    pub fn train(texts: &[String], size: usize) -> Result<Vocab> {
        let fail =
            |e: tokenizers::Error| DataError::Options(format!("training the tokenizer: {e}"));
        let special: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(size)
            .show_progress(false)
            .special_tokens(special)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        let mut tokenizer = Tokenizer::new(BPE::default());
        tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        tokenizer.train(&mut trainer, texts.iter()).map_err(fail)?;
        Vocab::of(tokenizer, "the trained tokenizer")
    }

    /// Reads a `tokenizer.json`; it must hold the special tokens.
    pub fn load(path: &Path) -> Result<Vocab> {
        let bytes = crate::files::read_regular(path).map_err(io(path))?;
        let tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| DataError::Format {
            path: path.to_path_buf(),
            message: format!("not a tokenizer.json: {e}"),
        })?;
        Vocab::of(tokenizer, &path.display().to_string())
    }

    fn of(mut tokenizer: Tokenizer, what: &str) -> Result<Vocab> {
        // A record's text is text: a `<|end|>` or `<|user|>` written in it is tokenized as
        // its characters, not as the template's marker (the template inserts its markers'
        // ids itself), so a record cannot forge a turn boundary or padding.
        tokenizer.set_encode_special_tokens(true);
        let mut special = [0; 7];
        for (id, s) in special.iter_mut().zip(SPECIAL) {
            *id = tokenizer.token_to_id(s).ok_or_else(|| {
                DataError::Options(format!(
                    "{what} has no {s} token (hetpar's template needs {})",
                    SPECIAL.join(" ")
                ))
            })?;
        }
        Ok(Vocab { tokenizer, special })
    }

    /// Writes `tokenizer.json`.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.tokenizer
            .save(path, true)
            .map_err(|e| DataError::Encode { path: path.to_path_buf(), message: e.to_string() })?;
        // The crate writes through its own error type; make sure the file is there.
        std::fs::metadata(path).map(|_| ()).map_err(io(path))
    }

    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Whether the vocabulary is empty (never, once built).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The id of special token `s` (one of [`SPECIAL`]).
    pub fn id(&self, s: &str) -> Option<u32> {
        SPECIAL.iter().position(|t| *t == s).map(|i| self.special[i])
    }

    /// The ids of `text`, no special tokens added, and none recognized in it: the markers'
    /// spellings in `text` are tokenized as text.
    pub fn ids(&self, text: &str) -> Result<Vec<u32>> {
        let e = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| DataError::Options(format!("tokenizing {text:?}: {e}")))?;
        Ok(e.get_ids().to_vec())
    }

    /// The text of `ids` (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, false)
            .map_err(|e| DataError::Options(format!("decoding {ids:?}: {e}")))
    }
}

/// Which encoder an item feeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An image: the vision encoder.
    Image,
    /// An audio clip: the audio encoder.
    Audio,
}

impl Kind {
    /// `image` or `audio`, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Image => "image",
            Kind::Audio => "audio",
        }
    }
}

/// Where one item's encoder rows sit in the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    /// The encoder.
    pub kind: Kind,
    /// Its index in the record's list of that kind.
    pub index: usize,
    /// The position of its first row.
    pub position: usize,
    /// How many rows.
    pub rows: usize,
}

/// A record as the LLM sees it. Held once per record for the whole run, so it keeps its
/// tokens unpadded and its learned tokens as runs of positions (4 bytes a token, where the
/// padded ids and targets took 12 bytes a position); [`Encoded::ids`] and
/// [`Encoded::targets`] give the padded sequences.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    /// The kept token ids (at most `seq_len`), not padded.
    tokens: Vec<u32>,
    /// Positions of learned tokens, in runs.
    spans: Vec<std::ops::Range<usize>>,
    /// Positions in all.
    seq_len: usize,
    /// The id padding fills with.
    pad: u32,
    /// Encoder rows' places, in sequence order.
    pub items: Vec<Item>,
    /// Tokens before padding or truncation.
    pub length: usize,
    /// Tokens cut off at the end.
    pub truncated: usize,
}

/// `record` through the template: `image_rows` rows per image, `audio_rows` per clip,
/// `seq_len` positions. The error says why the record cannot be used.
pub fn encode(
    vocab: &Vocab,
    record: &Record,
    image_rows: usize,
    audio_rows: usize,
    seq_len: usize,
) -> Result<Encoded, String> {
    let mut ids: Vec<u32> = Vec::new();
    let mut learned: Vec<bool> = Vec::new();
    let mut items = Vec::new();
    let (mut images, mut clips) = (0, 0);
    let sp = |s: &str| vocab.id(s).expect("a special token");
    let text = |t: &str| vocab.ids(t).map_err(|e| e.to_string());
    for turn in &record.conversations {
        let (open, learn) = match turn.from {
            Role::Human => (USER, false),
            Role::Gpt => (ASSISTANT, true),
            Role::System => (SYSTEM, false),
        };
        ids.push(sp(open));
        learned.push(false);
        let mut rest = turn.value.as_str();
        loop {
            let next = [IMAGE, AUDIO]
                .iter()
                .filter_map(|p| rest.find(p).map(|at| (at, *p)))
                .min_by_key(|(at, _)| *at);
            let piece = next.map_or(rest, |(at, _)| &rest[..at]);
            let piece_ids = text(piece)?;
            learned.extend(std::iter::repeat_n(learn, piece_ids.len()));
            ids.extend(piece_ids);
            let Some((at, p)) = next else { break };
            let (kind, index, rows) = if p == IMAGE {
                images += 1;
                (Kind::Image, images - 1, image_rows)
            } else {
                clips += 1;
                (Kind::Audio, clips - 1, audio_rows)
            };
            items.push(Item { kind, index, position: ids.len(), rows });
            ids.extend(std::iter::repeat_n(sp(p), rows));
            learned.extend(std::iter::repeat_n(false, rows));
            rest = &rest[at + p.len()..];
        }
        ids.push(sp(END));
        learned.push(learn);
    }
    let length = ids.len();
    let mut truncated = 0;
    if length > seq_len {
        if let Some(cut) = items.iter().find(|i| i.position + i.rows > seq_len) {
            return Err(format!(
                "{length} tokens do not fit seq_len {seq_len}: {} {} needs positions {}..{}",
                cut.kind.name(),
                cut.index,
                cut.position,
                cut.position + cut.rows
            ));
        }
        // Position i predicts token i + 1: a kept learned token needs 1 <= i + 1 < seq_len.
        if !learned[1..seq_len].iter().any(|&l| l) {
            return Err(format!(
                "{length} tokens do not fit seq_len {seq_len}, and cutting them leaves no assistant token to learn"
            ));
        }
        truncated = length - seq_len;
        ids.truncate(seq_len);
        learned.truncate(seq_len);
    }
    // The learned tokens as runs of positions (position 0 predicts nothing: no position
    // before it).
    let mut spans = Vec::new();
    let mut j = 1;
    while j < ids.len() {
        if learned[j] {
            let start = j;
            while j < ids.len() && learned[j] {
                j += 1;
            }
            spans.push(start..j);
        } else {
            j += 1;
        }
    }
    ids.shrink_to_fit();
    Ok(Encoded { tokens: ids, spans, seq_len, pad: sp(PAD), items, length, truncated })
}

impl Encoded {
    /// The token ids, padded to `seq_len`.
    pub fn ids(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.seq_len);
        self.extend_ids(&mut out, self.seq_len);
        out
    }

    /// What each of the `seq_len` positions predicts: the next token where that token is
    /// learned (an assistant's text or its closing marker), else -1.
    pub fn targets(&self) -> Vec<i64> {
        let mut out = Vec::with_capacity(self.seq_len);
        self.extend_targets(&mut out, self.seq_len);
        out
    }

    /// Appends the first `n` (at most `seq_len`) of [`Self::ids`] to `out`.
    pub fn extend_ids(&self, out: &mut Vec<u32>, n: usize) {
        let n = n.min(self.seq_len);
        let kept = self.tokens.len().min(n);
        out.extend_from_slice(&self.tokens[..kept]);
        out.extend(std::iter::repeat_n(self.pad, n - kept));
    }

    /// Appends the first `n` (at most `seq_len`) of [`Self::targets`] to `out`.
    pub fn extend_targets(&self, out: &mut Vec<i64>, n: usize) {
        let n = n.min(self.seq_len);
        let base = out.len();
        out.resize(base + n, -1);
        for span in &self.spans {
            // Token j is predicted at position j - 1.
            for j in span.start..span.end.min(n + 1) {
                out[base + j - 1] = i64::from(self.tokens[j]);
            }
        }
    }
}
