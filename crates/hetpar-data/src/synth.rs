//! The synthetic dataset: deterministic, multimodal, in LLaVA format, with something to
//! learn that only the media carry.
//!
//! Each sample draws 0..=`max_images` images and 0..=`max_clips` clips (so some samples
//! have several images, some none, some are text only). An image shows one to three shapes
//! of one kind (circle, square, triangle) and one colour (red, green, blue, yellow) at
//! random places on a dark background; a clip (16 kHz, mono, 16-bit) holds one to three
//! beeps of one pitch (low 220 Hz, middle 440 Hz, high 880 Hz), each a steady tone or a
//! chirp rising an octave. The first human turn carries the image placeholders and asks
//! what the images show (or for a caption), the next one the audio placeholders and asks
//! what the clip sounds like; the answers name count, colour and shape, or count, pitch
//! and kind ("two red circles; one blue square", "three high chirps"). Text-only samples
//! ask to count on from a number. Answers are exact strings, so accuracy is exact match.
//!
//! Sample `i` depends only on the seed and `i` (not on how many are written); the last
//! `heldout` samples form the held-out split. The directory holds `train.json`,
//! `heldout.json`, `images/`, `audio/`, `tokenizer.json` (a byte-level BPE trained on the
//! training split's turns, with the template's special tokens) and `synth.json` (what made
//! it).

use std::f64::consts::PI;
use std::path::{Path, PathBuf};

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::chat::Vocab;
use crate::error::{DataError, Result, io};
use crate::llava::{self, AUDIO, IMAGE, Media, Record, Role, Turn};

/// Sample rate of the clips, Whisper's.
pub const SAMPLE_RATE: u32 = 16_000;
/// The format tag in `synth.json`.
pub const FORMAT: &str = "hetpar-synth/2";

const SHAPES: [&str; 3] = ["circle", "square", "triangle"];
const COLOURS: [(&str, [u8; 3]); 4] = [
    ("red", [220, 40, 40]),
    ("green", [40, 180, 60]),
    ("blue", [50, 90, 230]),
    ("yellow", [230, 210, 40]),
];
const PITCHES: [(&str, f64); 3] = [("low", 220.0), ("middle", 440.0), ("high", 880.0)];
const KINDS: [&str; 2] = ["tone", "chirp"];
const NUMBERS: [&str; 13] = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
];
const BACKGROUND: [u8; 3] = [24, 24, 28];

/// What to generate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthOptions {
    /// Samples in all.
    pub samples: usize,
    /// Of them, held out (the last ones).
    pub heldout: usize,
    /// Seed of every draw.
    pub seed: u64,
    /// Most images per sample.
    pub max_images: usize,
    /// Most clips per sample.
    pub max_clips: usize,
    /// Image side in pixels.
    pub image_size: u32,
    /// Most tokens of the BPE trained on the training split (`tokenizer.json`).
    pub vocab_size: usize,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            samples: 1000,
            heldout: 100,
            seed: 0,
            max_images: 2,
            max_clips: 1,
            image_size: 64,
            vocab_size: 512,
        }
    }
}

impl SynthOptions {
    /// `samples` with a tenth of them held out (at least one where there are two or more).
    pub fn with_samples(samples: usize) -> SynthOptions {
        let heldout = if samples >= 2 { (samples / 10).max(1) } else { 0 };
        SynthOptions { samples, heldout, ..SynthOptions::default() }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DataError::Options(m));
        if self.samples == 0 {
            return bad("--samples must be at least 1".into());
        }
        if self.heldout >= self.samples && self.samples > 1 {
            return bad(format!(
                "{} held-out samples leave none of {} to train on",
                self.heldout, self.samples
            ));
        }
        if self.vocab_size < 300 {
            return bad(format!(
                "a vocabulary of {} tokens cannot hold the 256 bytes, the template's markers and any merge",
                self.vocab_size
            ));
        }
        if !(16..=1024).contains(&self.image_size) {
            return bad(format!("image size {} is outside 16..=1024 pixels", self.image_size));
        }
        Ok(())
    }
}

/// What [`generate`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SynthSummary {
    /// Samples in `train.json`.
    pub train: usize,
    /// Samples in `heldout.json`.
    pub heldout: usize,
    /// PNG files.
    pub images: usize,
    /// WAV files.
    pub clips: usize,
    /// Samples with neither.
    pub text_only: usize,
    /// Samples with more than one image.
    pub multi_image: usize,
    /// Tokens in `tokenizer.json`.
    pub vocab: usize,
    /// Bytes of every file written.
    pub bytes: u64,
}

/// The entries of a synthetic dataset's directory.
pub const SET_ENTRIES: [&str; 6] =
    ["synth.json", "train.json", "heldout.json", "tokenizer.json", "images", "audio"];

