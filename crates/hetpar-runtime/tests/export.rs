//! HF export: a checkpoint written as HF model directories loads in candle-transformers'
//! Llama, which computes the logits hetpar's LLM computes on the exported weights, and in
//! its SigLIP vision tower, which with the exported LLaVA projector computes the rows
//! hetpar's ViT gives the LLM; every exported tensor is bitwise the checkpoint's
//! parameter, and no optimizer state leaks in. An audio tower split over pipeline stages
//! exports as one Whisper encoder with HF's names.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{Config, LayoutSpec, ModelGraph, ModuleLayout, Span};
use hetpar_nn::io::{load_params, read_header};
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::audio::sinusoids;
use hetpar_nn::models::llama::{Llama, LlamaConfig};
use hetpar_nn::models::vit::{Vit, VitConfig};
use hetpar_nn::testing::{last_logits, rel_err};
use hetpar_nn::{Build, HasParams, ParallelCtx};
use hetpar_runtime::export::export_hf;
use hetpar_runtime::testing::{fault_config, fault_graph};
use hetpar_runtime::{Sources, Trainer};

/// `steps` steps of the colocated model (vision dp2, LLM tp2 on 2 ranks) in f32, then a
/// checkpoint under `dir/checkpoints`; its directory.
fn saved_colocated(dir: &std::path::Path, steps: usize) -> std::path::PathBuf {
    let g = fault_graph(false);
    let sources = Sources::synthetic(&g);
    let root = dir.join("checkpoints");
    launch(g.world, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let mut t = Trainer::new(c, &g, DType::F32, steps, &sources).unwrap();
        t.set_config_text(fault_config(false));
        for s in 0..steps {
            t.step(c, s).unwrap();
        }
        t.save(c, steps, &root, 0).unwrap();
    })
    .unwrap();
    root.join(format!("step-{steps:08}"))
}

