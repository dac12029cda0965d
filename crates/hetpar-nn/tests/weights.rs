//! Weights round-trip through safetensors with HF names: saved from a tp 2 model (slices
//! gathered on its first rank), loaded into tp 1 and tp 4 models, each rank reading only its
//! slice's bytes; bad files are refused naming the file and the tensor.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use hetpar_comm::{Communicator, Counted, LocalOptions, Traffic, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::io::{
    Source, copy_tensors, gather_full, load_params, read_header, save, save_sharded,
};
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::llama::{Llama, LlamaConfig};
use hetpar_nn::{Build, HasParams, ParallelCtx, Param, ShardSpec, Split};
use sha2::{Digest, Sha256};

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

/// A directory of one test's own, removed with its files when the value drops.
fn dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("hetpar-weights-").tempdir().unwrap()
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
    let tmp = dir();
    let path = tmp.path().join("llm.safetensors");
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
    let tmp = dir();
    let path = tmp.path().join("llm2.safetensors");
    saved(1, 1, 0.0, &path);
    let bytes = std::fs::read(&path).unwrap();
    let truncated = tmp.path().join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let e = read_header(&truncated).unwrap_err().to_string();
    assert!(e.starts_with(&truncated.display().to_string()) && e.contains("bytes at"), "{e}");
    // Sizes near 2^64 in a crafted header: offsets whose sum with the header's length
    // wraps, and a shape whose element count does.
    let crafted = |name: &str, header: &str| {
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(header.as_bytes());
        file.extend_from_slice(&[0u8; 64]);
        let p = tmp.path().join(name);
        std::fs::write(&p, file).unwrap();
        read_header(&p).unwrap_err().to_string()
    };
    let e = crafted(
        "wrapping-offsets.safetensors",
        &format!(
            r#"{{"w":{{"dtype":"F32","shape":[1],"data_offsets":[{},{}]}}}}"#,
            u64::MAX - 7,
            u64::MAX - 3
        ),
    );
    assert!(e.contains("bytes at"), "{e}");
    let e = crafted(
        "wrapping-shape.safetensors",
        &format!(
            r#"{{"w":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,0]}}}}"#,
            1u64 << 32,
            1u64 << 32
        ),
    );
    assert!(e.contains("too large"), "{e}");
    // Two tensors over the same bytes, which the format forbids: one would be read as the
    // other (a weight as its optimizer moment, say).
    let e = crafted(
        "overlapping.safetensors",
        r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
    );
    assert!(e.contains("b: bytes 8..16 overlap a's 0..16 (tensors may not share bytes)"), "{e}");
    let garbage = tmp.path().join("garbage.safetensors");
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

/// A saved file is as readable as any file created in its directory (safetensors' own
/// writer makes a private temporary file and renames it; ours creates the file plainly).
#[cfg(unix)]
#[test]
fn saved_files_get_the_mode_a_plain_create_gives() {
    let tmp = dir();
    use std::os::unix::fs::PermissionsExt;
    let d = tmp.path().join("mode");
    std::fs::create_dir_all(&d).unwrap();
    let plain = d.join("plain");
    std::fs::File::create(&plain).unwrap();
    let file = d.join("w.safetensors");
    let _ = std::fs::remove_file(&file);
    let t = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    save(&file, &BTreeMap::from([("w".to_string(), t)])).unwrap();
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    // (Under a umask of 077 both are 0600 and this says nothing; CI's is 022.)
    assert_eq!(mode(&file), mode(&plain));
}

