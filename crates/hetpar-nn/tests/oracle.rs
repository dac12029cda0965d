//! An independent oracle: our single-rank LLM computes the same logits as
//! candle-transformers' Llama (dense) and Mixtral (MoE) on the same weights, within 1e-5.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::llama::{Llama, LlamaConfig};
use hetpar_nn::testing::{last_logits, rel_err};
use hetpar_nn::{Build, HasParams, ParallelCtx};

const SEQ: usize = 12;

fn config(experts: usize) -> LlamaConfig {
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
        aux_coef: 0.0,
        cp_mode: CpMode::AllGather,
    }
}

/// Our last-position logits and the model's weights by HF name.
fn ours(cfg: LlamaConfig, tokens: &[u32]) -> (Vec<f32>, HashMap<String, Tensor>) {
    let l = ModuleLayout::new("llm", Span::new(0, 1), LayoutSpec::default()).unwrap();
    launch(1, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let model = Llama::new(&Build::new(ctx, 21, DType::F32), cfg).unwrap();
        let last = last_logits(&model, tokens).unwrap();
        let weights = model.params().iter().map(|p| (p.name.clone(), p.tensor().clone())).collect();
        (last, weights)
    })
    .unwrap()
    .pop()
    .unwrap()
}

fn tokens() -> Vec<u32> {
    (0..SEQ).map(|i| ((i * 29 + 3) % 64) as u32).collect()
}

