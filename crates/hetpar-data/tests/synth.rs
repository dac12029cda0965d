//! The synthetic dataset: deterministic bytes, sample i independent of the count, records
//! that load and check, media that decode to what the answers say.

#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use hetpar_data::chat::{Vocab, encode};
use hetpar_data::llava::{self, Role};
use hetpar_data::synth::{self, SAMPLE_RATE, SynthOptions};
use sha2::{Digest, Sha256};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hetpar-synth-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// SHA-256 of every file under `dir`, by relative path.
fn hashes(dir: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for sub in ["", "images", "audio"] {
        for e in std::fs::read_dir(dir.join(sub)).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                let digest = Sha256::digest(std::fs::read(&p).unwrap());
                out.insert(rel, format!("{digest:x}"));
            }
        }
    }
    out
}

#[test]
fn the_same_seed_writes_the_same_bytes_and_sample_i_ignores_the_count() {
    let (a, b, c) = (tmp("a"), tmp("b"), tmp("c"));
    let opts = SynthOptions::with_samples(40);
    synth::generate(&a, &opts, &mut |_| {}).unwrap();
    synth::generate(&b, &opts, &mut |_| {}).unwrap();
    assert_eq!(hashes(&a), hashes(&b));
    // Another seed changes the media.
    let other = SynthOptions { seed: 1, ..opts.clone() };
    synth::generate(&c, &other, &mut |_| {}).unwrap();
    assert_ne!(hashes(&a), hashes(&c));
    // Twenty samples: the same first twenty records and files.
    std::fs::remove_dir_all(&c).unwrap();
    synth::generate(&c, &SynthOptions::with_samples(20), &mut |_| {}).unwrap();
    let (ha, hc) = (hashes(&a), hashes(&c));
    for (path, h) in &hc {
        if path.starts_with("images/") || path.starts_with("audio/") {
            assert_eq!(ha.get(path), Some(h), "{path}");
        }
    }
    for d in [a, b, c] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn records_load_and_every_kind_of_sample_occurs() {
    let dir = tmp("load");
    let summary = synth::generate(&dir, &SynthOptions::with_samples(60), &mut |_| {}).unwrap();
    assert_eq!((summary.train, summary.heldout), (54, 6));
    let train = llava::load(&dir.join("train.json")).unwrap();
    let heldout = llava::load(&dir.join("heldout.json")).unwrap();
    llava::check_files(&dir.join("train.json"), &train, &dir, &dir).unwrap();
    llava::check_files(&dir.join("heldout.json"), &heldout, &dir, &dir).unwrap();
    let ids: BTreeSet<&str> = train.iter().chain(&heldout).map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), 60, "ids are unique and the splits disjoint");
    let all: Vec<_> = train.iter().chain(&heldout).collect();
    let images: usize = all.iter().map(|r| r.image.paths().len()).sum();
    let clips: usize = all.iter().map(|r| r.audio.paths().len()).sum();
    assert_eq!((images, clips), (summary.images, summary.clips));
    let text_only = all.iter().filter(|r| r.image.is_empty() && r.audio.is_empty()).count();
    assert_eq!(text_only, summary.text_only);
    assert!(summary.text_only > 0 && summary.multi_image > 0 && summary.clips > 0, "{summary:?}");
    for r in &all {
        assert_eq!(r.conversations.last().unwrap().from, Role::Gpt, "{}", r.id);
    }
    let vocab = Vocab::load(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(vocab.len(), summary.vocab);
    assert!(vocab.len() <= 512);
    // Every training record goes through the template at the demo's sizes.
    for r in &train {
        let e = encode(&vocab, r, 4, 3, 128).unwrap();
        assert!(e.targets().iter().any(|&t| t >= 0), "{}", r.id);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// The 4-connected regions of `img` painted `rgb`.
fn regions(img: &image::RgbImage, rgb: [u8; 3]) -> usize {
    let (w, h) = img.dimensions();
    let mut seen = vec![false; (w * h) as usize];
    let mut count = 0;
    for start in 0..w * h {
        if seen[start as usize] || img.get_pixel(start % w, start / w).0 != rgb {
            continue;
        }
        count += 1;
        let mut stack = vec![start];
        seen[start as usize] = true;
        while let Some(i) = stack.pop() {
            let (x, y) = (i % w, i / w);
            let next = [(x.wrapping_sub(1), y), (x + 1, y), (x, y.wrapping_sub(1)), (x, y + 1)];
            for (nx, ny) in next {
                let j = (ny * w + nx) as usize;
                if nx < w && ny < h && !seen[j] && img.get_pixel(nx, ny).0 == rgb {
                    seen[j] = true;
                    stack.push(ny * w + nx);
                }
            }
        }
    }
    count
}

#[test]
fn images_and_clips_show_what_the_answers_say() {
    let opts = SynthOptions::with_samples(30);
    let dir = tmp("media");
    synth::generate(&dir, &opts, &mut |_| {}).unwrap();
    let colours = [
        ("red", [220u8, 40, 40]),
        ("green", [40, 180, 60]),
        ("blue", [50, 90, 230]),
        ("yellow", [230, 210, 40]),
    ];
    let (mut seen_images, mut seen_clips) = (0, 0);
    for i in 0..opts.samples {
        let (record, pictures, sounds) = synth::sample(opts.seed, i, &opts);
        let answers: Vec<&str> = record
            .conversations
            .iter()
            .filter(|t| t.from == Role::Gpt)
            .map(|t| t.value.as_str())
            .collect();
        for (p, path) in pictures.iter().zip(record.image.paths()) {
            let img = image::open(dir.join(path)).unwrap().to_rgb8();
            assert_eq!(img.dimensions(), (64, 64));
            let said = p.describe();
            assert!(answers[0].contains(&said), "{}: {said} not in {:?}", record.id, answers);
            let (name, rgb) = colours.iter().find(|(n, _)| said.contains(n)).unwrap();
            let painted: BTreeSet<[u8; 3]> = img.pixels().map(|px| px.0).collect();
            assert_eq!(painted, BTreeSet::from([[24, 24, 28], *rgb]), "{}: {name}", record.id);
            // As many separate shapes as the answer counts: no two touch.
            assert_eq!(regions(&img, *rgb), p.count, "{}: {said}", record.id);
            seen_images += 1;
        }
        for (c, path) in sounds.iter().zip(record.audio.paths()) {
            let mut reader = hound::WavReader::open(dir.join(path)).unwrap();
            let spec = reader.spec();
            assert_eq!(
                (spec.channels, spec.sample_rate, spec.bits_per_sample),
                (1, SAMPLE_RATE, 16)
            );
            let samples: Vec<i16> = reader.samples::<i16>().map(Result::unwrap).collect();
            assert_eq!(samples, synth::synthesize(c));
            // 0.1 s of silence, then c.count beeps of 0.2 s with 0.1 s between.
            let secs = samples.len() as f64 / f64::from(SAMPLE_RATE);
            assert!((secs - (0.2 + 0.3 * c.count as f64 - 0.1)).abs() < 1e-3, "{secs}");
            // A steady tone crosses zero twice per period: its pitch, from the first beep.
            let first = &samples[1600..1600 + 3200];
            let crossings = first.windows(2).filter(|w| (w[0] < 0) != (w[1] < 0)).count();
            let hz = crossings as f64 / 2.0 / 0.2;
            let said = c.describe();
            let want = [("low", 220.0), ("middle", 440.0), ("high", 880.0)]
                .into_iter()
                .find(|(n, _)| said.contains(n))
                .unwrap()
                .1;
            if said.contains("tone") {
                assert!((hz - want).abs() / want < 0.03, "{said}: {hz} Hz");
            } else {
                // Rising an octave: the mean frequency is f0 / ln 2.
                assert!(
                    (hz - want / std::f64::consts::LN_2).abs() / want < 0.05,
                    "{said}: {hz} Hz"
                );
            }
            assert!(answers.last().unwrap().contains(&said));
            seen_clips += 1;
        }
    }
    assert!(seen_images > 10 && seen_clips > 5, "{seen_images} images, {seen_clips} clips");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_directory_with_other_files_is_refused() {
    let dir = tmp("foreign");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), "mine").unwrap();
    let e = synth::generate(&dir, &SynthOptions::with_samples(5), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("holds files that are not a synthetic dataset"), "{e}");
    // An earlier synthetic dataset is replaced.
    std::fs::remove_file(dir.join("notes.txt")).unwrap();
    synth::generate(&dir, &SynthOptions::with_samples(5), &mut |_| {}).unwrap();
    synth::generate(&dir, &SynthOptions::with_samples(5), &mut |_| {}).unwrap();
    let e = synth::generate(&dir, &SynthOptions::with_samples(0), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("--samples must be at least 1"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}
