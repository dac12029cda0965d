//! The audio front end: WAV in, Whisper's log-mel features out.
//!
//! As OpenAI's Whisper computes them: a 400-sample (25 ms) periodic Hann window every 160
//! samples (10 ms) at 16 kHz over the clip reflect-padded by 200 samples at each end, the
//! squared magnitude of each frame's real FFT, the last frame dropped (so a clip of `n`
//! samples gives `n / 160` frames), a mel filterbank of `n_mels` triangles on the Slaney
//! mel scale with Slaney area normalization (librosa's `filters.mel`, which Whisper's
//! filters come from), `log10` of the energies clamped at 1e-10, every value raised to at
//! least the clip's maximum minus 8, and `(x + 4) / 4`. One difference: Whisper pads every
//! clip to 30 s first; here a clip keeps its own length, so the maximum is the clip's.
//! `scripts/golden/logmel.py` computes the same with numpy and librosa for the tests.

use std::path::Path;
use std::sync::Arc;

use realfft::{RealFftPlanner, RealToComplex};

use crate::error::{DataError, Result};

/// Sample rate the features assume.
pub const SAMPLE_RATE: u32 = 16_000;
/// Window and FFT length.
pub const N_FFT: usize = 400;
/// Samples between frames.
pub const HOP: usize = 160;

/// The samples of a clip an encoder over `frames` log-mel frames takes (a clip is padded
/// with silence or cut to them).
pub fn clip_samples(frames: usize) -> usize {
    frames * HOP
}

/// Hz to mel on the Slaney scale: linear below 1 kHz, logarithmic above.
fn hz_to_mel(f: f64) -> f64 {
    let (f_sp, min_log_hz, min_log_mel) = (200.0 / 3.0, 1000.0, 15.0);
    let logstep = 6.4f64.ln() / 27.0;
    if f >= min_log_hz { min_log_mel + (f / min_log_hz).ln() / logstep } else { f / f_sp }
}

/// The inverse of [`hz_to_mel`].
fn mel_to_hz(m: f64) -> f64 {
    let (f_sp, min_log_hz, min_log_mel) = (200.0 / 3.0, 1000.0, 15.0);
    let logstep = 6.4f64.ln() / 27.0;
    if m >= min_log_mel { min_log_hz * (logstep * (m - min_log_mel)).exp() } else { f_sp * m }
}

/// The filterbank: `n_mels` rows of `N_FFT / 2 + 1` weights, triangles between mel
/// frequencies equally spaced from 0 to 8 kHz, each scaled to unit area (Slaney).
pub fn mel_filters(n_mels: usize) -> Vec<Vec<f64>> {
    let bins = N_FFT / 2 + 1;
    let nyquist = f64::from(SAMPLE_RATE) / 2.0;
    let fft_freqs: Vec<f64> = (0..bins).map(|k| nyquist * k as f64 / (bins - 1) as f64).collect();
    let top = hz_to_mel(nyquist);
    let mel_f: Vec<f64> =
        (0..n_mels + 2).map(|i| mel_to_hz(top * i as f64 / (n_mels + 1) as f64)).collect();
    (0..n_mels)
        .map(|i| {
            let (lo, mid, hi) = (mel_f[i], mel_f[i + 1], mel_f[i + 2]);
            let norm = 2.0 / (hi - lo);
            fft_freqs
                .iter()
                .map(|&f| {
                    let rising = (f - lo) / (mid - lo);
                    let falling = (hi - f) / (hi - mid);
                    rising.min(falling).max(0.0) * norm
                })
                .collect()
        })
        .collect()
}

/// Log-mel features of `n_mels` bands.
pub struct LogMel {
    n_mels: usize,
    filters: Vec<Vec<f64>>,
    /// Each filter's bins from its first nonzero weight to its last (empty where it has
    /// none): a triangle spans a few bins of the 201, and the weights outside it are 0.
    spans: Vec<std::ops::Range<usize>>,
    window: Vec<f64>,
    fft: Arc<dyn RealToComplex<f64>>,
}

impl std::fmt::Debug for LogMel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LogMel({} mels)", self.n_mels)
    }
}