/// The streaming writer's file is the one the safetensors crate makes from the same
/// tensors, byte for byte (types of three widths, a scalar), with its SHA-256 and length;
/// copying tensors out of it gives the file of those tensors.
#[test]
fn the_writer_makes_the_file_safetensors_makes() {
    let tmp = dir();
    let d = tmp.path().join("writer");
    std::fs::create_dir_all(&d).unwrap();
    let cpu = &Device::Cpu;
    let values = |n: usize| (0..n).map(|i| i as f64 * 0.37 - 1.0).collect::<Vec<_>>();
    let tensors = BTreeMap::from([
        ("b.f32".to_string(), Tensor::new(values(15), cpu).unwrap().reshape((3, 5)).unwrap()),
        ("a.f64".to_string(), Tensor::new(values(4), cpu).unwrap().reshape((2, 2)).unwrap()),
        ("c.bf16".to_string(), Tensor::new(values(7), cpu).unwrap()),
        ("d.scalar".to_string(), Tensor::new(2.5f64, cpu).unwrap()),
    ]);
    let tensors: BTreeMap<String, Tensor> = tensors
        .into_iter()
        .map(|(n, t)| {
            let dtype = match n.rsplit('.').next().unwrap() {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                _ => DType::F64,
            };
            (n, t.to_dtype(dtype).unwrap())
        })
        .collect();
    let path = d.join("mixed.safetensors");
    let written = save(&path, &tensors).unwrap();
    // candle's tensors are safetensors views: the crate's own writer, for comparison.
    let expected = safetensors::serialize(tensors.iter(), None).unwrap();
    let file = std::fs::read(&path).unwrap();
    assert_eq!(file, expected);
    assert_eq!(written.bytes, file.len() as u64);
    assert_eq!(written.sha256, format!("{:x}", Sha256::digest(&file)));
    assert_eq!(written.tensors, tensors.keys().cloned().collect::<Vec<_>>());
    // Two of the four, copied out.
    let part = d.join("part.safetensors");
    let none = BTreeMap::new();
    let pair = [Source::same(&path, "c.bf16"), Source::same(&path, "a.f64")];
    let copied = copy_tensors(&part, &pair, &none).unwrap();
    let alone = d.join("alone.safetensors");
    let subset: BTreeMap<String, Tensor> = tensors
        .iter()
        .filter(|(n, _)| !n.starts_with('b') && !n.starts_with('d'))
        .map(|(n, t)| (n.clone(), t.clone()))
        .collect();
    assert_eq!(save(&alone, &subset).unwrap(), copied);
    assert_eq!(std::fs::read(&part).unwrap(), std::fs::read(&alone).unwrap());
    // One renamed, with a tensor made in memory beside it: the file a save of the same
    // tensors under those names writes.
    let renamed = d.join("renamed.safetensors");
    let made: BTreeMap<String, Tensor> =
        [("m.f32".to_string(), Tensor::arange(0f32, 6.0, &Device::Cpu).unwrap())].into();
    let from = [Source { file: &path, name: "b.f32", to: "x.f32" }];
    let copied = copy_tensors(&renamed, &from, &made).unwrap();
    let mut want = made.clone();
    want.insert("x.f32".to_string(), tensors["b.f32"].clone());
    let alone = d.join("alone-renamed.safetensors");
    assert_eq!(save(&alone, &want).unwrap(), copied);
    assert_eq!(std::fs::read(&renamed).unwrap(), std::fs::read(&alone).unwrap());
    // A name given twice, by a copy and a made tensor, is refused and writes nothing.
    let clash = [Source { file: &path, name: "b.f32", to: "m.f32" }];
    let e = copy_tensors(&d.join("clash.safetensors"), &clash, &made).unwrap_err().to_string();
    assert!(e.contains("tensor m.f32 is asked for twice"), "{e}");
    assert!(!d.join("clash.safetensors").exists());
}

/// Streamed from tp 2 x dp 2 (column- and row-split weights), the file is the one a single
/// rank writes from the whole tensors, byte for byte; the second replica sends none of the
/// tensors (only the names and shapes every member learns).
#[test]
fn a_sharded_save_writes_what_one_rank_writes_sending_each_slice_once() {
    let tmp = dir();
    let d = tmp.path().join("sharded");
    std::fs::create_dir_all(&d).unwrap();
    let whole = d.join("tp1.safetensors");
    let file_bytes = saved(1, 3, 0.25, &whole).values().map(|t| t.elem_count() * 4).sum::<usize>();
    let sharded = d.join("tp2dp2.safetensors");
    let l =
        ModuleLayout::new("llm", Span::new(0, 4), LayoutSpec { tp: 2, ..LayoutSpec::default() })
            .unwrap();
    let out = launch(4, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let traffic = Arc::new(Traffic::default());
        let counted = Counted::new(c.subgroup(&[0, 1, 2, 3]).unwrap(), traffic.clone());
        let ctx = ParallelCtx::new(&counted, &l).unwrap();
        let dp = ctx.coords.dp_idx;
        let m = Llama::new(&Build::new(ctx.clone(), 3, DType::F32), CFG).unwrap();
        for p in m.params() {
            p.var.set(&(p.tensor() + 0.25).unwrap()).unwrap();
        }
        let before = traffic.bytes();
        let comm = ctx.stage.comm().map(|c| c.as_ref());
        let w = save_sharded(comm, &m.params(), &sharded).unwrap();
        (w, dp, traffic.bytes() - before)
    })
    .unwrap();
    let file = std::fs::read(&sharded).unwrap();
    assert_eq!(file, std::fs::read(&whole).unwrap());
    let w = out[0].0.as_ref().unwrap();
    assert_eq!(
        (w.sha256.clone(), w.bytes),
        (format!("{:x}", Sha256::digest(&file)), file.len() as u64)
    );
    assert!(out[1..].iter().all(|o| o.0.is_none()));
    assert_eq!(out.iter().filter(|o| o.1 == 1).count(), 2, "ranks 2 and 3 are the second replica");
    for (_, dp, sent) in &out[1..] {
        if *dp == 1 {
            assert!((*sent as usize) < file_bytes / 10, "a replica sent {sent} of {file_bytes}");
        } else {
            assert!(
                (*sent as usize) > file_bytes * 4 / 10,
                "the tp peer sent {sent} of {file_bytes}"
            );
        }
    }
}