#[test]
fn the_export_loads_in_candle_transformers_with_the_same_outputs() {
    let tmp = tempfile::Builder::new().prefix("hetpar-export-").tempdir().unwrap();
    let dir = tmp.path();
    let ckpt = saved_colocated(dir, 2);
    let g = fault_graph(false);
    let hf = dir.join("hf");
    let done = export_hf(&ckpt, &hf, None).unwrap();
    let names: Vec<(&str, &str)> =
        done.iter().map(|e| (e.module.as_str(), e.architecture.as_str())).collect();
    assert_eq!(names, vec![("llm", "LlamaForCausalLM"), ("vision", "SiglipVisionModel")]);

    // Every exported tensor is the checkpoint's parameter, bit for bit; no moments.
    for m in ["llm", "vision"] {
        let file = hf.join(m).join("model.safetensors");
        let exported = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        let saved = candle_core::safetensors::load(
            ckpt.join(format!("{m}.stage0.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        assert!(exported.keys().all(|k| !k.contains(':')));
        assert_eq!(exported.len(), saved.keys().filter(|k| !k.contains(':')).count());
        for (k, t) in &exported {
            let d = (t - &saved[k]).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{m} {k}");
        }
        assert!(read_header(&file).is_ok());
    }

    // candle-transformers' Llama from config.json and model.safetensors ...
    let llm = hf.join("llm");
    let text = std::fs::read_to_string(llm.join("config.json")).unwrap();
    let hf_cfg: candle_transformers::models::llama::LlamaConfig =
        serde_json::from_str(&text).unwrap();
    let rc = hf_cfg.into_config(false);
    let weights =
        candle_core::safetensors::load(llm.join("model.safetensors"), &Device::Cpu).unwrap();
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let model = candle_transformers::models::llama::Llama::load(vb, &rc).unwrap();
    let mut cache =
        candle_transformers::models::llama::Cache::new(false, DType::F32, &rc, &Device::Cpu)
            .unwrap();
    let tokens: Vec<u32> = (0..12).map(|i| ((i * 29 + 3) % 64) as u32).collect();
    let input = Tensor::new(tokens.as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let theirs: Vec<f32> =
        model.forward(&input, 0, &mut cache).unwrap().flatten_all().unwrap().to_vec1().unwrap();

    // ... and hetpar's LLM on one rank with the exported weights.
    let m = &g.modules[g.module_id("llm").unwrap()];
    let hetpar_layout::ModuleSpec::Llama { vocab, kv_heads, experts, top_k } = m.spec else {
        panic!("the llm is a llama")
    };
    let cfg = LlamaConfig {
        vocab,
        hidden: m.dims.hidden,
        layers: m.dims.layers,
        heads: m.dims.heads,
        kv_heads,
        ffn: m.dims.ffn,
        experts,
        top_k,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        aux_coef: 0.0,
        cp_mode: CpMode::AllGather,
    };
    let one = ModuleLayout::new("llm", Span::new(0, 1), LayoutSpec::default()).unwrap();
    let file = llm.join("model.safetensors");
    let mine: Vec<f32> = launch(1, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &one).unwrap();
        let model = Llama::new(&Build::new(ctx, 99, DType::F32), cfg).unwrap();
        load_params(&file, &model.params()).unwrap();
        last_logits(&model, &tokens).unwrap()
    })
    .unwrap()
    .pop()
    .unwrap();
    let e = rel_err_f32(&mine, &theirs);
    assert!(e <= 1e-5, "the exported LLM's logits differ from hetpar's by {e:e}");

    // candle-transformers' SigLIP vision tower from the vision directory's config.json and
    // model.safetensors, then the LLaVA projector (linear, exact GELU, linear) from the same
    // file: the rows the LLM receives ...
    use candle_core::Module;
    let vision = hf.join("vision");
    let text = std::fs::read_to_string(vision.join("config.json")).unwrap();
    let vcfg: candle_transformers::models::siglip::VisionConfig =
        serde_json::from_str(&text).unwrap();
    // Two steps leave the weights near their initialization (zero biases, unit norms, small
    // matrices), where a wrong GELU or a missing bias hardly shows: both sides load the
    // exported tensors moved by a fixed pattern, so every weight counts.
    let exported = candle_core::safetensors::load(vision.join("model.safetensors"), &Device::Cpu);
    let weights: std::collections::HashMap<String, Tensor> = exported
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let shift: Vec<f32> = (0..t.elem_count())
                .map(|i| ((i * 13 + k.len() * 7) % 17) as f32 / 34.0 - 0.25)
                .collect();
            let shift = Tensor::from_vec(shift, t.shape(), &Device::Cpu).unwrap();
            (k, (&t + shift).unwrap())
        })
        .collect();
    let file = vision.join("moved.safetensors");
    candle_core::safetensors::save(&weights, &file).unwrap();
    let linear = |name: &str| {
        let w = weights[&format!("{name}.weight")].clone();
        candle_nn::Linear::new(w, Some(weights[&format!("{name}.bias")].clone()))
    };
    let (proj1, proj2) =
        (linear("multi_modal_projector.linear_1"), linear("multi_modal_projector.linear_2"));
    let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
    let tower =
        candle_transformers::models::siglip::VisionModel::new(&vcfg, false, vb.pp("vision_model"))
            .unwrap();
    let s = vcfg.image_size;
    let values: Vec<f32> =
        (0..2 * 3 * s * s).map(|i| (((i * 37 + 11) % 101) as f32 / 50.0) - 1.0).collect();
    let pixels = Tensor::from_vec(values, (2, 3, s, s), &Device::Cpu).unwrap();
    let hidden = tower.forward(&pixels).unwrap();
    let rows = proj2.forward(&proj1.forward(&hidden).unwrap().gelu_erf().unwrap()).unwrap();
    let theirs: Vec<f32> = rows.flatten_all().unwrap().to_vec1().unwrap();

    // ... and hetpar's ViT on one rank with the exported weights.
    let m = &g.modules[g.module_id("vision").unwrap()];
    let hetpar_layout::ModuleSpec::Vit { image_size, patch_size } = m.spec else {
        panic!("vision is a vit")
    };
    assert_eq!((image_size, patch_size), (s, vcfg.patch_size));
    let cfg = VitConfig {
        image_size,
        patch_size,
        hidden: m.dims.hidden,
        layers: m.dims.layers,
        heads: m.dims.heads,
        ffn: m.dims.ffn,
        out_hidden: g.modules[g.module_id("llm").unwrap()].dims.hidden,
        ln_eps: vcfg.layer_norm_eps,
        cp_mode: CpMode::AllGather,
    };
    let one = ModuleLayout::new("vision", Span::new(0, 1), LayoutSpec::default()).unwrap();
    let mine: Vec<f32> = launch(1, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &one).unwrap();
        let vit = Vit::new(&Build::new(ctx, 98, DType::F32), cfg).unwrap();
        load_params(&file, &vit.params()).unwrap();
        let out = vit.forward(&pixels).unwrap();
        assert_eq!(out.dims(), rows.dims());
        out.flatten_all().unwrap().to_vec1().unwrap()
    })
    .unwrap()
    .pop()
    .unwrap();
    let e = rel_err_f32(&mine, &theirs);
    assert!(e <= 1e-5, "the exported vision tower's rows differ from hetpar's by {e:e}");
}

/// [`rel_err`] of two f32 vectors.
fn rel_err_f32(a: &[f32], b: &[f32]) -> f64 {
    let wide = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    rel_err(&wide(a), &wide(b))
}

