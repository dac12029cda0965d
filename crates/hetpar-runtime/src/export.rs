//! HF export of a checkpoint: one directory per module with `model.safetensors` (the
//! parameters under their HF names, without optimizer state) and a `config.json` in the
//! format of its HF model family: Llama (`LlamaForCausalLM`) or Mixtral
//! (`MixtralForCausalLM`) for the LLM, a SigLIP vision tower with its LLaVA projector
//! (`multi_modal_projector.*`), a Whisper encoder with its projector (`audio_projector.*`).
//! Each tower's directory loads as its HF class on its own: the audio tower's tensors lose
//! the `audio_tower.` prefix they carry inside hetpar (Qwen2-Audio's naming) and gain
//! Whisper's fixed `embed_positions.weight`, and both towers get the
//! `preprocessor_config.json` that gives their input from an image or a clip.
//!
//! The checkpoint's files are checked against their SHA-256 first; only JSON, TOML and
//! safetensors are read.

use std::path::{Path, PathBuf};

use candle_core::DType;
use hetpar_data::mel::{HOP, N_FFT, SAMPLE_RATE, clip_samples};
use hetpar_layout::config::{DataConfig, DataSource};
use hetpar_layout::{Config, ModelGraph, Module, ModuleSpec};
use hetpar_nn::io::{Source, copy_tensors, read_header};
use hetpar_nn::models::audio::{self, sinusoids};

use crate::assemble::MOE_AUX_COEF;
use crate::checkpoint::{CONFIG_FILE, read_manifest, saved_config, sha256};
use crate::error::RuntimeError;

type Result<T> = std::result::Result<T, RuntimeError>;

/// One exported module.
#[derive(Clone, Debug, PartialEq)]
pub struct Exported {
    /// Module name.
    pub module: String,
    /// Its directory.
    pub dir: PathBuf,
    /// HF architecture written to `config.json`.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub bytes: u64,
    /// The JSON files written beside it (`config.json`; a tower's
    /// `preprocessor_config.json`, SigLIP's image processor or Whisper's feature extractor;
    /// the LLM's `generation_config.json` given [`Tokens`]).
    pub configs: Vec<&'static str>,
}

fn bad(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Model(format!("export {}: {e}", path.display()))
}

/// The run's graph from the config a checkpoint carries.
pub fn checkpoint_graph(ckpt: &Path) -> Result<ModelGraph> {
    let path = ckpt.join(CONFIG_FILE);
    let text = saved_config(ckpt)?.ok_or_else(|| bad(&path, "the checkpoint holds no config"))?;
    saved_graph(&text, &path)
}

/// The graph of a checkpoint's config `text` (its file `path`, for errors).
fn saved_graph(text: &str, path: &Path) -> Result<ModelGraph> {
    let mut cfg = Config::from_toml(text).map_err(|e| bad(path, e))?;
    // Builds before the check accepted a synth set's size under the other sources and
    // saved it; it says nothing about the model.
    if cfg.data.source != DataSource::Synth {
        cfg.data.samples = DataConfig::SYNTH_SAMPLES;
    }
    ModelGraph::from_config(&cfg).map_err(|e| bad(path, e))
}

/// The HF `config.json` of `m` (and its architecture name); `seq_len` bounds positions.
fn hf_config(m: &Module, seq_len: usize, dtype: &str) -> (String, serde_json::Value) {
    let d = m.dims;
    let torch_dtype = if dtype == "f64" { "float64" } else { "float32" };
    match m.spec {
        ModuleSpec::Llama { vocab, kv_heads, experts, top_k } => {
            let mut c = serde_json::json!({
                "hidden_size": d.hidden,
                "intermediate_size": d.ffn,
                "num_hidden_layers": d.layers,
                "num_attention_heads": d.heads,
                "num_key_value_heads": kv_heads,
                "vocab_size": vocab,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10_000.0,
                "max_position_embeddings": seq_len,
                "hidden_act": "silu",
                "tie_word_embeddings": false,
                "torch_dtype": torch_dtype,
            });
            let arch = if experts > 0 {
                c["model_type"] = "mixtral".into();
                c["num_local_experts"] = experts.into();
                c["num_experts_per_tok"] = top_k.into();
                c["router_aux_loss_coef"] = MOE_AUX_COEF.into();
                c["sliding_window"] = seq_len.into();
                "MixtralForCausalLM"
            } else {
                c["model_type"] = "llama".into();
                "LlamaForCausalLM"
            };
            c["architectures"] = serde_json::json!([arch]);
            (arch.to_string(), c)
        }
        ModuleSpec::Vit { image_size, patch_size } => {
            let arch = "SiglipVisionModel";
            let c = serde_json::json!({
                "architectures": [arch],
                "model_type": "siglip_vision_model",
                "hidden_size": d.hidden,
                "intermediate_size": d.ffn,
                "num_hidden_layers": d.layers,
                "num_attention_heads": d.heads,
                "num_channels": 3,
                "image_size": image_size,
                "patch_size": patch_size,
                "layer_norm_eps": 1e-6,
                "hidden_act": "gelu",
                "vision_use_head": false,
                "torch_dtype": torch_dtype,
                "projector": {"type": "llava", "names": "multi_modal_projector.linear_{1,2}", "hidden_act": "gelu"},
            });
            (arch.to_string(), c)
        }
        ModuleSpec::Audio { n_mels, frames } => {
            let arch = "WhisperEncoder";
            let c = serde_json::json!({
                "architectures": [arch],
                "model_type": "whisper",
                "d_model": d.hidden,
                "encoder_layers": d.layers,
                "encoder_attention_heads": d.heads,
                "encoder_ffn_dim": d.ffn,
                "num_mel_bins": n_mels,
                "max_source_positions": frames.div_ceil(2),
                "activation_function": "gelu",
                "torch_dtype": torch_dtype,
                "projector": {"names": "audio_projector.linear_{1,2}", "hidden_act": "gelu"},
            });
            (arch.to_string(), c)
        }
    }
}

