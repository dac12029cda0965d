//! Whole models sharded over tp (with and without SP), cp, dp and ep match the world-size-1
//! run: the loss, every parameter gradient and the gradient of the encoder rows placed into
//! the LLM's embedding (read from the canonical replica), in f32 and f64.

#![allow(clippy::unwrap_used, clippy::too_many_arguments)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use common::*;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::kernels::linear::Matmul;
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::audio::{AudioConfig, AudioEncoder};
use hetpar_nn::models::llama::{Boundary, Llama, LlamaBatch, LlamaConfig};
use hetpar_nn::models::vit::{Vit, VitConfig};
use hetpar_nn::testing::{RankReport, TINY_VIT, assemble, compare_params, flat, rel_err, snapshot};
use hetpar_nn::{Build, HasParams, ParallelCtx};

const B: usize = 4;
const S: usize = 16;

fn llama(experts: usize, cp_mode: CpMode) -> LlamaConfig {
    LlamaConfig {
        vocab: 64,
        hidden: 32,
        layers: 2,
        heads: 8,
        kv_heads: 4,
        ffn: 48,
        experts,
        top_k: 2,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        aux_coef: 0.05,
        cp_mode,
    }
}

fn layout(n: usize, tp: usize, cp: usize, ep: usize, sp: bool) -> ModuleLayout {
    let spec = LayoutSpec { tp, cp, ep, etp: Some(1), sp, ..LayoutSpec::default() };
    ModuleLayout::new("llm", Span::new(0, n), spec).unwrap()
}

/// Encoder rows: (sample, first position, rows). They cross CP chunks and SP parts.
const ROWS: [(usize, usize, usize); 3] = [(0, 2, 4), (1, 6, 5), (3, 11, 3)];

fn row_count() -> usize {
    ROWS.iter().map(|r| r.2).sum()
}

/// Global position of every encoder row, with its (sample, position).
fn row_positions() -> Vec<(usize, usize)> {
    ROWS.iter().flat_map(|&(s, p, n)| (p..p + n).map(move |q| (s, q))).collect()
}

fn tokens() -> Vec<u32> {
    (0..B * S).map(|i| ((i * 37 + 11) % 64) as u32).collect()
}

/// Next-token targets; none at the last position and none where an encoder row sits.
fn targets() -> Vec<i64> {
    let t = tokens();
    let rows = row_positions();
    (0..B * S)
        .map(|i| {
            let (s, p) = (i / S, i % S);
            if p + 1 == S || rows.contains(&(s, p + 1)) || rows.contains(&(s, p)) {
                -1
            } else {
                i64::from(t[i + 1])
            }
        })
        .collect()
}

