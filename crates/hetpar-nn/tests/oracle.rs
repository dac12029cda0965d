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
use hetpar_nn::layers::attention::{CpMode, CpPositions};
use hetpar_nn::models::llama::{Llama, LlamaBatch, LlamaConfig};
use hetpar_nn::testing::rel_err;
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
        let model = Llama::new(&Build { ctx, seed: 21, dtype: DType::F32 }, cfg).unwrap();
        let batch = LlamaBatch {
            tokens: tokens.to_vec(),
            batch: 1,
            positions: CpPositions::single(tokens.len()),
            boundary: None,
            targets: Arc::new(vec![-1; tokens.len()]),
        };
        let (x, _) = model.layers(&model.embed(&batch).unwrap(), &batch.positions).unwrap();
        let logits = model.logits(&x).unwrap();
        let last: Vec<f32> = logits
            .narrow(0, tokens.len() - 1, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
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