/// How the name of a new set being written inside an earlier set's directory begins (to
/// replace it there).
pub const TMP_PREFIX: &str = ".synth-tmp-";

/// Refuses `dir` as a place to write a synthetic dataset into unless it is absent, an empty
/// directory, or a directory holding a synthetic dataset (its `synth.json`) and nothing
/// else, which is replaced: other files there would be lost with it, and a directory of
/// another dataset's files (train.json, images/) is not ours to replace.
pub fn check_target(dir: &Path) -> Result<()> {
    if std::fs::symlink_metadata(dir).is_err() {
        return Ok(());
    }
    if !dir.is_dir() {
        let what = match std::fs::metadata(dir) {
            Ok(m) => crate::files::describe(m.file_type()),
            Err(_) => "a link to nothing",
        };
        return Err(DataError::Options(format!(
            "{} is {what}, not a directory; give a directory to write the dataset into",
            dir.display()
        )));
    }
    let mut others: Vec<String> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !SET_ENTRIES.contains(&n.as_str()) && !n.starts_with(TMP_PREFIX))
        .collect();
    let marked = dir.join("synth.json").is_file();
    let empty = || std::fs::read_dir(dir).is_ok_and(|mut e| e.next().is_none());
    if (marked && others.is_empty()) || empty() {
        return Ok(());
    }
    if !marked {
        return Err(DataError::Options(format!(
            "{} exists and holds files that are not a synthetic dataset; give an empty or new directory",
            dir.display()
        )));
    }
    others.sort();
    let more = match others.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    Err(DataError::Options(format!(
        "{} holds a synthetic dataset and other files ({}{more}), which replacing the set would lose; move them out first, or give another directory",
        dir.display(),
        others[..others.len().min(3)].join(", ")
    )))
}

/// Samples [`footprint`] makes in memory to estimate a whole set's.
const PROBE: usize = 64;

/// What [`generate`] would need for a set, estimated from its first samples (at most 64)
/// made in memory and scaled to all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Bytes of the files it writes (the media and the records).
    pub disk: u64,
    /// Bytes it holds at once: every record is kept until the JSON files and the tokenizer
    /// are written, which took 3.5 to 3.9 times the records' JSON in resident memory
    /// (measured at 20,000 samples with media and 400,000 text-only); four times here.
    pub memory: u64,
}

/// Estimates what [`generate`] needs for `opts` (validated first), so that a set too large
/// for the disk or the memory is refused before anything is written.
pub fn footprint(opts: &SynthOptions) -> Result<Footprint> {
    opts.validate()?;
    let probe = opts.samples.min(PROBE);
    let (mut media, mut json) = (0u64, 0u64);
    let encode = |e: String| DataError::Encode { path: PathBuf::from("(in memory)"), message: e };
    for index in 0..probe {
        let (record, pictures, sounds) = sample(opts.seed, index, opts);
        // The draws of generate's pictures, in its order.
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed ^ !(index as u64));
        for p in &pictures {
            let mut png = std::io::Cursor::new(Vec::new());
            render(p, opts.image_size, &mut rng)
                .write_to(&mut png, image::ImageFormat::Png)
                .map_err(|e| encode(e.to_string()))?;
            media += png.get_ref().len() as u64;
        }
        // A 16-bit mono WAV: its 44-byte header and two bytes a sample.
        media += sounds.iter().map(|c| 44 + 2 * synthesize(c).len() as u64).sum::<u64>();
        json += serde_json::to_vec_pretty(&record).map_err(|e| encode(e.to_string()))?.len() as u64;
    }
    let scale = |b: u64| (b as f64 * opts.samples as f64 / probe as f64).ceil() as u64;
    Ok(Footprint { disk: scale(media + json), memory: scale(json).saturating_mul(4) })
}

/// `synth.json`: the options and what came out.
#[derive(Debug, Serialize, Deserialize)]
struct Made {
    format: String,
    options: SynthOptions,
    summary: SynthSummary,
}

/// One image's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Picture {
    /// Index into the shapes.
    pub shape: usize,
    /// Index into the colours.
    pub colour: usize,
    /// How many (1..=3).
    pub count: usize,
}

impl Picture {
    /// "two red circles".
    pub fn describe(&self) -> String {
        counted(self.count, COLOURS[self.colour].0, SHAPES[self.shape])
    }
}

/// One clip's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sound {
    /// Index into the pitches.
    pub pitch: usize,
    /// Index into tone / chirp.
    pub kind: usize,
    /// Beeps (1..=3).
    pub count: usize,
}

impl Sound {
    /// "three high chirps".
    pub fn describe(&self) -> String {
        counted(self.count, PITCHES[self.pitch].0, KINDS[self.kind])
    }
}