fn run_llama(l: &ModuleLayout, cfg: LlamaConfig, dtype: DType) -> Vec<RankReport> {
    let n_targets = targets().iter().filter(|&&t| t >= 0).count() as f64;
    launch(l.span().len(), LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let ctx = ParallelCtx::new(c, l).unwrap();
        let b = Build::new(ctx.clone(), 7, dtype);
        let model = Llama::new(&b, cfg).unwrap();
        let coords = ctx.coords;
        let per = B / l.dp();
        let samples = coords.dp_idx * per..(coords.dp_idx + 1) * per;
        let cp_pos = cp_positions(l, ctx.rank, S);
        let local = local_positions(l, ctx.rank, S);
        let (all_tokens, all_targets) = (tokens(), targets());
        let mut toks = Vec::new();
        let mut tgts = Vec::new();
        for s in samples.clone() {
            for &p in cp_pos.own() {
                toks.push(all_tokens[s * S + p]);
                tgts.push(all_targets[s * S + p]);
            }
        }
        // Encoder rows this rank needs, in local order, and their slots.
        let rows = Var::from_tensor(&global("rows", &[row_count(), cfg.hidden], dtype)).unwrap();
        let mut needed = Vec::new();
        let mut slots = Vec::new();
        for (bi, s) in samples.clone().enumerate() {
            for (i, &p) in local.iter().enumerate() {
                if let Some(r) = row_positions().iter().position(|&x| x == (s, p)) {
                    needed.push(r as u32);
                    slots.push(bi * local.len() + i);
                }
            }
        }
        let idx = Tensor::from_vec(needed.clone(), needed.len(), &Device::Cpu).unwrap();
        let boundary = Boundary { rows: rows.as_tensor().index_select(&idx, 0).unwrap(), slots };
        let batch = LlamaBatch {
            tokens: toks,
            batch: per,
            positions: cp_pos,
            boundary: Some(boundary),
            targets: Arc::new(tgts),
        };
        let out = model.forward(&batch).unwrap();
        let loss = ((&out.loss_sum / n_targets).unwrap() + &out.aux).unwrap();
        let grads = loss.backward().unwrap();
        let mut values = BTreeMap::new();
        values.insert("loss_sum".to_string(), flat(&out.loss_sum).unwrap());
        values.insert("aux".to_string(), flat(&out.aux).unwrap());
        let rg = grads
            .get(rows.as_tensor())
            .map(|g| flat(g).unwrap())
            .unwrap_or_else(|| vec![0.0; row_count() * cfg.hidden]);
        values.insert("row_grad".to_string(), rg);
        values.insert("needed".to_string(), needed.iter().map(|&r| r as f64).collect());
        snapshot(&ctx, &model.params(), &grads, values).unwrap()
    })
    .unwrap()
}

/// The loss of a run: losses of tp rank 0 of every (dp, cp) position, plus every rank's
/// aux part.
fn total_loss(runs: &[RankReport]) -> f64 {
    let n = targets().iter().filter(|&&t| t >= 0).count() as f64;
    let ce: f64 =
        runs.iter().filter(|r| r.coords.tp_idx == 0).map(|r| r.values["loss_sum"][0]).sum::<f64>()
            / n;
    ce + runs.iter().map(|r| r.values["aux"][0]).sum::<f64>()
}

/// Gradient of every encoder row from its canonical holder (lowest tp among its needers).
fn row_grads(runs: &[RankReport], hidden: usize) -> Vec<f64> {
    let mut out = vec![None; row_count()];
    let mut holders: Vec<&RankReport> = runs.iter().collect();
    holders.sort_by_key(|r| (r.coords.tp_idx, r.rank));
    for r in holders {
        for &row in &r.values["needed"] {
            let row = row as usize;
            if out[row].is_none() {
                out[row] = Some(r.values["row_grad"][row * hidden..(row + 1) * hidden].to_vec());
            }
        }
    }
    out.into_iter().flat_map(|r| r.expect("every row has a needer")).collect()
}

fn check_llama(
    n: usize,
    tp: usize,
    cp: usize,
    ep: usize,
    sp: bool,
    cfg: LlamaConfig,
    reference: &[RankReport],
    dtype: DType,
) {
    let tol = tolerance(dtype);
    let what = format!(
        "llama experts {} world {n} tp {tp} cp {cp} ep {ep} sp {sp} {:?} {dtype:?}",
        cfg.experts, cfg.cp_mode
    );
    let runs = run_llama(&layout(n, tp, cp, ep, sp), cfg, dtype);
    compare_params(&assemble(reference, tol).unwrap(), &assemble(&runs, tol).unwrap(), tol)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let (got, want) = (total_loss(&runs), total_loss(reference));
    assert!(rel_err(&[got], &[want]) <= tol, "{what}: loss {got} vs {want}");
    let e = rel_err(&row_grads(&runs, cfg.hidden), &row_grads(reference, cfg.hidden));
    assert!(e <= tol, "{what}: encoder row gradients differ by {e:e}");
}