/// Slices that leave a row unheld are refused with the same error on every member; a file
/// the writer cannot create fails there while the others finish (nobody waits on a send).
#[test]
fn untiled_slices_and_an_unwritable_file_fail_without_a_hang() {
    let tmp = dir();
    let d = tmp.path().join("untiled");
    std::fs::create_dir_all(&d).unwrap();
    let out = launch(2, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let held = |offset: usize, len: usize| Param {
            name: "w".into(),
            var: Var::from_tensor(&Tensor::ones((len, 3), DType::F32, &Device::Cpu).unwrap())
                .unwrap(),
            spec: ShardSpec {
                global_shape: vec![4, 3],
                split: Some(Split { dim: 0, offset, len }),
                reduce: vec![],
            },
            sink: Default::default(),
        };
        let comm: &dyn Communicator = c;
        let gap = if c.rank() == 0 { held(0, 2) } else { held(3, 1) };
        let gap = save_sharded(Some(comm), &[&gap], &d.join("gap.safetensors")).unwrap_err();
        let fine = if c.rank() == 0 { held(0, 2) } else { held(2, 2) };
        let lost = save_sharded(Some(comm), &[&fine], &d.join("no-such-dir/w.safetensors"));
        // The failed save took every slice: the next one on the group gets its own.
        let twos = Param {
            var: Var::from_tensor(&(fine.tensor() * 2.0).unwrap()).unwrap(),
            ..fine.clone()
        };
        let after = save_sharded(Some(comm), &[&twos], &d.join("after.safetensors")).unwrap();
        (gap.to_string(), lost.map(|w| w.is_some()).map_err(|e| e.to_string()), after.is_some())
    })
    .unwrap();
    for (gap, _, _) in &out {
        assert!(
            gap.contains("w: the members' slices of dimension 0 (0..2, 3..4) do not tile its 4"),
            "{gap}"
        );
    }
    assert!(matches!(&out[0].1, Err(e) if e.contains("no-such-dir")), "{:?}", out[0].1);
    assert_eq!(out[1].1, Ok(false));
    assert!(!d.join("gap.safetensors").exists());
    let (start, entries) = read_header(&d.join("after.safetensors")).unwrap();
    let bytes = std::fs::read(d.join("after.safetensors")).unwrap();
    let w = &entries["w"];
    let values: Vec<f32> = bytes[(start + w.begin) as usize..(start + w.end) as usize]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(values, vec![2.0; 12]);
}

/// A member holding a tensor of another shape than its slice says is refused on every
/// member, before anything moves.
#[test]
fn a_slice_of_the_wrong_size_is_refused_everywhere() {
    let tmp = dir();
    let d = tmp.path().join("wrong-size");
    std::fs::create_dir_all(&d).unwrap();
    let out = launch(2, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let rows = if c.rank() == 0 { 2 } else { 3 };
        let p = Param {
            name: "w".into(),
            var: Var::from_tensor(&Tensor::ones((rows, 3), DType::F32, &Device::Cpu).unwrap())
                .unwrap(),
            spec: ShardSpec {
                global_shape: vec![4, 3],
                split: Some(Split { dim: 0, offset: 2 * c.rank(), len: 2 }),
                reduce: vec![],
            },
            sink: Default::default(),
        };
        let comm: &dyn Communicator = c;
        save_sharded(Some(comm), &[&p], &d.join("w.safetensors")).unwrap_err().to_string()
    })
    .unwrap();
    for e in out {
        assert!(
            e.contains("w: member 1 holds a tensor of shape [3, 3] for its slice of shape [2, 3]"),
            "{e}"
        );
    }
}

/// A save that cannot take its place (the target is a directory) fails naming the target,
/// leaves no temporary file, and a file saved over an old one replaces it whole.
#[test]
fn a_save_replaces_its_target_whole_or_not_at_all() {
    let tmp = dir();
    let d = tmp.path().join("replace");
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("taken.safetensors")).unwrap();
    let t = |v: f32| {
        BTreeMap::from([("w".to_string(), Tensor::full(v, (2, 3), &Device::Cpu).unwrap())])
    };
    let e = save(&d.join("taken.safetensors"), &t(1.0)).unwrap_err().to_string();
    assert!(e.contains("taken.safetensors") && !e.contains(".tmp"), "{e}");
    let file = d.join("w.safetensors");
    save(&file, &t(1.0)).unwrap();
    let second = save(&file, &t(2.0)).unwrap();
    assert_eq!(second.bytes, std::fs::metadata(&file).unwrap().len());
    let left: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.iter().all(|n| !n.ends_with(".tmp")), "{left:?}");
    let (start, entries) = read_header(&file).unwrap();
    let bytes = std::fs::read(&file).unwrap();
    let at = (start + entries["w"].begin) as usize;
    assert_eq!(f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 2.0);
}