impl LogMel {
    /// The front end for `n_mels` bands.
    pub fn new(n_mels: usize) -> LogMel {
        let window = (0..N_FFT)
            .map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / N_FFT as f64).cos())
            .collect();
        let fft = RealFftPlanner::<f64>::new().plan_fft_forward(N_FFT);
        let filters = mel_filters(n_mels);
        let spans = filters.iter().map(|row| nonzero_span(row)).collect();
        LogMel { n_mels, filters, spans, window, fft }
    }

    /// Frames of a clip of `samples` samples.
    pub fn frames(samples: usize) -> usize {
        samples / HOP
    }

    /// The features of `clip` (16 kHz samples in [-1, 1]): `[n_mels, frames]`, row-major.
    /// A clip must be longer than half a window (200 samples) for the reflect padding.
    pub fn compute(&self, clip: &[f32]) -> Result<Vec<f32>> {
        let pad = N_FFT / 2;
        if clip.len() <= pad {
            return Err(DataError::Options(format!(
                "a clip of {} samples is too short for log-mel features (at least {} at 16 kHz)",
                clip.len(),
                pad + 1
            )));
        }
        let n = clip.len();
        // Reflect padding without repeating the edge sample, as numpy and torch do.
        let at = |i: isize| -> f64 {
            let j = if i < 0 {
                -i
            } else if i as usize >= n {
                2 * (n as isize - 1) - i
            } else {
                i
            };
            f64::from(clip[j as usize])
        };
        let frames = Self::frames(n);
        let bins = N_FFT / 2 + 1;
        let mut input = self.fft.make_input_vec();
        let mut spectrum = self.fft.make_output_vec();
        let mut power = vec![0.0f64; bins];
        let mut mel = vec![0.0f64; self.n_mels * frames];
        for t in 0..frames {
            let start = (t * HOP) as isize - pad as isize;
            for (k, x) in input.iter_mut().enumerate() {
                *x = at(start + k as isize) * self.window[k];
            }
            self.fft
                .process(&mut input, &mut spectrum)
                .map_err(|e| DataError::Options(format!("FFT: {e}")))?;
            for (p, c) in power.iter_mut().zip(&spectrum) {
                *p = c.norm_sqr();
            }
            for (m, (row, span)) in self.filters.iter().zip(&self.spans).enumerate() {
                // Over the filter's span only: the terms outside it are zeros (the powers
                // are finite), which leave the sum's bits as they are.
                let (w, p) = (&row[span.clone()], &power[span.clone()]);
                let e: f64 = w.iter().zip(p).map(|(w, p)| w * p).sum();
                mel[m * frames + t] = e.max(1e-10).log10();
            }
        }
        let floor = mel.iter().copied().fold(f64::NEG_INFINITY, f64::max) - 8.0;
        Ok(mel.iter().map(|&v| ((v.max(floor) + 4.0) / 4.0) as f32).collect())
    }
}

/// The bins from `row`'s first nonzero weight to its last (empty where all are zero).
fn nonzero_span(row: &[f64]) -> std::ops::Range<usize> {
    match row.iter().position(|&w| w != 0.0) {
        Some(first) => first..row.iter().rposition(|&w| w != 0.0).map_or(first, |l| l + 1),
        None => 0..0,
    }
}

