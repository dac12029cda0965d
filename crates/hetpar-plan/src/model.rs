//! Module shapes and the arithmetic of a transformer: parameter counts and training FLOPs
//! per token.
//!
//! FLOPs follow Megatron (Narayanan et al. 2021; PUBLISHED.md): forward+backward is three
//! forwards; per token and layer, attention projections `6*(h*(q + 2*kv) + q*h)`, core
//! attention `6*q*s` under a causal mask (half the score matrix counts) and `12*q*s`
//! bidirectional, MLP `6*h*ffn*3` (SwiGLU) or `6*h*ffn*2` (GELU), a MoE layer `top_k`
//! experts plus the router `6*h*E`; the LM head `6*h*V`.

use serde::{Deserialize, Serialize};

/// MLP flavour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mlp {
    /// Gated, three matrices (Llama).
    Swiglu,
    /// Two matrices (GPT, CLIP, InternViT).
    Gelu,
}

/// A transformer module as the planner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct ModuleShape {
    /// Name.
    pub name: String,
    /// Encoder (bidirectional, feeds the LLM) or the LLM (causal, has a vocabulary).
    pub encoder: bool,
    /// Width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// MLP width (per expert).
    pub ffn: usize,
    /// MLP flavour.
    pub mlp: Mlp,
    /// Vocabulary (0 for encoders).
    pub vocab: usize,
    /// Experts (0: dense).
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// For encoders: the LLM width its projector maps to.
    pub out_hidden: usize,
}

impl ModuleShape {
    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    fn mlp_mats(&self) -> f64 {
        match self.mlp {
            Mlp::Swiglu => 3.0,
            Mlp::Gelu => 2.0,
        }
    }

    /// Parameters of one layer: attention, MLP (all experts), router, two norms.
    pub fn layer_params(&self) -> f64 {
        let (h, d) = (self.hidden as f64, self.head_dim() as f64);
        let (q, kv) = (self.heads as f64 * d, self.kv_heads as f64 * d);
        let experts = self.experts.max(1) as f64;
        let router = if self.experts > 0 { h * self.experts as f64 } else { 0.0 };
        h * (q + 2.0 * kv)
            + q * h
            + experts * self.mlp_mats() * h * self.ffn as f64
            + router
            + 2.0 * h
    }

    /// Parameters of the whole module: layers, final norm, embedding and LM head (untied)
    /// for the LLM, projector for encoders.
    pub fn params(&self) -> f64 {
        let h = self.hidden as f64;
        let ends = if self.encoder {
            let o = self.out_hidden as f64;
            h * o + o * o
        } else {
            2.0 * self.vocab as f64 * h
        };
        self.layers as f64 * self.layer_params() + h + ends
    }

    /// Parameters of one layer's experts (0 for a dense layer).
    pub fn expert_layer_params(&self) -> f64 {
        self.experts as f64 * self.mlp_mats() * self.hidden as f64 * self.ffn as f64
    }

    /// Parameters active for one token (top-k experts instead of all).
    pub fn active_layer_params(&self) -> f64 {
        if self.experts == 0 {
            return self.layer_params();
        }
        let inactive = (self.experts - self.top_k) as f64 / self.experts as f64;
        self.layer_params() - inactive * self.expert_layer_params()
    }

    /// Training FLOPs per token of one layer's matmuls (projections, MLP, router).
    pub fn layer_gemm_flops(&self) -> f64 {
        let (h, d) = (self.hidden as f64, self.head_dim() as f64);
        let (q, kv) = (self.heads as f64 * d, self.kv_heads as f64 * d);
        let k = if self.experts > 0 { self.top_k as f64 } else { 1.0 };
        let router = if self.experts > 0 { 6.0 * h * self.experts as f64 } else { 0.0 };
        6.0 * (h * (q + 2.0 * kv) + q * h)
            + 6.0 * h * self.ffn as f64 * self.mlp_mats() * k
            + router
    }

    /// Training FLOPs per token of one layer's core attention over a sequence of `s`.
    pub fn layer_attention_flops(&self, s: usize) -> f64 {
        let q = (self.heads * self.head_dim()) as f64;
        let factor = if self.encoder { 12.0 } else { 6.0 };
        factor * q * s as f64
    }

    /// Training FLOPs per token of the layers beyond (LM head for the LLM, projector for
    /// encoders).
    pub fn end_flops(&self) -> f64 {
        let h = self.hidden as f64;
        if self.encoder {
            let o = self.out_hidden as f64;
            6.0 * (h * o + o * o)
        } else {
            6.0 * h * self.vocab as f64
        }
    }

    /// Activation bytes per token of one layer kept for the backward pass in 16-bit
    /// training with flash attention (Korthikanti et al. 2022, generalised to GQA and the
    /// MLP flavour): attention `2h` (input) `+ 2(q+2kv)` (Q, K, V) `+ 2q` (output, kept by
    /// flash attention) `+ h` (dropout mask), MLP `3h + 4ffn` (GELU: input, fc1 output,
    /// activation output, mask) or `3h + 6ffn` (SwiGLU: gate, up, product), two norms `4h`.
    /// For `q = kv = h` and `ffn = 4h` this is Korthikanti's `34h` without the `5as/h`
    /// score term that flash attention removes. A MoE layer keeps `top_k` expert MLPs.
    /// With sequence parallelism all of it divides by `tp`.
    pub fn layer_activation_bytes(&self) -> f64 {
        let (wide, sharded) = self.layer_activation_split();
        wide + sharded
    }

    /// [`Self::layer_activation_bytes`] in two parts: the `h`-wide tensors (the inputs of
    /// both norms and both column-parallel blocks, the two dropout masks: Korthikanti's
    /// `10h`), which tensor parallelism without sequence parallelism keeps whole on every
    /// rank, and the rest, which it splits over `tp`.
    pub fn layer_activation_split(&self) -> (f64, f64) {
        let (h, d) = (self.hidden as f64, self.head_dim() as f64);
        let (q, kv) = (self.heads as f64 * d, self.kv_heads as f64 * d);
        let f = self.ffn as f64;
        let attention = 2.0 * h + 2.0 * (q + 2.0 * kv) + 2.0 * q + h;
        let per_mlp = match self.mlp {
            Mlp::Gelu => 4.0 * f,
            Mlp::Swiglu => 6.0 * f,
        };
        let k = if self.experts > 0 { self.top_k as f64 } else { 1.0 };
        let all = attention + 3.0 * h + k * per_mlp + 4.0 * h;
        let wide = 10.0 * h;
        (wide, all - wide)
    }

    /// Training FLOPs per token of the whole module over sequences of `s`.
    pub fn flops_per_token(&self, s: usize) -> f64 {
        self.layers as f64 * (self.layer_gemm_flops() + self.layer_attention_flops(s))
            + self.end_flops()
    }
}
