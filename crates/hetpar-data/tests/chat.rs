//! Golden sequences: the template, targets, placeholder rows and truncation for
//! single-image, multi-image, audio, text-only and truncated records, on a BPE trained
//! from the synthetic set's texts.

#![allow(clippy::unwrap_used)]

use hetpar_data::chat::{
    ASSISTANT, END, Encoded, Item, Kind, PAD, SPECIAL, SYSTEM, USER, Vocab, encode,
};
use hetpar_data::llava::{AUDIO, IMAGE, Record};
use hetpar_data::synth::{self, SynthOptions};

fn vocab() -> Vocab {
    let opts = SynthOptions::with_samples(300);
    let texts: Vec<String> = (0..opts.samples)
        .flat_map(|i| synth::sample(opts.seed, i, &opts).0.conversations)
        .map(|t| t.value)
        .collect();
    Vocab::train(&texts, 400).unwrap()
}

fn record(json: &str) -> Record {
    serde_json::from_str(json).unwrap()
}

/// What `encode` must give, built by hand from the pieces: (ids, learned) per segment.
fn expect(v: &Vocab, segments: &[(Vec<u32>, bool)], seq_len: usize) -> (Vec<u32>, Vec<i64>) {
    let mut ids = Vec::new();
    let mut learned = Vec::new();
    for (s, l) in segments {
        ids.extend(s);
        learned.extend(std::iter::repeat_n(*l, s.len()));
    }
    let n = ids.len();
    ids.resize(seq_len, v.id(PAD).unwrap());
    let targets = (0..seq_len)
        .map(|i| if i + 1 < n && learned[i + 1] { i64::from(ids[i + 1]) } else { -1 })
        .collect();
    (ids, targets)
}