#[test]
fn dense_llama_matches_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let cfg = llama(0, CpMode::AllGather);
        let reference = run_llama(&layout(1, 1, 1, 1, false), cfg, dtype);
        for (n, tp, cp, sp) in [
            (2, 2, 1, false),
            (2, 2, 1, true),
            (4, 4, 1, false),
            (4, 4, 1, true),
            (2, 1, 2, false),
            (4, 1, 4, false),
            (4, 2, 2, true),
            (4, 2, 1, true),
        ] {
            check_llama(n, tp, cp, 1, sp, cfg, &reference, dtype);
        }
        check_llama(4, 1, 4, 1, false, llama(0, CpMode::Ring), &reference, dtype);
    }
}

#[test]
fn moe_llama_matches_one_rank() {
    for dtype in [DType::F32, DType::F64] {
        let cfg = llama(4, CpMode::AllGather);
        let reference = run_llama(&layout(1, 1, 1, 1, false), cfg, dtype);
        for (n, tp, cp, ep, sp) in [
            (2, 1, 1, 2, false),
            (4, 1, 1, 4, false),
            (2, 2, 1, 2, true),
            (4, 2, 1, 2, false),
            (4, 1, 2, 2, false),
        ] {
            check_llama(n, tp, cp, ep, sp, cfg, &reference, dtype);
        }
    }
}

const VIT: VitConfig = TINY_VIT;

/// An encoder's run: `items` inputs of `shape` split over dp, each giving `rows` output
/// rows of `out` wide; the loss probes every output row this rank holds.
struct EncoderRun<'a> {
    input: &'a str,
    shape: &'a [usize],
    rows: usize,
    out: usize,
}

fn run_encoder<M: HasParams>(
    l: &ModuleLayout,
    dtype: DType,
    run: &EncoderRun<'_>,
    build: impl Fn(&Build) -> M + Sync,
    forward: impl Fn(&M, &Tensor) -> (Tensor, Vec<usize>) + Sync,
) -> Vec<RankReport> {
    let items = run.shape[0];
    launch(l.span().len(), LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let ctx = ParallelCtx::new(c, l).unwrap();
        let model = build(&Build::new(ctx.clone(), 9, dtype));
        let per = items / l.dp();
        let mine = ctx.coords.dp_idx * per;
        let input = global(run.input, run.shape, dtype).narrow(0, mine, per).unwrap();
        let (y, local) = forward(&model, &input);
        let probe_all =
            global("probe", &[items, run.rows, run.out], dtype).narrow(0, mine, per).unwrap();
        let idx = Tensor::from_vec(
            local.iter().map(|&p| p as u32).collect::<Vec<_>>(),
            local.len(),
            &Device::Cpu,
        )
        .unwrap();
        let probe = probe_all.index_select(&idx, 1).unwrap();
        let grads = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        let mut values = BTreeMap::new();
        values.insert("out".to_string(), flat(&y).unwrap());
        snapshot(&ctx, &model.params(), &grads, values).unwrap()
    })
    .unwrap()
}

/// The layouts both encoders must match one rank on: (world, tp, cp, sp, CP mode).
const ENCODER_LAYOUTS: [(usize, usize, usize, bool, CpMode); 7] = [
    (2, 2, 1, false, CpMode::AllGather),
    (2, 2, 1, true, CpMode::AllGather),
    (4, 4, 1, true, CpMode::AllGather),
    (2, 1, 2, false, CpMode::AllGather),
    (4, 1, 4, false, CpMode::Ring),
    (4, 2, 2, true, CpMode::AllGather),
    (4, 1, 1, false, CpMode::AllGather),
];

/// Runs `run(layout, mode, dtype)` on every encoder layout and compares with one rank.
fn encoder_matches_one_rank(
    what: &str,
    run: impl Fn(&ModuleLayout, CpMode, DType) -> Vec<RankReport>,
) {
    for dtype in [DType::F32, DType::F64] {
        let tol = tolerance(dtype);
        let reference = run(&layout(1, 1, 1, 1, false), CpMode::AllGather, dtype);
        for (n, tp, cp, sp, mode) in ENCODER_LAYOUTS {
            let runs = run(&layout(n, tp, cp, 1, sp), mode, dtype);
            compare_params(
                &assemble(&reference, tol).unwrap(),
                &assemble(&runs, tol).unwrap(),
                tol,
            )
            .unwrap_or_else(|e| {
                panic!("{what} world {n} tp {tp} cp {cp} sp {sp} {mode:?} {dtype:?}: {e}")
            });
        }
    }
}