#[test]
fn dense_llama_matches_candle_transformers() {
    use candle_transformers::models::llama::{Cache, Config, Llama as Reference};
    let cfg = config(0);
    let (mine, weights) = ours(cfg, &tokens());
    let rc = Config {
        hidden_size: cfg.hidden,
        intermediate_size: cfg.ffn,
        vocab_size: cfg.vocab,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        num_key_value_heads: cfg.kv_heads,
        use_flash_attn: false,
        rms_norm_eps: cfg.rms_eps,
        rope_theta: cfg.rope_theta as f32,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
    };
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let model = Reference::load(vb, &rc).unwrap();
    let mut cache = Cache::new(false, DType::F32, &rc, &Device::Cpu).unwrap();
    let input = Tensor::new(tokens().as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let theirs: Vec<f32> =
        model.forward(&input, 0, &mut cache).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let (a, b): (Vec<f64>, Vec<f64>) =
        (mine.iter().map(|&x| x.into()).collect(), theirs.iter().map(|&x| x.into()).collect());
    let e = rel_err(&a, &b);
    assert!(e <= 1e-5, "logits differ from candle-transformers' Llama by {e:e}");
}

#[test]
fn moe_llama_matches_candle_transformers_mixtral() {
    use candle_transformers::models::mixtral::{Config, Model};
    let cfg = config(4);
    let (mine, weights) = ours(cfg, &tokens());
    let rc: Config = serde_json::from_value(serde_json::json!({
        "vocab_size": cfg.vocab, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
        "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads, "hidden_act": "silu", "max_position_embeddings": 64,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta, "sliding_window": 64,
        "num_experts_per_tok": cfg.top_k, "num_local_experts": cfg.experts, "use_flash_attn": false
    }))
    .unwrap();
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let mut model = Model::new(&rc, vb).unwrap();
    let input = Tensor::new(tokens().as_slice(), &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let theirs: Vec<f32> =
        model.forward(&input, 0).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let (a, b): (Vec<f64>, Vec<f64>) =
        (mine.iter().map(|&x| x.into()).collect(), theirs.iter().map(|&x| x.into()).collect());
    let e = rel_err(&a, &b);
    assert!(e <= 1e-5, "logits differ from candle-transformers' Mixtral by {e:e}");
}

/// A Whisper encoder written out plainly on one rank (candle's `conv1d`, explicit
/// attention), for the audio encoder to match.
mod plain_whisper {
    use super::*;

    fn linear(x: &Tensor, w: &HashMap<String, Tensor>, name: &str) -> Tensor {
        let y = x.broadcast_matmul(&w[&format!("{name}.weight")].t().unwrap()).unwrap();
        match w.get(&format!("{name}.bias")) {
            Some(b) => y.broadcast_add(b).unwrap(),
            None => y,
        }
    }

    fn layer_norm(x: &Tensor, w: &HashMap<String, Tensor>, name: &str, eps: f64) -> Tensor {
        let mean = x.mean_keepdim(2).unwrap();
        let c = x.broadcast_sub(&mean).unwrap();
        let var = c.sqr().unwrap().mean_keepdim(2).unwrap();
        let n = c.broadcast_div(&(var + eps).unwrap().sqrt().unwrap()).unwrap();
        n.broadcast_mul(&w[&format!("{name}.weight")])
            .unwrap()
            .broadcast_add(&w[&format!("{name}.bias")])
            .unwrap()
    }

    pub fn forward(
        features: &Tensor,
        w: &HashMap<String, Tensor>,
        (layers, heads, eps): (usize, usize, f64),
    ) -> Tensor {
        let conv = |x: &Tensor, name: &str, stride: usize| {
            let b = &w[&format!("{name}.bias")];
            x.conv1d(&w[&format!("{name}.weight")], 1, stride, 1, 1)
                .unwrap()
                .broadcast_add(&b.reshape((1, b.dims()[0], 1)).unwrap())
                .unwrap()
                .gelu_erf()
                .unwrap()
        };
        let x = conv(features, "audio_tower.conv1", 1);
        let x = conv(&x, "audio_tower.conv2", 2).transpose(1, 2).unwrap();
        let (n, rows, h) = x.dims3().unwrap();
        // Whisper's positions: sin then cos of t / 10000^(i / (h/2 - 1)).
        let table: Vec<f64> = (0..rows)
            .flat_map(|t| {
                let inv = |i: usize| (-(10_000f64.ln()) * i as f64 / (h / 2 - 1) as f64).exp();
                let sin = (0..h / 2).map(move |i| (t as f64 * inv(i)).sin());
                let cos = (0..h / 2).map(move |i| (t as f64 * inv(i)).cos());
                sin.chain(cos).collect::<Vec<_>>()
            })
            .collect();
        let pos = Tensor::from_vec(table, (1, rows, h), &Device::Cpu).unwrap();
        let mut x = x.broadcast_add(&pos.to_dtype(x.dtype()).unwrap()).unwrap();
        let d = h / heads;
        let split = |t: Tensor| {
            t.reshape((n, rows, heads, d)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap()
        };
        for i in 0..layers {
            let p = format!("audio_tower.layers.{i}");
            let a = layer_norm(&x, w, &format!("{p}.self_attn_layer_norm"), eps);
            let q = split(linear(&a, w, &format!("{p}.self_attn.q_proj")));
            let k = split(linear(&a, w, &format!("{p}.self_attn.k_proj")));
            let v = split(linear(&a, w, &format!("{p}.self_attn.v_proj")));
            let scores = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
            let probs = candle_nn::ops::softmax_last_dim(&scores).unwrap();
            let o =
                probs.matmul(&v).unwrap().transpose(1, 2).unwrap().reshape((n, rows, h)).unwrap();
            x = (&x + linear(&o, w, &format!("{p}.self_attn.out_proj"))).unwrap();
            let m = layer_norm(&x, w, &format!("{p}.final_layer_norm"), eps);
            let m = linear(
                &linear(&m, w, &format!("{p}.fc1")).gelu_erf().unwrap(),
                w,
                &format!("{p}.fc2"),
            );
            x = (&x + m).unwrap();
        }
        let x = layer_norm(&x, w, "audio_tower.layer_norm", eps);
        let y = linear(&x, w, "audio_projector.linear_1").gelu_erf().unwrap();
        linear(&y, w, "audio_projector.linear_2")
    }
}

/// Answers candle-transformers' Whisper loader with our encoder's tensors (checking each
/// requested shape) and zeros for its text decoder, recording what it asked for.
struct WhisperNames {
    ours: HashMap<String, Tensor>,
    asked: std::sync::Mutex<Vec<String>>,
}

impl candle_nn::var_builder::SimpleBackend for WhisperNames {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if name.starts_with("model.decoder.") {
            return Tensor::zeros(s, dtype, dev);
        }
        let ours = name.replacen("model.encoder.", "audio_tower.", 1);
        self.asked.lock().unwrap().push(ours.clone());
        let t = self
            .ours
            .get(&ours)
            .ok_or_else(|| candle_core::Error::Msg(format!("no tensor {ours}")))?;
        if t.shape() != &s {
            candle_core::bail!("{ours}: ours is {:?}, Whisper wants {s:?}", t.shape());
        }
        t.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("unchecked read of {name}")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        name.starts_with("model.decoder.")
            || self.ours.contains_key(&name.replacen("model.encoder.", "audio_tower.", 1))
    }
}

#[test]
fn audio_encoder_matches_a_plain_whisper_encoder_with_whispers_names() {
    use hetpar_nn::models::audio::{AudioConfig, AudioEncoder};
    let cfg = AudioConfig {
        mels: 8,
        frames: 15,
        hidden: 32,
        layers: 2,
        heads: 4,
        ffn: 128,
        out_hidden: 24,
        ln_eps: 1e-5,
        cp_mode: CpMode::AllGather,
    };
    let l = ModuleLayout::new("audio", Span::new(0, 1), LayoutSpec::default()).unwrap();
    let values: Vec<f64> =
        (0..2 * 8 * 15).map(|i| ((i * 37 + 11) % 97) as f64 / 48.0 - 1.0).collect();
    let features = Tensor::from_vec(values, (2, 8, 15), &Device::Cpu).unwrap();
    let (mine, weights) = launch(1, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let ctx = ParallelCtx::new(c, &l).unwrap();
        let model = AudioEncoder::new(&Build::new(ctx, 5, DType::F64), cfg).unwrap();
        // Initial biases are zero and norms one: move every weight so each one counts.
        for p in model.params() {
            let t = p.tensor();
            let k = p.name.len();
            let shift: Vec<f64> = (0..t.elem_count())
                .map(|i| ((i * 13 + k * 7) % 17) as f64 / 170.0 - 0.05)
                .collect();
            let shift = Tensor::from_vec(shift, t.shape(), &Device::Cpu).unwrap();
            p.var.set(&(t + shift).unwrap()).unwrap();
        }
        let y = model.forward(&features).unwrap();
        let weights: HashMap<String, Tensor> =
            model.params().iter().map(|p| (p.name.clone(), p.tensor().clone())).collect();
        (y, weights)
    })
    .unwrap()
    .pop()
    .unwrap();
    assert_eq!(mine.dims(), [2, 8, 24]);
    let theirs = plain_whisper::forward(&features, &weights, (cfg.layers, cfg.heads, cfg.ln_eps));
    let (a, b) = (
        mine.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        theirs.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
    );
    let e = rel_err(&a, &b);
    assert!(e <= 1e-10, "audio encoder differs from the plain Whisper encoder by {e:e}");
    assert!(!weights.contains_key("audio_tower.layers.0.self_attn.k_proj.bias"));
    // candle-transformers' Whisper finds every encoder tensor under our names.
    use candle_transformers::models::whisper::{Config, model::Whisper};
    let wc = Config {
        num_mel_bins: cfg.mels,
        max_source_positions: cfg.rows(),
        d_model: cfg.hidden,
        encoder_attention_heads: cfg.heads,
        encoder_layers: cfg.layers,
        vocab_size: 16,
        max_target_positions: 8,
        decoder_attention_heads: cfg.heads,
        decoder_layers: 1,
        suppress_tokens: Vec::new(),
    };
    let backend = WhisperNames { ours: weights.clone(), asked: std::sync::Mutex::new(Vec::new()) };
    let names = Arc::new(backend);
    struct Shared(Arc<WhisperNames>);
    impl candle_nn::var_builder::SimpleBackend for Shared {
        fn get(
            &self,
            s: candle_core::Shape,
            name: &str,
            h: candle_nn::Init,
            dtype: DType,
            dev: &Device,
        ) -> candle_core::Result<Tensor> {
            self.0.get(s, name, h, dtype, dev)
        }
        fn get_unchecked(
            &self,
            name: &str,
            dtype: DType,
            dev: &Device,
        ) -> candle_core::Result<Tensor> {
            self.0.get_unchecked(name, dtype, dev)
        }
        fn contains_tensor(&self, name: &str) -> bool {
            self.0.contains_tensor(name)
        }
    }
    let vb = VarBuilder::from_backend(Box::new(Shared(names.clone())), DType::F32, Device::Cpu);
    Whisper::load(&vb, wc).unwrap_or_else(|e| panic!("Whisper does not load our names: {e}"));
    let mut asked = names.asked.lock().unwrap().clone();
    asked.sort();
    let mut tower: Vec<String> =
        weights.keys().filter(|n| n.starts_with("audio_tower.")).cloned().collect();
    tower.sort();
    assert_eq!(asked, tower, "Whisper's encoder tensors and ours differ");
}