#[test]
fn the_vocabulary_is_deterministic_and_keeps_the_specials_first() {
    let (a, b) = (vocab(), vocab());
    let dir = std::env::temp_dir().join(format!("hetpar-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    a.save(&dir.join("a.json")).unwrap();
    b.save(&dir.join("b.json")).unwrap();
    assert_eq!(
        std::fs::read(dir.join("a.json")).unwrap(),
        std::fs::read(dir.join("b.json")).unwrap()
    );
    let back = Vocab::load(&dir.join("a.json")).unwrap();
    for (i, s) in SPECIAL.iter().enumerate() {
        assert_eq!((a.id(s), back.id(s)), (Some(i as u32), Some(i as u32)), "{s}");
    }
    assert!(a.len() <= 400 && a.len() > 100, "{}", a.len());
    // Text comes back from its ids; a common word is one token.
    let ids = a.ids("three red circles; one high chirp").unwrap();
    assert_eq!(a.decode(&ids).unwrap(), "three red circles; one high chirp");
    assert_eq!(a.ids(" circles").unwrap().len(), 1, "a frequent word after a space");
    std::fs::write(dir.join("plain.json"), "{}").unwrap();
    let e = Vocab::load(&dir.join("plain.json")).unwrap_err().to_string();
    assert!(
        e.contains("plain.json: not a tokenizer.json") || e.contains("not a tokenizer.json"),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn single_image_multi_image_audio_and_text_only_records() {
    let v = vocab();
    let sp = |s: &str| vec![v.id(s).unwrap()];
    let t = |s: &str| v.ids(s).unwrap();
    let rows = |s: &str, n: usize| vec![v.id(s).unwrap(); n];
    // One image of 4 rows, answered.
    let one = record(
        r#"{"id": "a", "image": "x.png", "conversations": [{"from": "human", "value": "<image>\nWhat is in the image?"}, {"from": "gpt", "value": "two red circles"}]}"#,
    );
    let e = encode(&v, &one, 4, 3, 32).unwrap();
    let (ids, targets) = expect(
        &v,
        &[
            (sp(USER), false),
            (rows(IMAGE, 4), false),
            (t("\nWhat is in the image?"), false),
            (sp(END), false),
            (sp(ASSISTANT), false),
            (t("two red circles"), true),
            (sp(END), true),
        ],
        32,
    );
    assert_eq!((e.ids(), e.targets()), (ids, targets));
    assert_eq!(e.items, [Item { kind: Kind::Image, index: 0, position: 1, rows: 4 }]);
    assert_eq!(e.truncated, 0);
    // The last learned token is the closing <|end|>: the position before it predicts it.
    let learned: Vec<usize> = (0..32).filter(|&i| e.targets()[i] >= 0).collect();
    assert_eq!(e.targets()[*learned.last().unwrap()], i64::from(v.id(END).unwrap()));
    assert_eq!(learned.len(), t("two red circles").len() + 1);

    // Two images then a clip in a second turn: items in order, each with its rows.
    let many = record(
        r#"{"id": "b", "image": ["x.png", "y.png"], "audio": "z.wav", "conversations": [{"from": "human", "value": "<image>\n<image>\nWhat is in each image?"}, {"from": "gpt", "value": "one blue square; three green triangles"}, {"from": "human", "value": "<audio>\nWhat do you hear?"}, {"from": "gpt", "value": "two low tones"}]}"#,
    );
    let e = encode(&v, &many, 4, 3, 64).unwrap();
    let (ids, targets) = expect(
        &v,
        &[
            (sp(USER), false),
            (rows(IMAGE, 4), false),
            (t("\n"), false),
            (rows(IMAGE, 4), false),
            (t("\nWhat is in each image?"), false),
            (sp(END), false),
            (sp(ASSISTANT), false),
            (t("one blue square; three green triangles"), true),
            (sp(END), true),
            (sp(USER), false),
            (rows(AUDIO, 3), false),
            (t("\nWhat do you hear?"), false),
            (sp(END), false),
            (sp(ASSISTANT), false),
            (t("two low tones"), true),
            (sp(END), true),
        ],
        64,
    );
    assert_eq!((e.ids(), e.targets()), (ids, targets));
    let second = 1 + 4 + t("\n").len();
    let audio_at = e.items[2].position;
    assert_eq!(
        e.items,
        [
            Item { kind: Kind::Image, index: 0, position: 1, rows: 4 },
            Item { kind: Kind::Image, index: 1, position: second, rows: 4 },
            Item { kind: Kind::Audio, index: 0, position: audio_at, rows: 3 },
        ]
    );
    assert!(audio_at > second + 4);

    // Text only: no items, targets on the answer.
    let text = record(
        r#"{"id": "c", "conversations": [{"from": "human", "value": "Count on from two."}, {"from": "gpt", "value": "three four five"}]}"#,
    );
    let e: Encoded = encode(&v, &text, 4, 3, 24).unwrap();
    assert!(e.items.is_empty());
    let (ids, targets) = expect(
        &v,
        &[
            (sp(USER), false),
            (t("Count on from two."), false),
            (sp(END), false),
            (sp(ASSISTANT), false),
            (t("three four five"), true),
            (sp(END), true),
        ],
        24,
    );
    assert_eq!((e.ids(), e.targets()), (ids, targets));
    // Exported sets write `null` for a text-only record's media: the same record.
    let null = record(
        r#"{"id": "c", "image": null, "audio": null, "conversations": [{"from": "human", "value": "Count on from two."}, {"from": "gpt", "value": "three four five"}]}"#,
    );
    assert_eq!(null, text);
}

#[test]
fn truncation_cuts_only_past_every_row_and_keeps_something_to_learn() {
    let v = vocab();
    let one = record(
        r#"{"id": "a", "image": "x.png", "conversations": [{"from": "human", "value": "<image>\nWhat is in the image?"}, {"from": "gpt", "value": "two red circles and three blue squares"}]}"#,
    );
    let full = encode(&v, &one, 4, 3, 64).unwrap();
    // Cut two tokens off the end: the rest is unchanged, the cut counted.
    let cut = encode(&v, &one, 4, 3, full.length - 2).unwrap();
    assert_eq!((cut.length, cut.truncated), (full.length, 2));
    let (cut_ids, cut_targets, full_targets) = (cut.ids(), cut.targets(), full.targets());
    assert_eq!(cut_ids[..], full.ids()[..full.length - 2]);
    assert_eq!(cut_targets[..cut_ids.len() - 1], full_targets[..cut_ids.len() - 1]);
    assert_eq!(*cut_targets.last().unwrap(), -1, "the last position predicts nothing kept");
    // An image's rows past the end: refused, naming the item.
    let e = encode(&v, &one, 40, 3, 30).unwrap_err();
    assert!(e.contains("do not fit seq_len 30: image 0 needs positions 1..41"), "{e}");
    // Room for the rows and the prompt but no answer token: refused.
    let prompt = 1 + 4 + v.ids("\nWhat is in the image?").unwrap().len() + 2;
    let e = encode(&v, &one, 4, 3, prompt).unwrap_err();
    assert!(e.contains("leaves no assistant token to learn"), "{e}");
    assert!(encode(&v, &one, 4, 3, prompt + 1).is_ok());
}

/// A marker's spelling written in a record's text is text: it neither closes a turn nor
/// pads, and the only marker ids in the sequence are those the template puts there (a
/// record could otherwise forge a turn boundary, and a run of `<|end|>` be cut as padding).
#[test]
fn markers_written_in_a_record_are_text() {
    let v = vocab();
    // The turn and padding markers (`<image>` and `<audio>` are placeholders, read as such
    // in human turns and refused elsewhere by the record's check).
    for marker in [PAD, USER, ASSISTANT, SYSTEM, END] {
        let r = record(&format!(
            r#"{{"id": "m", "conversations": [{{"from": "human", "value": "say {marker} twice"}}, {{"from": "gpt", "value": "{marker}{marker}"}}]}}"#
        ));
        let e = encode(&v, &r, 4, 3, 64).unwrap();
        let id = v.id(marker).unwrap();
        let n = e.length;
        let ids = e.ids();
        let count = ids[..n].iter().filter(|&&i| i == id).count();
        let template = match marker {
            USER | ASSISTANT => 1,
            END => 2,
            _ => 0,
        };
        assert_eq!(count, template, "{marker} in the text became a marker");
        // The answer's text comes back as written.
        let answer = &ids
            [(ids[..n].iter().position(|&i| i == v.id(ASSISTANT).unwrap()).unwrap() + 1)..n - 1];
        assert_eq!(v.decode(answer).unwrap(), format!("{marker}{marker}"));
    }
}