#[test]
fn vit_matches_one_rank() {
    let run = EncoderRun {
        input: "pixels",
        shape: &[4, 3, 16, 16],
        rows: VIT.patches(),
        out: VIT.out_hidden,
    };
    encoder_matches_one_rank("vit", |l, mode, dtype| {
        let cfg = VitConfig { cp_mode: mode, ..VIT };
        run_encoder(
            l,
            dtype,
            &run,
            |b| Vit::new(b, cfg).unwrap(),
            |m, x| (m.forward(x).unwrap(), m.local_positions().unwrap()),
        )
    });
}

const AUDIO: AudioConfig = AudioConfig {
    mels: 8,
    frames: 15,
    hidden: 32,
    layers: 2,
    heads: 4,
    ffn: 48,
    out_hidden: 24,
    ln_eps: 1e-5,
    cp_mode: CpMode::AllGather,
};

#[test]
fn audio_encoder_matches_one_rank() {
    // 15 frames give 8 rows per clip: whole on 1 rank, in 2 or 4 parts over sp-tp x cp.
    let (shape, rows) = ([4, AUDIO.mels, AUDIO.frames], AUDIO.rows());
    let run = EncoderRun { input: "features", shape: &shape, rows, out: AUDIO.out_hidden };
    encoder_matches_one_rank("audio", |l, mode, dtype| {
        let cfg = AudioConfig { cp_mode: mode, ..AUDIO };
        run_encoder(
            l,
            dtype,
            &run,
            |b| AudioEncoder::new(b, cfg).unwrap(),
            |m, x| (m.forward(x).unwrap(), m.local_positions().unwrap()),
        )
    });
}

#[test]
fn audio_encoder_refuses_features_of_another_shape() {
    let l = layout(1, 1, 1, 1, false);
    let e = launch(1, LocalOptions { timeout: Duration::from_secs(10) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let enc = AudioEncoder::new(&Build::new(ctx, 1, DType::F32), AUDIO).unwrap();
        enc.forward(&Tensor::zeros((1, 8, 16), DType::F32, &Device::Cpu).unwrap())
            .unwrap_err()
            .to_string()
    })
    .unwrap();
    assert!(e[0].contains("8 mels x 16 frames, the encoder takes 8 x 15"), "{}", e[0]);
}

#[test]
fn the_encoders_embeddings_multiply_as_their_build_says() {
    // Embedding-only first stages (no layers, no head): built for bf16 products, the ViT's
    // patch embedding and the audio encoder's convolutions give the f32 output within bf16
    // rounding (operands rounded within 2^-8, each product summed in f32), and not its bits.
    let l = layout(1, 1, 1, 1, false);
    launch(1, LocalOptions { timeout: Duration::from_secs(60) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let out = |how: Matmul| {
            let b = Build::new(ctx.clone(), 3, DType::F32).with_matmul(how);
            let vit = Vit::stage(&b, VIT, 0..0, true, false).unwrap();
            let audio = AudioEncoder::stage(&b, AUDIO, 0..0, true, false).unwrap();
            let pixels = global("pixels", &[2, 3, 16, 16], DType::F32);
            let features = global("features", &[2, AUDIO.mels, AUDIO.frames], DType::F32);
            [
                flat(&vit.forward(&pixels).unwrap()).unwrap(),
                flat(&audio.forward(&features).unwrap()).unwrap(),
            ]
        };
        let (native, bf16) = (out(Matmul::Native), out(Matmul::Bf16));
        for ((what, n), b) in ["vit", "audio"].iter().zip(&native).zip(&bf16) {
            let d = rel_err(b, n);
            assert!(d > 0.0 && d < 2f64.powi(-6), "{what}: bf16 against f32 {d:e}");
        }
    })
    .unwrap();
}
