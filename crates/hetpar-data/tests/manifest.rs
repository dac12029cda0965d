//! A step's manifest from synthetic records through the template, on the demo's graph:
//! every item on the edge of its encoder at the position the template gave it.

#![allow(clippy::unwrap_used)]

use hetpar_data::chat::{Kind, Vocab, encode};
use hetpar_data::manifest::{Edges, step_manifest};
use hetpar_data::synth::{self, SynthOptions};
use hetpar_layout::{Config, ModelGraph};

fn demo() -> ModelGraph {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/demo.toml"))
            .unwrap();
    ModelGraph::from_config(&Config::from_toml(&text).unwrap()).unwrap()
}

#[test]
fn synthetic_records_make_the_demos_manifest() {
    let g = demo();
    let edges = Edges::of(&g).unwrap();
    let (image_rows, audio_rows) = edges.rows();
    assert_eq!((image_rows, audio_rows), (16, 64));
    let opts = SynthOptions { max_images: 1, ..SynthOptions::with_samples(40) };
    let records: Vec<_> = (0..opts.samples).map(|i| synth::sample(opts.seed, i, &opts).0).collect();
    let texts: Vec<String> =
        records.iter().flat_map(|r| r.conversations.iter().map(|t| t.value.clone())).collect();
    let vocab = Vocab::train(&texts, 400).unwrap();
    let encoded: Vec<_> = records
        .iter()
        .map(|r| encode(&vocab, r, image_rows, audio_rows, g.train.seq_len).unwrap())
        .collect();
    let step: Vec<(&str, _)> = records
        .iter()
        .zip(&encoded)
        .take(g.train.global_batch)
        .map(|(r, e)| (r.id.as_str(), e))
        .collect();
    let m = step_manifest(&g, &step).unwrap();
    assert_eq!(m.samples().len(), g.train.global_batch);
    for ((_, e), s) in step.iter().zip(m.samples()) {
        assert_eq!(s.len, e.length);
        assert_eq!(s.items.len(), e.items.len());
        for (item, it) in s.items.iter().zip(&e.items) {
            let want = match it.kind {
                Kind::Image => edges.image.unwrap().0,
                Kind::Audio => edges.audio.unwrap().0,
            };
            assert_eq!((item.edge, item.pos, item.rows), (want, it.position, it.rows));
        }
    }
    // A record encoded with other row counts than its encoder gives is refused, named.
    let r = records.iter().find(|r| !r.image.is_empty()).unwrap();
    let wrong = encode(&vocab, r, image_rows + 1, audio_rows, 512).unwrap();
    let e = step_manifest(&g, &[(r.id.as_str(), &wrong); 8]).unwrap_err();
    let want = format!("record {}: image 0 was encoded with 17 rows, its encoder gives 16", r.id);
    assert!(e.contains(&want), "{e}");
}