/// The samples `it` reads, each converted by `to`; where reading stops short of the
/// `promised` samples of the file's header, says how far it got (hound's own words for it
/// are "Failed to read enough bytes").
fn samples<S>(
    it: impl Iterator<Item = hound::Result<S>>,
    promised: u32,
    to: impl Fn(S) -> f32,
) -> std::result::Result<Vec<f32>, String> {
    // The header's count is not trusted with memory before the samples are there.
    let mut out = Vec::with_capacity((promised as usize).min(1 << 22));
    for s in it {
        match s {
            Ok(v) => out.push(to(v)),
            Err(hound::Error::IoError(e)) => {
                return Err(format!(
                    "truncated or unreadable: its header gives {promised} samples and reading stopped after {} ({e})",
                    out.len()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(out)
}

/// `bytes`, a RIFF WAVE file, as one of its `fmt ` and `data` chunks alone (every chunk
/// walked with the pad byte after an odd size, as RIFF lays them out). `None` where it is
/// not such a file.
fn fmt_and_data(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.get(0..4)? != b"RIFF" || bytes.get(8..12)? != b"WAVE" {
        return None;
    }
    let (mut fmt, mut at) = (None, 12usize);
    let data = loop {
        let id = bytes.get(at..at + 4)?;
        let size = u32::from_le_bytes(bytes.get(at + 4..at + 8)?.try_into().ok()?) as usize;
        let body = bytes.get(at + 8..(at + 8).checked_add(size)?)?;
        match id {
            b"fmt " => fmt = Some(body),
            b"data" => break body,
            _ => {}
        }
        at = at + 8 + size + size % 2;
    };
    let fmt = fmt?;
    let mut out = Vec::with_capacity(28 + fmt.len() + data.len());
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&u32::try_from(20 + fmt.len() + data.len()).ok()?.to_le_bytes());
    out.extend_from_slice(b"WAVE");
    for (id, body) in [(b"fmt ", fmt), (b"data", data)] {
        out.extend_from_slice(id);
        out.extend_from_slice(&u32::try_from(body.len()).ok()?.to_le_bytes());
        out.extend_from_slice(body);
    }
    Some(out)
}

/// A WAV file's samples in [-1, 1], channels averaged. It must be 16 kHz (the features
/// assume it; resample elsewhere), 8-, 16-, 24- or 32-bit integer or 32-bit float, and hold
/// at least one sample (an empty clip would train as silence).
pub fn read_wav(path: &Path) -> Result<Vec<f32>> {
    let bad = |message: String| DataError::Encode { path: path.to_path_buf(), message };
    let bytes = crate::files::read_regular(path).map_err(|e| bad(e.to_string()))?;
    let plain: Vec<u8>;
    let mut reader = match hound::WavReader::new(std::io::Cursor::new(&bytes[..])) {
        Ok(r) => r,
        // hound reads past a chunk of odd size without the pad byte RIFF puts after it (a
        // `LIST` or `junk` chunk of odd length, valid WAV): the file's `fmt ` and `data`
        // chunks alone read.
        Err(first) => {
            let unread = || {
                bad(format!(
                    "{first} (hetpar reads RIFF WAVE files of PCM or float samples; re-encode it, e.g. ffmpeg -i IN -ar 16000 -c:a pcm_s16le OUT.wav)"
                ))
            };
            plain = fmt_and_data(&bytes).ok_or_else(unread)?;
            hound::WavReader::new(std::io::Cursor::new(&plain[..])).map_err(|_| unread())?
        }
    };
    let spec = reader.spec();
    if spec.sample_rate != SAMPLE_RATE {
        return Err(bad(format!(
            "sampled at {} Hz; the audio encoder's features need {SAMPLE_RATE} Hz (resample the file)",
            spec.sample_rate
        )));
    }
    let promised = reader.len();
    let interleaved: Vec<f32> = match (spec.sample_format, spec.bits_per_sample) {
        (hound::SampleFormat::Int, 16) => {
            samples(reader.samples::<i16>(), promised, |v| f32::from(v) / 32768.0)
        }
        (hound::SampleFormat::Int, bits @ (8 | 24 | 32)) => {
            // Full scale is 2^(bits - 1), as 32768 is for 16 bits.
            let scale = 1.0 / f64::from(1u32 << (bits - 1));
            samples(reader.samples::<i32>(), promised, |v| (f64::from(v) * scale) as f32)
        }
        (hound::SampleFormat::Float, 32) => samples(reader.samples::<f32>(), promised, |v| v),
        (format, bits) => {
            let kind = match format {
                hound::SampleFormat::Int => "integer",
                hound::SampleFormat::Float => "float",
            };
            return Err(bad(format!(
                "{bits}-bit {kind} samples; hetpar reads 8-, 16-, 24- or 32-bit integer or 32-bit float WAV"
            )));
        }
    }
    .map_err(bad)?;
    if interleaved.is_empty() {
        return Err(bad(
            "holds no samples (an empty data chunk, or a header that says so): it would train as silence"
                .into(),
        ));
    }
    let channels = usize::from(spec.channels.max(1));
    Ok(interleaved.chunks(channels).map(|c| c.iter().sum::<f32>() / channels as f32).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{LogMel, N_FFT, nonzero_span};

    /// The features with every filter applied over all its bins, as before the spans.
    fn dense(front: &LogMel, clip: &[f32]) -> Vec<f32> {
        let (n, pad, bins) = (clip.len() as isize, (N_FFT / 2) as isize, N_FFT / 2 + 1);
        let at = |i: isize| {
            let j = if i < 0 {
                -i
            } else if i >= n {
                2 * (n - 1) - i
            } else {
                i
            };
            f64::from(clip[j as usize])
        };
        let frames = LogMel::frames(clip.len());
        let (mut input, mut spectrum) = (front.fft.make_input_vec(), front.fft.make_output_vec());
        let mut mel = vec![0.0f64; front.n_mels * frames];
        for t in 0..frames {
            for (k, x) in input.iter_mut().enumerate() {
                *x = at((t * super::HOP) as isize - pad + k as isize) * front.window[k];
            }
            front.fft.process(&mut input, &mut spectrum).unwrap();
            let power: Vec<f64> = spectrum[..bins].iter().map(|c| c.norm_sqr()).collect();
            for (m, row) in front.filters.iter().enumerate() {
                let e: f64 = row.iter().zip(&power).map(|(w, p)| w * p).sum();
                mel[m * frames + t] = e.max(1e-10).log10();
            }
        }
        let floor = mel.iter().copied().fold(f64::NEG_INFINITY, f64::max) - 8.0;
        mel.iter().map(|&v| ((v.max(floor) + 4.0) / 4.0) as f32).collect()
    }

    #[test]
    fn filters_over_their_spans_give_the_dense_sums_bits() {
        let clip: Vec<f32> = (0..7000u32)
            .map(|t| (t.wrapping_mul(2_654_435_761) % 65_536) as f32 / 32_768.0 - 1.0)
            .collect();
        for n_mels in [16, 80, 128] {
            let front = LogMel::new(n_mels);
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(bits(front.compute(&clip).unwrap()), bits(dense(&front, &clip)), "{n_mels}");
            // A bin lies under at most two triangles (their edges meeting at most once
            // more), so the spans' work is about two passes over the bins, not `n_mels`.
            let work: usize = front.spans.iter().map(|s| s.len()).sum();
            assert!(work <= 2 * (N_FFT / 2 + 1) + n_mels, "{n_mels} mels: {work} bins in all");
        }
        assert_eq!(nonzero_span(&[0.0, 0.0, 1.0, 0.0, 2.0, 0.0]), 2..5);
        assert_eq!(nonzero_span(&[0.0, 0.0]), 0..0);
    }
}