/// The HF image processor of a ViT of `size` pixels: what `hetpar-data`'s `pixels.rs`
/// does, as SigLIP's processor says it (RGB, a bicubic resize to the square, `x / 255`,
/// then `(x - 0.5) / 0.5` per channel), so `AutoImageProcessor` gives the encoder's input.
fn image_processor(size: usize) -> serde_json::Value {
    serde_json::json!({
        "image_processor_type": "SiglipImageProcessor",
        "do_convert_rgb": true,
        "do_resize": true,
        "size": {"height": size, "width": size},
        "resample": 3,
        "do_rescale": true,
        "rescale_factor": 1.0 / 255.0,
        "do_normalize": true,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    })
}

/// Tensor `name`'s name in its module's HF directory: an audio tower's without the
/// encoder's prefix ([`audio::PREFIX`], which HF's `WhisperEncoder` does not have).
fn hf_name(audio: bool, name: &str) -> &str {
    let bare = || name.strip_prefix(audio::PREFIX)?.strip_prefix('.');
    if audio { bare().unwrap_or(name) } else { name }
}

/// The HF feature extractor of a Whisper encoder over `frames` log-mel frames of `n_mels`
/// bands: what `hetpar-data`'s `mel.rs` computes (16 kHz, a 400-sample periodic Hann
/// window every 160 samples, a Slaney filterbank, `log10`, clamped to 8 below the maximum,
/// `(x + 4) / 4`), the clip padded with silence or cut to `frames * 160` samples.
/// `WhisperFeatureExtractor` takes its length as whole seconds (`chunk_length`); for a
/// length that is not (the demo's 1.28 s), its `max_length` argument must give the samples
/// (`clip_samples`, which the extractor keeps as an attribute), and `chunk_length` is the
/// length rounded up (the encoder refuses that many frames, naming the number it expects).
fn feature_extractor(n_mels: usize, frames: usize) -> serde_json::Value {
    let rate = SAMPLE_RATE as usize;
    serde_json::json!({
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": n_mels,
        "sampling_rate": rate,
        "hop_length": HOP,
        "n_fft": N_FFT,
        "chunk_length": clip_samples(frames).div_ceil(rate),
        "padding_value": 0.0,
        "padding_side": "right",
        "return_attention_mask": false,
        "dither": 0.0,
        "clip_samples": clip_samples(frames),
    })
}

/// The LLM's end and padding token ids, where the run had a tokenizer: written into its
/// `config.json` and a `generation_config.json` (without them HF takes Llama's defaults,
/// bos 1 and eos 2, which name other tokens here, and `generate` never stops).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokens {
    /// The token that ends a turn (`<|end|>`).
    pub eos: u32,
    /// The padding token (`<|pad|>`).
    pub pad: u32,
}