/// "two red circles": the count in words, the adjective, the noun in the plural past one.
fn counted(count: usize, adjective: &str, noun: &str) -> String {
    let s = if count == 1 { "" } else { "s" };
    format!("{} {adjective} {noun}{s}", NUMBERS[count])
}

/// Sample `index` of the dataset `seed`: its record and the media to write.
pub fn sample(seed: u64, index: usize, opts: &SynthOptions) -> (Record, Vec<Picture>, Vec<Sound>) {
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let id = format!("s{index:06}");
    let n_images = below(&mut rng, opts.max_images + 1);
    let n_clips = below(&mut rng, opts.max_clips + 1);
    let pictures: Vec<Picture> = (0..n_images)
        .map(|_| Picture {
            shape: below(&mut rng, SHAPES.len()),
            colour: below(&mut rng, COLOURS.len()),
            count: 1 + below(&mut rng, 3),
        })
        .collect();
    let sounds: Vec<Sound> = (0..n_clips)
        .map(|_| Sound {
            pitch: below(&mut rng, PITCHES.len()),
            kind: below(&mut rng, KINDS.len()),
            count: 1 + below(&mut rng, 3),
        })
        .collect();
    let mut turns = Vec::new();
    let human = |v: String| Turn { from: Role::Human, value: v };
    let gpt = |v: String| Turn { from: Role::Gpt, value: v };
    if !pictures.is_empty() {
        let marks = format!("{IMAGE}\n").repeat(pictures.len());
        let caption = below(&mut rng, 2) == 0;
        let answer: Vec<String> = pictures.iter().map(Picture::describe).collect();
        let (q, a) = match (pictures.len(), caption) {
            (1, false) => ("What is in the image?".to_string(), answer.join("; ")),
            (_, false) => ("What is in each image?".to_string(), answer.join("; ")),
            (1, true) => ("Describe the image.".to_string(), format!("a picture of {}", answer[0])),
            (_, true) => {
                ("Describe the images.".to_string(), format!("pictures of {}", answer.join("; ")))
            }
        };
        turns.push(human(format!("{marks}{q}")));
        turns.push(gpt(a));
    }
    if !sounds.is_empty() {
        let marks = format!("{AUDIO}\n").repeat(sounds.len());
        let answer: Vec<String> = sounds.iter().map(Sound::describe).collect();
        turns.push(human(format!("{marks}What do you hear?")));
        turns.push(gpt(answer.join("; ")));
    }
    if turns.is_empty() {
        let from = below(&mut rng, 10);
        turns.push(human(format!("Count on from {}.", NUMBERS[from])));
        turns.push(gpt(NUMBERS[from + 1..from + 4].join(" ")));
    }
    let record = Record {
        image: Media::of((0..n_images).map(|k| format!("images/{id}-{k}.png")).collect()),
        audio: Media::of((0..n_clips).map(|k| format!("audio/{id}-{k}.wav")).collect()),
        id,
        conversations: turns,
    };
    (record, pictures, sounds)
}

