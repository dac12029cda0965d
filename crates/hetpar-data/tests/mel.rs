//! The log-mel front end against values computed independently (numpy and librosa, by
//! `scripts/golden/logmel.py`), and WAV reading.

#![allow(clippy::unwrap_used)]

#[path = "golden/logmel.rs"]
#[allow(clippy::excessive_precision, clippy::unreadable_literal)]
mod golden;

use hetpar_data::mel::{LogMel, N_FFT, mel_filters, read_wav};

/// The script's test signal: two tones and a ramp of noise, 0.25 s at 16 kHz, in f32.
fn clip() -> Vec<f32> {
    (0..4000u64)
        .map(|t| {
            let tf = t as f64;
            let x = 0.5 * (2.0 * std::f64::consts::PI * 440.0 * tf / 16000.0).sin()
                + 0.25 * (2.0 * std::f64::consts::PI * 1234.5 * tf / 16000.0 + 0.3).sin()
                + 0.1 * (((t * 7919) % 1000) as f64 / 1000.0 - 0.5);
            x as f32
        })
        .collect()
}

fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn the_filterbank_is_librosas() {
    for (n, sums, peaks) in [
        (16, &golden::FILTER_SUMS_16[..], &golden::FILTER_PEAKS_16[..]),
        (80, &golden::FILTER_SUMS_80[..], &golden::FILTER_PEAKS_80[..]),
    ] {
        let f = mel_filters(n);
        assert_eq!((f.len(), f[0].len()), (n, N_FFT / 2 + 1));
        let got: Vec<f64> = f.iter().map(|r| r.iter().sum()).collect();
        close(&format!("row sums of {n}"), &got, sums, 1e-9);
        let got: Vec<f64> = f.iter().map(|r| r.iter().copied().fold(0.0, f64::max)).collect();
        close(&format!("peaks of {n}"), &got, peaks, 1e-9);
    }
    let f = mel_filters(16);
    let got: Vec<f64> = f.iter().flat_map(|r| r[..40].to_vec()).collect();
    close("16-band weights", &got, &golden::FILTERS_16_FIRST_40_BINS, 1e-9);
}

#[test]
fn features_match_whisper_computed_in_numpy() {
    let x = clip();
    let f16 = LogMel::new(16).compute(&x).unwrap();
    assert_eq!(LogMel::frames(x.len()), golden::FRAMES_16);
    let got: Vec<f64> = f16.iter().map(|&v| f64::from(v)).collect();
    close("16 mels", &got, &golden::LOG_MEL_16, 1e-5);
    let f80 = LogMel::new(80).compute(&x).unwrap();
    let frames = golden::FRAMES_80;
    let got: Vec<f64> =
        (0..80).flat_map(|m| [0, 12, 24].map(|t| f64::from(f80[m * frames + t]))).collect();
    close("80 mels at frames 0, 12, 24", &got, &golden::LOG_MEL_80_FRAMES_0_12_24, 1e-5);
}

#[test]
fn a_clip_too_short_to_pad_is_refused() {
    let e = LogMel::new(16).compute(&[0.0; 200]).unwrap_err().to_string();
    assert!(e.contains("a clip of 200 samples is too short"), "{e}");
    assert_eq!(LogMel::new(16).compute(&[0.1; 201]).unwrap().len(), 16);
}

#[test]
fn wav_files_read_as_16_khz_mono_and_others_are_refused() {
    let dir = std::env::temp_dir().join(format!("hetpar-wav-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, rate: u32, channels: u16, frames: &[[i16; 2]]| {
        let spec = hound::WavSpec {
            channels,
            sample_rate: rate,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let path = dir.join(name);
        let mut w = hound::WavWriter::create(&path, spec).unwrap();
        for f in frames {
            for &s in &f[..usize::from(channels)] {
                w.write_sample(s).unwrap();
            }
        }
        w.finalize().unwrap();
        path
    };
    let mono = write("mono.wav", 16_000, 1, &[[16384, 0], [-32768, 0]]);
    assert_eq!(read_wav(&mono).unwrap(), [0.5, -1.0]);
    let stereo = write("stereo.wav", 16_000, 2, &[[16384, 0], [-16384, -16384]]);
    assert_eq!(read_wav(&stereo).unwrap(), [0.25, -0.5]);
    let fast = write("fast.wav", 44_100, 1, &[[0, 0]]);
    let e = read_wav(&fast).unwrap_err().to_string();
    assert!(
        e.contains("fast.wav: sampled at 44100 Hz; the audio encoder's features need 16000 Hz"),
        "{e}"
    );
    // Other integer depths read at their full scale: half scale and the most negative
    // value give 0.5 and -1 at every depth.
    for bits in [8u16, 24, 32] {
        let spec = hound::WavSpec {
            channels: 1,
            sample_rate: 16_000,
            bits_per_sample: bits,
            sample_format: hound::SampleFormat::Int,
        };
        let path = dir.join(format!("int{bits}.wav"));
        let mut w = hound::WavWriter::create(&path, spec).unwrap();
        let full = 1i64 << (bits - 1);
        for v in [full / 2, -full] {
            w.write_sample(i32::try_from(v).unwrap()).unwrap();
        }
        w.finalize().unwrap();
        assert_eq!(read_wav(&path).unwrap(), [0.5, -1.0], "{bits}-bit");
    }
    // A chunk of odd size before the samples, with the pad byte RIFF puts after it (valid
    // WAV, which hound alone misreads): read past.
    let bytes = std::fs::read(&mono).unwrap();
    let mut padded = bytes[..12].to_vec();
    padded.extend_from_slice(b"junk\x03\0\0\0abc\0");
    padded.extend_from_slice(&bytes[12..]);
    let riff = u32::try_from(padded.len() - 8).unwrap();
    padded[4..8].copy_from_slice(&riff.to_le_bytes());
    let odd = dir.join("odd-chunk.wav");
    std::fs::write(&odd, padded).unwrap();
    assert_eq!(read_wav(&odd).unwrap(), [0.5, -1.0]);
    // Not a WAV at all: named, with what hetpar reads.
    let text = dir.join("text.wav");
    std::fs::write(&text, "not a wav").unwrap();
    let e = read_wav(&text).unwrap_err().to_string();
    assert!(e.contains("text.wav: ") && e.contains("hetpar reads RIFF WAVE files"), "{e}");
    // A clip with no samples would train as silence: refused.
    let empty = write("empty.wav", 16_000, 1, &[]);
    let e = read_wav(&empty).unwrap_err().to_string();
    assert!(e.contains("empty.wav: holds no samples"), "{e}");
    // A file cut short (a copy interrupted) says how far it read of what its header gives.
    let cut = write("cut.wav", 16_000, 1, &[[1, 0], [2, 0], [3, 0], [4, 0]]);
    let len = std::fs::metadata(&cut).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&cut).unwrap().set_len(len - 3).unwrap();
    let e = read_wav(&cut).unwrap_err().to_string();
    assert!(
        e.contains("cut.wav: truncated or unreadable: its header gives 4 samples and reading stopped after 2"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