/// Exports checkpoint `ckpt` into `out/<module>/`; `tokens` names the LLM's end and padding
/// ids.
pub fn export_hf(ckpt: &Path, out: &Path, tokens: Option<Tokens>) -> Result<Vec<Exported>> {
    let graph = checkpoint_graph(ckpt)?;
    let manifest = read_manifest(ckpt, &graph)?;
    for f in &manifest.files {
        let path = ckpt.join(&f.file);
        let (h, n) = sha256(&path)?;
        if h != f.sha256 || n != f.bytes {
            return Err(bad(&path, "SHA-256 differs from the manifest: the file is corrupt"));
        }
    }
    // Every module's tensors and their files' headers first, so that a file refused there
    // leaves nothing written.
    let mut modules = Vec::new();
    for m in &graph.modules {
        let mut from: Vec<(PathBuf, String)> = Vec::new();
        // The parameters' element type, which a tensor made here takes.
        let mut dtype = None;
        for f in manifest.files.iter().filter(|f| f.file.starts_with(&format!("{}.stage", m.name)))
        {
            let path = ckpt.join(&f.file);
            let (_, entries) = read_header(&path)?;
            for (name, e) in entries.into_iter().filter(|(n, _)| !n.contains(':')) {
                // The exported config says the manifest's type (`torch_dtype`).
                if !manifest.dtype.is_empty() && !e.dtype.eq_ignore_ascii_case(&manifest.dtype) {
                    let why = format!(
                        "{name} is {}, where the checkpoint's parameters are {}",
                        e.dtype, manifest.dtype
                    );
                    return Err(bad(&path, why));
                }
                dtype.get_or_insert(e.dtype);
                from.push((path.clone(), name));
            }
        }
        if from.is_empty() {
            return Err(bad(ckpt, format!("no tensors of module {} in the checkpoint", m.name)));
        }
        modules.push((m, from, dtype));
    }
    let mut done = Vec::new();
    for (m, from, dtype) in modules {
        let dir = out.join(&m.name);
        std::fs::create_dir_all(&dir).map_err(|e| bad(&dir, e))?;
        let file = dir.join("model.safetensors");
        let audio = matches!(m.spec, ModuleSpec::Audio { .. });
        let sources: Vec<Source<'_>> =
            from.iter().map(|(p, n)| Source { file: p, name: n, to: hf_name(audio, n) }).collect();
        let mut made = std::collections::BTreeMap::new();
        if let (ModuleSpec::Audio { frames, .. }, Some(t)) = (&m.spec, &dtype) {
            let dtype: DType = t.to_lowercase().parse().map_err(|e| bad(&file, e))?;
            let table = sinusoids(frames.div_ceil(2), m.dims.hidden, dtype)?;
            made.insert("embed_positions.weight".to_string(), table);
        }
        let written = copy_tensors(&file, &sources, &made)?;
        let (architecture, config) = hf_config(m, graph.train.seq_len, &manifest.dtype);
        let mut files = vec![("config.json", config)];
        match (&m.spec, tokens) {
            (ModuleSpec::Vit { image_size, .. }, _) => {
                files.push(("preprocessor_config.json", image_processor(*image_size)));
            }
            (ModuleSpec::Audio { n_mels, frames }, _) => {
                files.push(("preprocessor_config.json", feature_extractor(*n_mels, *frames)));
            }
            (ModuleSpec::Llama { .. }, Some(t)) => {
                let ids = serde_json::json!({"eos_token_id": t.eos, "pad_token_id": t.pad, "bos_token_id": null});
                if let (Some(c), Some(ids)) = (files[0].1.as_object_mut(), ids.as_object()) {
                    c.extend(ids.clone());
                }
                files.push(("generation_config.json", ids));
            }
            _ => {}
        }
        let configs = files.iter().map(|(name, _)| *name).collect();
        for (name, value) in files {
            let path = dir.join(name);
            let text = serde_json::to_string_pretty(&value).map_err(|e| bad(&path, e))?;
            std::fs::write(&path, text + "\n").map_err(|e| bad(&path, e))?;
        }
        done.push(Exported {
            module: m.name.clone(),
            dir,
            architecture,
            tensors: written.tensors.len(),
            bytes: written.bytes,
            configs,
        });
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::path::Path;

    use hetpar_layout::{Config, ModelGraph};

    /// A config an earlier build saved with a synth set's size under another source (which
    /// a config is now refused for) still exports: the size says nothing about the model.
    #[test]
    fn a_saved_synth_size_under_another_source_is_read() {
        let example = include_str!("../../../examples/in-memory.toml");
        let text = example.replacen("[data]\n", "[data]\nsamples = 20\n", 1);
        assert_ne!(text, example);
        let refused = ModelGraph::from_config(&Config::from_toml(&text).unwrap()).unwrap_err();
        assert!(refused.to_string().contains("data.samples"), "{refused}");
        let g = super::saved_graph(&text, Path::new("config.toml")).unwrap();
        assert_eq!(g, ModelGraph::from_config(&Config::from_toml(example).unwrap()).unwrap());
    }
}
