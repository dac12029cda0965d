//! Training on files (the synthetic LLaVA-format set): a colocated and a non-colocated
//! layout match one rank step for step (f64, 1e-10), and so do their held-out loss and
//! answer counts; each payload is decoded only by the ranks that run its item (a rank of the
//! LLM alone decodes nothing), ahead of its step on the loader thread. Each rank plans its
//! own share of the boundaries, and the bytes a step reports are every rank's plans' total.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::DType;
use hetpar_comm::{Communicator, LocalOptions, launch};
use hetpar_data::dataset::{BadData, Fronts};
use hetpar_data::synth::{self, SynthOptions};
use hetpar_data::{Dataset, DatasetSpec};
use hetpar_layout::{BatchManifest, Config, Direction, ModelGraph};
use hetpar_runtime::{EvalReport, Sources, StepPlans, Trainer};

const STEPS: usize = 3;

/// The model on `vision`, `audio` and `llm` rank spans (`[a, b]`), the LLM at `llm_tp`.
fn graph(vision: [usize; 2], audio: [usize; 2], llm: [usize; 2], llm_tp: usize) -> ModelGraph {
    graph_with(vision, audio, llm, &format!("tp = {llm_tp}"))
}

/// [`graph`] with the LLM's parallel section given as TOML lines.
fn graph_with(
    vision: [usize; 2],
    audio: [usize; 2],
    llm: [usize; 2],
    parallel: &str,
) -> ModelGraph {
    let text = format!(
        r#"
name = "files"
[train]
seed = 5
steps = {STEPS}
global_batch = 4
microbatches = 2
seq_len = 160
lr = 3e-3
[data]
source = "llava"
path = "unused: the test opens the files"
[modules.vision]
kind = "vit"
image_size = 32
patch_size = 8
hidden = 32
layers = 1
heads = 2
ffn = 64
[modules.vision.parallel]
ranks = {vision:?}
[modules.audio]
kind = "audio"
n_mels = 16
frames = 64
hidden = 32
layers = 1
heads = 2
ffn = 64
[modules.audio.parallel]
ranks = {audio:?}
[modules.llm]
kind = "llama"
vocab = 512
hidden = 32
layers = 2
heads = 4
kv_heads = 2
ffn = 64
[modules.llm.parallel]
ranks = {llm:?}
{parallel}
[[edges]]
from = "vision"
to = "llm"
[[edges]]
from = "audio"
to = "llm"
"#
    );
    ModelGraph::from_config(&Config::from_toml(&text).unwrap()).unwrap()
}

/// The training and held-out splits of a 40-sample synthetic set for `g`.
fn data(g: &ModelGraph) -> (Arc<Dataset>, Arc<Dataset>) {
    // Generated once per test process: the tests run in parallel and share it.
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let dir = DIR
        .get_or_init(|| {
            // Under cargo's scratch space for tests, emptied first: runs leave one set behind.
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hetpar-runtime-data");
            let _ = std::fs::remove_dir_all(&dir);
            synth::generate(&dir, &SynthOptions::with_samples(40), &mut |_| {}).unwrap();
            dir
        })
        .clone();
    let spec = |json: &str| DatasetSpec {
        path: dir.join(json),
        media_root: dir.clone(),
        tokenizer: dir.join("tokenizer.json"),
        seq_len: g.train.seq_len,
        vocab: 512,
        fronts: Fronts { image: Some((32, 16)), audio: Some((16, 64, 32)) },
        on_bad: BadData::Error,
    };
    let open = |json: &str| Arc::new(Dataset::open(spec(json)).unwrap());
    (open("train.json"), open("heldout.json"))
}

/// Per rank: the step losses, the held-out report, and payloads decoded before and after
/// the evaluation.
type Run = Vec<(Vec<f64>, EvalReport, usize, usize)>;

