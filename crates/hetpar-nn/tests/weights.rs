//! Weights round-trip through safetensors with HF names: saved from a tp 2 model (slices
//! gathered on its first rank), loaded into tp 1 and tp 4 models, each rank reading only its
//! slice's bytes; bad files are refused naming the file and the tensor.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use candle_core::{DType, Tensor};
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::io::{gather_full, load_params, read_header, save};
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::llama::{Llama, LlamaConfig};
use hetpar_nn::{Build, HasParams, ParallelCtx};

const CFG: LlamaConfig = LlamaConfig {
    vocab: 64,
    hidden: 32,
    layers: 2,
    heads: 8,
    kv_heads: 4,
    ffn: 48,
    experts: 0,
    top_k: 2,
    rms_eps: 1e-5,
    rope_theta: 10_000.0,
    aux_coef: 0.0,
    cp_mode: CpMode::AllGather,
};

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("hetpar-weights-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn layout(tp: usize) -> ModuleLayout {
    ModuleLayout::new("llm", Span::new(0, tp), LayoutSpec { tp, ..LayoutSpec::default() }).unwrap()
}

/// Full tensors of a model built with `seed` on `tp` ranks, every value shifted by `shift`
/// so that loaded weights differ from a fresh init.
fn saved(tp: usize, seed: u64, shift: f64, path: &std::path::Path) -> BTreeMap<String, Tensor> {
    let l = layout(tp);
    launch(tp, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let m = Llama::new(&Build::new(ctx, seed, DType::F32), CFG).unwrap();
        for p in m.params() {
            p.var.set(&(p.tensor() + shift).unwrap()).unwrap();
        }
        let full = gather_full(c, &m.params()).unwrap();
        if let Some(full) = &full {
            save(path, full).unwrap();
        }
        full
    })
    .unwrap()
    .into_iter()
    .flatten()
    .next()
    .unwrap()
}

#[test]
fn save_under_tp2_load_under_tp1_and_tp4() {
    let path = dir().join("llm.safetensors");
    let full = saved(2, 1, 0.5, &path);
    let (_, header) = read_header(&path).unwrap();
    assert!(
        header.contains_key("model.layers.1.self_attn.q_proj.weight")
            && header.contains_key("lm_head.weight")
    );
    let file_bytes: u64 = header.values().map(|e| e.end - e.begin).sum();
    for tp in [1, 4] {
        let l = layout(tp);
        let out = launch(tp, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
            let ctx = ParallelCtx::new(c, &l).unwrap();
            let m = Llama::new(&Build::new(ctx, 999, DType::F32), CFG).unwrap();
            let read = load_params(&path, &m.params()).unwrap();
            (read, gather_full(c, &m.params()).unwrap())
        })
        .unwrap();
        let reloaded = out[0].1.as_ref().unwrap();
        for (name, t) in &full {
            let a: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            let b: Vec<f32> = reloaded[name].flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(a, b, "{name} under tp {tp}");
        }
        // One rank reads the whole file; under tp 4 each rank reads its quarter of the
        // sharded tensors and the (small) replicated norms.
        for (read, _) in &out {
            if tp == 1 {
                assert_eq!(*read, file_bytes);
            } else {
                assert!(
                    *read < file_bytes * 3 / 10,
                    "tp {tp}: a rank read {read} of {file_bytes} bytes"
                );
            }
        }
    }
}

#[test]
fn corrupt_files_are_refused_naming_the_file() {
    let path = dir().join("llm2.safetensors");
    saved(1, 1, 0.0, &path);
    let bytes = std::fs::read(&path).unwrap();
    let truncated = dir().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let e = read_header(&truncated).unwrap_err().to_string();
    assert!(e.starts_with(&truncated.display().to_string()) && e.contains("bytes at"), "{e}");
    let garbage = dir().join("garbage.safetensors");
    std::fs::write(&garbage, [255u8; 64]).unwrap();
    let e = read_header(&garbage).unwrap_err().to_string();
    assert!(e.contains("does not fit a file of 64 bytes"), "{e}");
    let l = layout(1);
    let e = launch(1, LocalOptions::default(), |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let other = LlamaConfig { hidden: 64, heads: 8, ..CFG };
        let m = Llama::new(&Build::new(ctx, 1, DType::F32), other).unwrap();
        load_params(&path, &m.params()).unwrap_err().to_string()
    })
    .unwrap()
    .pop()
    .unwrap();
    assert!(
        e.contains("model.embed_tokens.weight has shape [64, 32], the model expects [64, 64]"),
        "{e}"
    );
}

/// A saved file is as readable as any file created in its directory (safetensors writes a
/// private temporary file and renames it).
#[cfg(unix)]
#[test]
fn saved_files_get_the_mode_a_plain_create_gives() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir().join("mode");
    std::fs::create_dir_all(&d).unwrap();
    let plain = d.join("plain");
    std::fs::File::create(&plain).unwrap();
    let file = d.join("w.safetensors");
    let _ = std::fs::remove_file(&file);
    let t = Tensor::zeros((2, 3), DType::F32, &candle_core::Device::Cpu).unwrap();
    save(&file, &BTreeMap::from([("w".to_string(), t)])).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // (Under a umask of 077 both are 0600 and this says nothing; CI's is 022.)
    assert_eq!(mode(&file), mode(&plain));
}
