//! A dataset opened for a model: every record encoded once, epochs that draw each record
//! once, held-out batches that cover each record once, payloads of the encoders' shapes,
//! answers labelled by their question, and each bad-data class of RELIABILITY.md row 9
//! refused naming the record (or, under the skip policy, left out and counted).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use hetpar_data::dataset::{BadData, Fronts};
use hetpar_data::llava::{self, Media};
use hetpar_data::synth::{self, SynthOptions};
use hetpar_data::{Dataset, DatasetSpec};

/// A synthetic set of 40 samples (4 held out) under a fresh directory, which goes with its
/// files when the value drops.
fn synth_dir(name: &str) -> tempfile::TempDir {
    let d = tempfile::Builder::new().prefix(&format!("hetpar-dataset-{name}-")).tempdir().unwrap();
    synth::generate(d.path(), &SynthOptions::with_samples(40), &mut |_| {}).unwrap();
    d
}

/// The demo-like front ends: 32 px images of 16 rows, 16-band clips of 64 frames, 32 rows.
fn spec(dir: &std::path::Path, json: &str, on_bad: BadData) -> DatasetSpec {
    DatasetSpec {
        path: dir.join(json),
        media_root: dir.to_path_buf(),
        tokenizer: dir.join("tokenizer.json"),
        seq_len: 160,
        vocab: 512,
        fronts: Fronts { image: Some((32, 16)), audio: Some((16, 64, 32)) },
        on_bad,
    }
}

#[test]
fn epochs_draw_every_record_once_and_heldout_batches_cover_each_once() {
    let dir = synth_dir("epochs");
    let ds = Dataset::open(spec(dir.path(), "train.json", BadData::Error)).unwrap();
    let n = ds.entries().len();
    assert_eq!(n, 36);
    // 9 steps of 8 draws: two whole epochs, each a permutation of the records.
    let draws: Vec<usize> = (0..9).flat_map(|s| ds.step_entries(7, s, 8)).collect();
    for epoch in draws.chunks(n) {
        assert_eq!(epoch.iter().copied().collect::<BTreeSet<_>>().len(), n);
    }
    assert_ne!(&draws[..n], &draws[n..2 * n], "each epoch has its own order");
    // The same seed and step draw the same records; another seed others.
    assert_eq!(ds.step_entries(7, 3, 8), draws[24..32]);
    assert_ne!(ds.step_entries(8, 3, 8), draws[24..32]);
    let held = Dataset::open(spec(dir.path(), "heldout.json", BadData::Error)).unwrap();
    assert_eq!(held.entries().len(), 4);
    assert_eq!(held.eval_batches(3), 2);
    let (a, sa) = held.eval_entries(0, 3);
    let (b, sb) = held.eval_entries(1, 3);
    assert_eq!((a, sa), (vec![0, 1, 2], vec![true; 3]));
    assert_eq!((b, sb), (vec![3, 0, 1], vec![true, false, false]));
}

#[test]
fn payloads_have_the_encoders_shapes_and_answers_their_questions_kind() {
    let dir = synth_dir("payloads");
    let ds = Dataset::open(spec(dir.path(), "train.json", BadData::Error)).unwrap();
    let mut kinds = BTreeSet::new();
    for (e, entry) in ds.entries().iter().enumerate() {
        for (k, item) in entry.encoded.items.iter().enumerate() {
            let p = ds.payload(e, k).unwrap();
            let want = match item.kind {
                hetpar_data::chat::Kind::Image => vec![3, 32, 32],
                hetpar_data::chat::Kind::Audio => vec![16, 64],
            };
            assert_eq!(p.shape, want);
            assert_eq!(p.values.len(), want.iter().product::<usize>());
            assert!(p.values.iter().all(|v| v.is_finite()));
        }
        // One answer per assistant turn, each about what its question carried.
        let answers = ds.answers(e);
        let turns = entry.record.conversations.iter().filter(|t| t.from == llava::Role::Gpt);
        assert_eq!(answers.len(), turns.count(), "record {}", entry.record.id);
        let expect: Vec<&str> = match (entry.record.image.is_empty(), entry.record.audio.is_empty())
        {
            (true, true) => vec!["text"],
            (false, true) => vec!["image"],
            (true, false) => vec!["audio"],
            (false, false) => vec!["image", "audio"],
        };
        let got: Vec<&str> = answers.iter().map(|a| a.kind).collect();
        assert_eq!(got, expect, "record {}", entry.record.id);
        for a in &answers {
            let targets = entry.encoded.targets();
            assert!(a.positions.clone().all(|p| targets[p] >= 0));
            kinds.insert(a.kind);
        }
    }
    assert_eq!(kinds.len(), 3, "the set has image, audio and text questions");
}

/// Writes `train.json` with record 0 broken by `f` and returns the directory.
fn broken(name: &str, f: impl FnOnce(&mut llava::Record, &std::path::Path)) -> tempfile::TempDir {
    let dir = synth_dir(name);
    let mut records = llava::load(&dir.path().join("train.json")).unwrap();
    let i = records.iter().position(|r| !r.image.is_empty()).unwrap();
    records.swap(0, i);
    f(&mut records[0], dir.path());
    llava::save(&dir.path().join("train.json"), &records).unwrap();
    dir
}