/// A uniform draw from `0..n` (n >= 1).
fn below(rng: &mut ChaCha8Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

/// Draws `p` on a `size`-pixel square: `p.count` shapes of radius a sixth of the side (a
/// shape spans more than one patch of the ViT's usual grid), none touching another. A
/// placement that leaves no room for the next shape starts over, so the picture always
/// shows the count its caption says (three shapes fit with room to spare).
pub fn render(p: &Picture, size: u32, rng: &mut ChaCha8Rng) -> image::RgbImage {
    let s = f64::from(size);
    let r = s / 6.0;
    let apart = 2.0 * r + 2.0;
    let mut centres: Vec<(f64, f64)> = Vec::new();
    while centres.len() < p.count {
        let placed = (0..100).find_map(|_| {
            let x = r + 1.0 + unit(rng) * (s - 2.0 * r - 2.0);
            let y = r + 1.0 + unit(rng) * (s - 2.0 * r - 2.0);
            centres.iter().all(|&(cx, cy)| (cx - x).hypot(cy - y) > apart).then_some((x, y))
        });
        match placed {
            Some(at) => centres.push(at),
            None => centres.clear(),
        }
    }
    let colour = image::Rgb(COLOURS[p.colour].1);
    image::RgbImage::from_fn(size, size, |x, y| {
        let (px, py) = (f64::from(x) + 0.5, f64::from(y) + 0.5);
        let inside = centres.iter().any(|&(cx, cy)| {
            let (dx, dy) = (px - cx, py - cy);
            match p.shape {
                0 => dx.hypot(dy) <= r,
                1 => dx.abs() <= r * 0.85 && dy.abs() <= r * 0.85,
                _ => dy.abs() <= r && dx.abs() <= (dy + r) / 2.0,
            }
        });
        if inside { colour } else { image::Rgb(BACKGROUND) }
    })
}

/// A uniform draw from [0, 1).
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// The samples of `c`: `c.count` beeps of 0.2 s, 0.1 s apart, with 0.1 s of silence at
/// each end; each fades in and out over 5 ms.
pub fn synthesize(c: &Sound) -> Vec<i16> {
    let rate = f64::from(SAMPLE_RATE);
    let (beep, gap, edge, fade) = (0.2, 0.1, 0.1, 0.005);
    let total = edge * 2.0 + c.count as f64 * beep + (c.count - 1) as f64 * gap;
    let n = (total * rate).round() as usize;
    let f0 = PITCHES[c.pitch].1;
    (0..n)
        .map(|i| {
            let t = i as f64 / rate;
            let k = ((t - edge) / (beep + gap)).floor();
            let local = t - edge - k * (beep + gap);
            if k < 0.0 || k >= c.count as f64 || local >= beep {
                return 0;
            }
            let phase = if c.kind == 0 {
                2.0 * PI * f0 * local
            } else {
                // Frequency f0 * 2^(t / beep): one octave over the beep.
                2.0 * PI * f0 * beep / std::f64::consts::LN_2 * ((local / beep).exp2() - 1.0)
            };
            let envelope = (local / fade).min((beep - local) / fade).min(1.0);
            (0.5 * envelope * phase.sin() * f64::from(i16::MAX)).round() as i16
        })
        .collect()
}

/// Writes the dataset into `dir` (created if absent; refused if it holds files other than
/// an earlier synthetic dataset's). `progress` is called with the samples done so far.
pub fn generate(
    dir: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(usize),
) -> Result<SynthSummary> {
    opts.validate()?;
    check_target(dir)?;
    for sub in ["images", "audio"] {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).map_err(io(&d))?;
    }
    let mut summary = SynthSummary::default();
    let (mut train, mut heldout) = (Vec::new(), Vec::new());
    for index in 0..opts.samples {
        let (record, pictures, sounds) = sample(opts.seed, index, opts);
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed ^ !(index as u64));
        for (p, path) in pictures.iter().zip(record.image.paths()) {
            let file = dir.join(path);
            render(p, opts.image_size, &mut rng)
                .save(&file)
                .map_err(|e| DataError::Encode { path: file.clone(), message: e.to_string() })?;
            summary.bytes += size(&file)?;
        }
        for (c, path) in sounds.iter().zip(record.audio.paths()) {
            let file = dir.join(path);
            write_wav(&file, &synthesize(c))?;
            summary.bytes += size(&file)?;
        }
        summary.images += pictures.len();
        summary.clips += sounds.len();
        summary.text_only += usize::from(pictures.is_empty() && sounds.is_empty());
        summary.multi_image += usize::from(pictures.len() > 1);
        if index >= opts.samples - opts.heldout {
            heldout.push(record);
        } else {
            train.push(record);
        }
        progress(index + 1);
    }
    (summary.train, summary.heldout) = (train.len(), heldout.len());
    for (name, records) in [("train.json", &train), ("heldout.json", &heldout)] {
        let file = dir.join(name);
        llava::save(&file, records)?;
        summary.bytes += size(&file)?;
    }
    let texts: Vec<String> =
        train.iter().flat_map(|r| r.conversations.iter().map(|t| t.value.clone())).collect();
    let vocab = Vocab::train(&texts, opts.vocab_size)?;
    let file = dir.join("tokenizer.json");
    vocab.save(&file)?;
    summary.vocab = vocab.len();
    summary.bytes += size(&file)?;
    let made = Made { format: FORMAT.into(), options: opts.clone(), summary: summary.clone() };
    let file = dir.join("synth.json");
    let text = serde_json::to_string_pretty(&made)
        .map_err(|e| DataError::Encode { path: file.clone(), message: e.to_string() })?;
    std::fs::write(&file, text + "\n").map_err(io(&file))?;
    Ok(summary)
}

fn write_wav(file: &PathBuf, samples: &[i16]) -> Result<()> {
    let spec = hound::WavSpec {
        channels: 1,
        sample_rate: SAMPLE_RATE,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    };
    let encode = |e: hound::Error| DataError::Encode { path: file.clone(), message: e.to_string() };
    let mut w = hound::WavWriter::create(file, spec).map_err(encode)?;
    for &s in samples {
        w.write_sample(s).map_err(encode)?;
    }
    w.finalize().map_err(encode)
}

fn size(file: &Path) -> Result<u64> {
    Ok(std::fs::metadata(file).map_err(io(file))?.len())
}