fn train(g: &ModelGraph) -> Run {
    let (train, heldout) = data(g);
    let out = launch(g.world, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let rank = hetpar_comm::CommExt::global_rank(c);
        let sources = Sources::files(g, rank, train.clone(), Some(heldout.clone()));
        let mut t = Trainer::new(c, g, DType::F64, STEPS, &sources)?;
        let losses = (0..STEPS)
            .map(|s| {
                let log = t.step(c, s)?;
                assert_eq!(log.boundary_bytes, whole_plans_bytes(g, &log.manifest), "step {s}");
                Ok(log.report.loss)
            })
            .collect::<Result<_, hetpar_runtime::RuntimeError>>()?;
        c.barrier()?;
        let before = sources.batches.decodes();
        let eval = t.evaluate(c)?;
        Ok::<_, hetpar_runtime::RuntimeError>((losses, eval, before, sources.batches.decodes()))
    })
    .unwrap();
    out.into_iter().map(Result::unwrap).collect()
}

/// What each edge moves in a step of `manifest` by every rank's plans (f64 rows, every
/// module training): the bytes a step's log reports, from each rank's own plans summed.
fn whole_plans_bytes(g: &ModelGraph, manifest: &BatchManifest) -> Vec<(String, u64, u64)> {
    let plans = StepPlans::new(g, manifest.clone());
    (0..g.edges.len())
        .map(|e| {
            let width = 8 * g.modules[g.edges[e].dst].dims.hidden as u64;
            let rows = |dir| -> u64 {
                (0..manifest.n_microbatches())
                    .map(|k| plans.plan(e, k).unwrap().program(dir).traffic().total() as u64)
                    .sum()
            };
            (
                plans.edge_name(e),
                rows(Direction::Forward) * width,
                rows(Direction::Backward) * width,
            )
        })
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

/// Images and clips of training steps `0..steps` that each encoder replica owns.
fn items_of(g: &ModelGraph, steps: std::ops::Range<usize>, rank: usize) -> usize {
    let (train, _) = data(g);
    let sources = Sources::files(g, rank, train, None);
    let mut n = 0;
    for s in steps {
        let m = sources.batches.manifest(s).unwrap();
        for (e, edge) in g.edges.iter().enumerate() {
            let layout = &g.modules[edge.src].layout;
            let Some(c) = layout.coords(rank) else { continue };
            if c.pp_idx != 0 {
                continue;
            }
            for mb in 0..m.n_microbatches() {
                n += m.replica_items(e, layout.dp(), c.dp_idx, mb).len();
            }
        }
    }
    n
}

#[test]
fn file_data_trains_and_evaluates_as_one_rank_under_both_placements() {
    let one = graph([0, 1], [0, 1], [0, 1], 1);
    let want = train(&one);
    let (ref_losses, ref_eval) = (&want[0].0, &want[0].1);
    assert!(
        ref_eval.targets > 0 && ref_eval.answers.values().map(|a| a.answers).sum::<usize>() > 0
    );
    let layouts = [
        // Vision colocated with the LLM (dp 2 next to tp 2), audio on an island.
        ("colocated", graph([0, 2], [2, 3], [0, 2], 2)),
        // Every module on its own island: ranks 0-1 run the LLM alone.
        ("islands", graph([2, 3], [3, 4], [0, 2], 2)),
        // The LLM's sequence split over cp 2 and tp 2 with SP: each position scored once.
        ("cp-sp", graph_with([0, 4], [4, 5], [0, 4], "tp = 2\ncp = 2\nsp = true")),
        // Two pipeline stages of two replicas: the last stage scores its replica's samples.
        ("pp-dp", graph_with([0, 4], [4, 5], [0, 4], "pp = 2")),
    ];
    for (name, g) in layouts {
        let got = train(&g);
        for (rank, (losses, eval, before, after)) in got.iter().enumerate() {
            for (s, (a, b)) in losses.iter().zip(ref_losses).enumerate() {
                assert!(rel(*a, *b) < 1e-10, "{name} rank {rank} step {s}: {a} vs {b}");
            }
            assert!(rel(eval.loss, ref_eval.loss) < 1e-10, "{name}: {eval:?} vs {ref_eval:?}");
            // The model's top tokens too: the vocabulary split over tp 2, the sequence over
            // cp 2, the samples over pipeline replicas pick the same, each scored once.
            assert_eq!(
                (eval.targets, eval.correct_tokens, &eval.answers, &eval.answered),
                (ref_eval.targets, ref_eval.correct_tokens, &ref_eval.answers, &ref_eval.answered),
                "{name} rank {rank}"
            );
            // Decoded: the items this rank's encoder replicas own in the steps run, and
            // perhaps the next step's, prefetched; an LLM-only rank decodes nothing, not
            // even for the held-out batches (a replica of four may own no item in the
            // steps run).
            let (lo, hi) = (items_of(&g, 0..STEPS, rank), items_of(&g, 0..STEPS + 1, rank));
            assert!((lo..=hi).contains(before), "{name} rank {rank}: {before} not in {lo}..={hi}");
            let encodes = g
                .edges
                .iter()
                .any(|e| g.modules[e.src].layout.coords(rank).is_some_and(|c| c.pp_idx == 0));
            if !encodes {
                assert_eq!((*before, *after), (0, 0), "{name} rank {rank} runs no encoder");
            } else if lo > 0 {
                assert!(after > before, "{name} rank {rank} decodes held-out items");
            }
        }
        if name == "islands" {
            assert_eq!((got[0].2, got[1].2), (0, 0));
        }
        let right: usize = got[0].1.answers.values().map(|t| t.right).sum();
        assert_eq!(got[0].1.answered.iter().filter(|a| a.right()).count(), right, "{name}");
    }
}

/// The last held-out batch is filled up with records from the start; those slots carry no
/// target, so each record counts once: three records in a batch of four give exactly their
/// own targets and answers.
#[test]
fn filler_slots_of_the_last_heldout_batch_count_nothing() {
    let g = graph([0, 1], [0, 1], [0, 1], 1);
    let (train, heldout) = data(&g);
    let dir = heldout.spec().path.parent().unwrap().to_path_buf();
    let three: Vec<_> = heldout.entries()[..3].iter().map(|e| e.record.clone()).collect();
    let file = dir.join("three.json");
    hetpar_data::llava::save(&file, &three).unwrap();
    let spec = DatasetSpec { path: file, ..heldout.spec().clone() };
    let small = Arc::new(Dataset::open(spec).unwrap());
    assert_eq!(small.eval_batches(g.train.global_batch), 1);
    let want_targets: usize = small
        .entries()
        .iter()
        .map(|e| e.encoded.targets().iter().filter(|&&t| t >= 0).count())
        .sum();
    let want_answers: usize = (0..3).map(|e| small.answers(e).len()).sum();
    let out = launch(1, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let sources = Sources::files(&g, 0, train.clone(), Some(small.clone()));
        let mut t = Trainer::new(c, &g, DType::F64, STEPS, &sources)?;
        t.evaluate(c)
    })
    .unwrap();
    let eval = out.into_iter().next().unwrap().unwrap();
    assert_eq!(eval.targets, want_targets);
    assert_eq!(eval.answers.values().map(|t| t.answers).sum::<usize>(), want_answers);
    // Each answer once, in order, with the records' own tokens; as many right as the
    // tally counts from the positions' marks, a right one's greedy answer whole.
    let mut want = Vec::new();
    for (e, entry) in small.entries().iter().enumerate() {
        let targets = entry.encoded.targets();
        for a in small.answers(e) {
            want.push((a.kind, a.positions.map(|p| targets[p] as u32).collect::<Vec<_>>()));
        }
    }
    let got: Vec<_> = eval.answered.iter().map(|a| (a.kind, a.expected.clone())).collect();
    assert_eq!(got, want);
    let right: usize = eval.answers.values().map(|t| t.right).sum();
    assert_eq!(eval.answered.iter().filter(|a| a.right()).count(), right);
    for a in &eval.answered {
        let g = a.greedy();
        let first_miss = a.expected.iter().zip(&a.model).position(|(e, m)| e != m);
        match first_miss {
            None => assert_eq!(g, a.expected.as_slice()),
            Some(i) => assert!(g.len() == i + 1 && g[..i] == a.expected[..i] && g[i] == a.model[i]),
        }
    }
}