#[test]
fn each_bad_data_class_names_the_record_or_is_skipped_and_counted() {
    let cases: Vec<(&str, tempfile::TempDir, &str)> = vec![
        (
            "missing image file",
            broken("missing", |r, _| {
                let mut paths: Vec<String> =
                    r.image.paths().iter().map(|p| p.to_string()).collect();
                paths[0] = "images/nowhere.png".into();
                r.image = Media::of(paths);
            }),
            "missing file",
        ),
        (
            "an image path that is a directory",
            broken("a-directory", |r, dir| {
                std::fs::create_dir_all(dir.join("images/a-directory.png")).unwrap();
                let mut paths: Vec<String> =
                    r.image.paths().iter().map(|p| p.to_string()).collect();
                paths[0] = "images/a-directory.png".into();
                r.image = Media::of(paths);
            }),
            "a-directory.png: a directory is there, not a file",
        ),
        (
            "unknown placeholder",
            broken("placeholder", |r, _| r.conversations[0].value.push_str(" <video>")),
            "<video>",
        ),
        (
            "longer than seq_len",
            broken("long", |r, _| {
                let v = &mut r.conversations[0].value;
                *v = format!("{}{}", "<image>\n".repeat(9), v.replace("<image>\n", ""));
                r.image = Media::of(vec![r.image.paths()[0].to_string(); 9]);
            }),
            "do not fit seq_len 160",
        ),
    ];
    for (what, dir, says) in cases {
        let err =
            Dataset::open(spec(dir.path(), "train.json", BadData::Error)).unwrap_err().to_string();
        assert!(err.contains("record 0") && err.contains(says), "{what}: {err}");
        let ds = Dataset::open(spec(dir.path(), "train.json", BadData::Skip)).unwrap();
        assert_eq!(ds.entries().len(), 35, "{what}");
        assert_eq!(ds.skipped().len(), 1, "{what}");
        assert_eq!(ds.skipped()[0].index, 0);
        assert!(ds.skipped()[0].reason.contains(says), "{what}: {:?}", ds.skipped());
    }
    // A file that exists but does not decode is found by the rank that decodes it, which
    // names the record and the file under either policy.
    let dir = broken("unreadable", |r, dir| {
        std::fs::write(dir.join(r.image.paths()[0]), b"not a png").unwrap();
    });
    for policy in [BadData::Error, BadData::Skip] {
        let ds = Dataset::open(spec(dir.path(), "train.json", policy)).unwrap();
        let e = ds.entries().iter().position(|e| e.index == 0).unwrap();
        let err = ds.payload(e, 0).unwrap_err().to_string();
        assert!(err.contains("record 0") && err.contains("unreadable image"), "{err}");
    }
    // A tokenizer larger than the LLM's vocabulary is refused before anything trains.
    let dir = synth_dir("vocab");
    let err =
        Dataset::open(DatasetSpec { vocab: 100, ..spec(dir.path(), "train.json", BadData::Error) })
            .unwrap_err()
            .to_string();
    assert!(err.contains("modules.llm.vocab = 100"), "{err}");
}

/// An element of the file that is not a record (a speaker the format has no name for, a
/// field missing or of the wrong type) is named by its index, id and field, and under the
/// skip policy left out like any unusable record: one bad record does not fail the file.
#[test]
fn elements_that_are_not_records_are_named_or_skipped() {
    let dir = synth_dir("malformed");
    let path = dir.path().join("train.json");
    let mut records: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let list = records.as_array_mut().unwrap();
    list[0]["conversations"][1]["from"] = "assistant".into();
    list[3].as_object_mut().unwrap().remove("conversations");
    // (`null` reads as no image, as exported sets write it for a text-only record.)
    list[5]["image"] = 5.into();
    let ids: Vec<String> =
        [0, 3, 5].iter().map(|&i| list[i]["id"].as_str().unwrap().to_string()).collect();
    // Behind a byte order mark, which some editors write.
    std::fs::write(&path, format!("\u{feff}{records}")).unwrap();
    let err =
        Dataset::open(spec(dir.path(), "train.json", BadData::Error)).unwrap_err().to_string();
    assert!(
        err.contains(&format!("record 0 (id {:?})", ids[0]))
            && err.contains("conversations[1].from: unknown variant `assistant`"),
        "{err}"
    );
    let ds = Dataset::open(spec(dir.path(), "train.json", BadData::Skip)).unwrap();
    assert_eq!(ds.entries().len(), 33);
    let skipped: Vec<(usize, &str)> =
        ds.skipped().iter().map(|s| (s.index, s.id.as_str())).collect();
    assert_eq!(skipped, [(0, ids[0].as_str()), (3, ids[1].as_str()), (5, ids[2].as_str())]);
    assert!(ds.skipped()[1].reason.contains("missing field `conversations`"), "{:?}", ds.skipped());
    assert!(ds.skipped()[2].reason.contains("image: "), "{:?}", ds.skipped());
    // JSON Lines is not read, and says so.
    let lines: Vec<String> = records.as_array().unwrap().iter().map(ToString::to_string).collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    let err = Dataset::open(spec(dir.path(), "train.json", BadData::Skip)).unwrap_err().to_string();
    assert!(err.contains("not JSON Lines"), "{err}");
}

/// Under the skip policy, a media root that holds none of the files leaves only the
/// text-only records: refused, naming the root, rather than trained on text alone.
#[test]
fn a_media_root_holding_no_file_is_refused_under_skip() {
    let dir = synth_dir("root");
    let wrong = dir.path().join("elsewhere");
    let spec =
        DatasetSpec { media_root: wrong.clone(), ..spec(dir.path(), "train.json", BadData::Skip) };
    let err = Dataset::open(spec).unwrap_err().to_string();
    assert!(
        err.contains("every record with media was left out")
            && err.contains(&format!("is the media root {} right", wrong.display())),
        "{err}"
    );
}