/// An audio tower over two pipeline stages, trained in f64, exports as one HF Whisper
/// encoder: each stage's tensors once, bit for bit, under their names without the
/// encoder's `audio_tower.` prefix (the projector's as they are), Whisper's fixed position
/// table once, in the weights' f64, as hetpar's, and a feature extractor for its frames.
#[test]
fn an_audio_tower_over_two_stages_exports_as_one_whisper_encoder() {
    let tmp = tempfile::Builder::new().prefix("hetpar-export-audio-").tempdir().unwrap();
    let dir = tmp.path();
    let text = r#"
name = "audio-stages"
[train]
steps = 1
global_batch = 2
microbatches = 1
seq_len = 32
dtype = "f64"
[modules.audio]
kind = "audio"
n_mels = 8
frames = 16
hidden = 32
layers = 2
heads = 4
ffn = 48
[modules.audio.parallel]
ranks = [0, 2]
pp = 2
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = 1
heads = 4
kv_heads = 4
ffn = 48
[modules.llm.parallel]
ranks = [2, 3]
[[edges]]
from = "audio"
to = "llm"
"#;
    let g = ModelGraph::from_config(&Config::from_toml(text).unwrap()).unwrap();
    let sources = Sources::synthetic(&g);
    let root = dir.join("checkpoints");
    launch(g.world, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let mut t = Trainer::new(c, &g, DType::F64, 1, &sources).unwrap();
        t.set_config_text(text.to_string());
        t.step(c, 0).unwrap();
        t.save(c, 1, &root, 0).unwrap();
    })
    .unwrap();
    let ckpt = root.join("step-00000001");
    let hf = dir.join("hf");
    let done = export_hf(&ckpt, &hf, None).unwrap();
    let audio = done.iter().find(|e| e.module == "audio").unwrap();
    assert_eq!(audio.architecture, "WhisperEncoder");
    assert_eq!(audio.configs, ["config.json", "preprocessor_config.json"]);

    let cpu = &Device::Cpu;
    let exported = candle_core::safetensors::load(hf.join("audio").join("model.safetensors"), cpu);
    let exported = exported.unwrap();
    let mut saved = std::collections::BTreeMap::new();
    for stage in 0..2 {
        let file = ckpt.join(format!("audio.stage{stage}.safetensors"));
        for (k, t) in candle_core::safetensors::load(file, cpu).unwrap() {
            if !k.contains(':') {
                assert!(saved.insert(k.clone(), t).is_none(), "{k} is in both stages");
            }
        }
    }
    assert!(saved.contains_key("audio_tower.layers.1.fc1.weight"), "{:?}", saved.keys());
    assert_eq!(exported.len(), saved.len() + 1);
    let bits = |t: &Tensor| -> Vec<u64> {
        assert_eq!(t.dtype(), DType::F64);
        t.flatten_all().unwrap().to_vec1::<f64>().unwrap().iter().map(|x| x.to_bits()).collect()
    };
    for (k, t) in &saved {
        let name = k.strip_prefix("audio_tower.").unwrap_or(k);
        assert!(!name.starts_with("audio_tower"), "{k}");
        let theirs = exported.get(name).unwrap_or_else(|| panic!("{k} exported as {name}"));
        assert_eq!(bits(theirs), bits(t), "{k}");
    }
    let table = sinusoids(8, 32, DType::F64).unwrap();
    assert_eq!(bits(&exported["embed_positions.weight"]), bits(&table));

    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hf.join("audio").join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (&config["max_source_positions"], &config["torch_dtype"]),
        (&serde_json::json!(8), &serde_json::json!("float64"))
    );
    let features: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hf.join("audio").join("preprocessor_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        (&features["feature_size"], &features["clip_samples"], &features["chunk_length"]),
        (&serde_json::json!(8), &serde_json::json!(2560), &serde_json::json!(1))
    );
}

/// A tensor of another type than the checkpoint's parameters (in a file whose checksums
/// the manifest was made to agree with) is refused by the export, naming it, before any
/// module is written: the exported config would say one type and the weights hold
/// another.
#[test]
fn a_tensor_of_another_type_is_refused_before_anything_is_written() {
    let tmp = tempfile::Builder::new().prefix("hetpar-export-type-").tempdir().unwrap();
    let dir = tmp.path();
    let ckpt = saved_colocated(dir, 1);
    // The vision tower's file (the second module exported) with one weight in f64, and a
    // manifest of the first format (no checksum of its own) that lists the new file.
    let file = ckpt.join("vision.stage0.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let name = tensors.keys().find(|k| !k.contains(':')).unwrap().clone();
    let wide = tensors[&name].to_dtype(DType::F64).unwrap();
    tensors.insert(name.clone(), wide);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let (sha, bytes) = hetpar_runtime::checkpoint::sha256(&file).unwrap();
    let path = ckpt.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["format"] = "hetpar-checkpoint/1".into();
    m.as_object_mut().unwrap().remove("sha256");
    for f in m["files"].as_array_mut().unwrap() {
        if f["file"] == "vision.stage0.safetensors" {
            f["sha256"] = sha.clone().into();
            f["bytes"] = bytes.into();
        }
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let hf = dir.join("hf");
    let e = export_hf(&ckpt, &hf, None).unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "vision.stage0.safetensors: {name} is F64, where the checkpoint's parameters are f32"
        )),
        "{e}"
    );
    assert!(!hf.exists(), "nothing written");
}
