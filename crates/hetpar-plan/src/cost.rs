//! Time of one module's work on one rank: forward and backward of each virtual stage for one
//! microbatch, the pipeline messages, the exposed gradient reduction and the optimizer step.
//!
//! Per layer and microbatch a rank with `t` local tokens (its replica's tokens over `cp`)
//! spends
//! - GEMMs: `t * gemm_flops / 3 / tp` at `peak * gemm * w / (w + w0)` with `w = hidden / tp`
//!   (narrow shards run below peak);
//! - attention core: `t * attention_flops / 3 / tp` at `peak * attention`;
//! - element-wise work: `t / tp * elementwise_bytes * hidden` bytes of HBM traffic
//!   (sequence parallelism shards it over `tp`);
//! - tensor parallelism (SP): two all-gathers and two reduce-scatters of the `t x hidden`
//!   activation per layer, hidden behind up to `tp_overlap` of the layer's GEMM time;
//! - context parallelism (ring): `cp - 1` key/value chunk exchanges, hidden behind the
//!   attention core as far as it lasts;
//! - expert parallelism: dispatch and combine all-to-alls of `t * top_k` rows.
//!
//! The backward pass takes twice the forward GEMM, element-wise and communication time and
//! 2.5 times the attention time (flash attention's backward); recomputing a share of the
//! layers adds that share of a forward. The last LLM stage adds the LM head and the cross-entropy over the vocabulary,
//! an encoder's last stage its projector.

use crate::hardware::Hardware;
use crate::model::ModuleShape;

/// Bytes of an activation element (bf16).
pub const ACT_BYTES: f64 = 2.0;
/// Bytes per parameter moved by the gradient reduce-scatter (fp32) and the parameter
/// all-gather (bf16) of the distributed optimizer.
pub const DP_BYTES_PER_PARAM: f64 = 6.0;
/// Backward over forward time of the attention core.
pub const ATTENTION_BWD: f64 = 2.5;

/// How a module runs in a candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Run<'a> {
    /// Shape.
    pub shape: &'a ModuleShape,
    /// Tensor parallel (sequence parallel when > 1).
    pub tp: usize,
    /// Context parallel.
    pub cp: usize,
    /// Data parallel.
    pub dp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Virtual stages per rank.
    pub vpp: usize,
    /// Expert parallel.
    pub ep: usize,
    /// Share of the layers whose activations are recomputed in the backward (0 to 1).
    pub recompute: f64,
    /// Tokens a replica processes per microbatch (before the `cp` split).
    pub tokens: f64,
    /// Attention span (the LLM sequence, or the encoder's per-item sequence).
    pub seq: usize,
    /// Encoders: LLM rows a replica produces per microbatch (projector work).
    pub rows: f64,
    /// Whether `cp` splits the tokens (false: an encoder in a homogeneous layout, whose work
    /// every CP rank repeats).
    pub cp_split: bool,
}

/// Time of one virtual stage's passes for one microbatch, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassTime {
    /// Forward.
    pub fwd: f64,
    /// Backward (recomputation included).
    pub bwd: f64,
    /// Of both, the exposed communication (tensor, context, expert parallel).
    pub comm: f64,
}

impl std::ops::Add for PassTime {
    type Output = PassTime;
    fn add(self, o: PassTime) -> PassTime {
        PassTime { fwd: self.fwd + o.fwd, bwd: self.bwd + o.bwd, comm: self.comm + o.comm }
    }
}

/// Layers of virtual stage `v` of `n` when `layers` split as evenly as possible (earlier
/// stages take the remainder).
pub fn stage_layers(layers: usize, n: usize, v: usize) -> usize {
    layers / n + usize::from(v < layers % n)
}

impl Run<'_> {
    /// Local tokens per microbatch on one rank.
    pub fn local_tokens(&self) -> f64 {
        if self.cp_split { self.tokens / self.cp as f64 } else { self.tokens }
    }

    /// Ranks of one pipeline stage of one replica (the TP x CP block).
    fn block(&self) -> usize {
        self.tp * self.cp
    }

    fn gemm_rate(&self, hw: &Hardware, width: f64) -> f64 {
        let e = &hw.efficiency;
        hw.peak() * e.gemm * width / (width + e.gemm_half_width)
    }

    /// One layer's forward and backward for one microbatch.
    pub fn layer(&self, hw: &Hardware) -> PassTime {
        let s = self.shape;
        let e = &hw.efficiency;
        let t = self.local_tokens();
        let tp = self.tp as f64;
        let h = s.hidden as f64;
        let mut gemm_rate = self.gemm_rate(hw, h / tp);
        if s.experts > 0 {
            // Expert GEMMs see only the tokens routed to each expert.
            let per_expert = t * s.top_k as f64 * self.ep as f64 / s.experts as f64;
            gemm_rate *= per_expert / (per_expert + 256.0);
        }
        let gemm = t * s.layer_gemm_flops() / 3.0 / tp / gemm_rate;
        let attn = t * s.layer_attention_flops(self.seq) / 3.0 / tp / (hw.peak() * e.attention);
        let elem = t / tp * e.elementwise_bytes * h / (hw.hbm_gbps * 1e9);
        let act = t * h * ACT_BYTES;
        let tp_comm = (4.0 * hw.ring_time(act, self.tp, self.tp) - e.tp_overlap * gemm).max(0.0);
        let cp_comm = if self.cp > 1 && self.cp_split {
            let kv = (s.kv_heads * (s.hidden / s.heads)) as f64;
            let chunk = t * 2.0 * kv * ACT_BYTES / tp;
            let ring = (self.cp - 1) as f64 * hw.p2p_time(chunk, self.tp);
            (ring - attn).max(0.0)
        } else {
            0.0
        };
        let ep_comm = if s.experts > 0 && self.ep > 1 {
            let rows = t / tp * s.top_k as f64 * h * ACT_BYTES;
            let span = self.ep * self.tp;
            2.0 * hw.ring_time(rows, self.ep, span) / e.all_to_all
        } else {
            0.0
        };
        let comm = tp_comm + cp_comm + ep_comm;
        let fwd = gemm + attn + elem + comm;
        let bwd = 2.0 * (gemm + elem + comm) + ATTENTION_BWD * attn + self.recompute * fwd;
        PassTime { fwd, bwd, comm: 3.0 * comm }
    }

    /// The work after the last layer: LM head and cross-entropy (LLM), projector (encoder).
    pub fn end(&self, hw: &Hardware) -> PassTime {
        let s = self.shape;
        let tp = self.tp as f64;
        let width = s.hidden as f64 / tp;
        let (fwd, bwd) = if s.encoder {
            let gemm = self.rows * s.end_flops() / 3.0 / tp / self.gemm_rate(hw, width);
            (gemm, 2.0 * gemm)
        } else {
            let t = self.local_tokens();
            let gemm = t * s.end_flops() / 3.0 / tp / self.gemm_rate(hw, width);
            // fp32 logits written, read for the softmax and again for the gradient.
            let ce = t * s.vocab as f64 / tp * 4.0 * 3.0 / (hw.hbm_gbps * 1e9);
            (gemm + ce, 2.0 * gemm + ce)
        };
        PassTime { fwd, bwd, comm: 0.0 }
    }

    /// Forward and backward of virtual stage `v` (of `pp * vpp`) for one microbatch.
    pub fn vstage(&self, hw: &Hardware, v: usize) -> PassTime {
        let n = self.pp * self.vpp;
        let layers = stage_layers(self.shape.layers, n, v) as f64;
        let l = self.layer(hw);
        let mut t = PassTime { fwd: layers * l.fwd, bwd: layers * l.bwd, comm: layers * l.comm };
        if v + 1 == n {
            t = t + self.end(hw);
        }
        t
    }

    /// One pipeline message (activation or gradient of one microbatch between stages).
    pub fn p2p(&self, hw: &Hardware) -> f64 {
        if self.pp <= 1 {
            return 0.0;
        }
        let bytes = self.local_tokens() / self.tp as f64 * self.shape.hidden as f64 * ACT_BYTES;
        hw.p2p_time(bytes, self.block() * self.dp)
    }

    /// Parameters a rank of pipeline stage `stage` holds (dense part over tp, experts over
    /// ep), and of them the expert parameters.
    pub fn stage_params(&self, stage: usize) -> (f64, f64) {
        let s = self.shape;
        let h = s.hidden as f64;
        let layers: f64 = (0..self.vpp)
            .map(|c| stage_layers(s.layers, self.pp * self.vpp, c * self.pp + stage) as f64)
            .sum();
        let expert_per_layer = s.expert_layer_params();
        let dense_per_layer = s.layer_params() - expert_per_layer;
        let mut dense = layers * dense_per_layer;
        let last = stage + 1 == self.pp;
        if s.encoder {
            if last {
                let o = s.out_hidden as f64;
                dense += h * o + o * o;
            }
        } else {
            if stage == 0 {
                dense += s.vocab as f64 * h;
            }
            if last {
                dense += s.vocab as f64 * h + h;
            }
        }
        // Experts are not tensor-parallel (etp = 1): each rank holds experts / ep whole.
        let experts = layers * expert_per_layer / self.ep as f64;
        (dense / self.tp as f64 + experts, experts)
    }

    /// Exposed gradient reduction and parameter gathering of stage `stage` (distributed
    /// optimizer over `dp * cp`; experts over their own data-parallel group).
    pub fn reduce(&self, hw: &Hardware, stage: usize) -> f64 {
        let (params, experts) = self.stage_params(stage);
        let d = self.dp * self.cp;
        let span = d * self.block();
        let dense_t = hw.ring_time((params - experts) * DP_BYTES_PER_PARAM, d, span);
        let edp = (d * self.tp / self.ep).max(1);
        let expert_t = hw.ring_time(experts * DP_BYTES_PER_PARAM, edp, span);
        (dense_t + expert_t) * hw.efficiency.dp_exposed
    }

    /// Optimizer step of stage `stage`: read and write of the shard's fp32 master weights,
    /// two moments and gradient, and the bf16 weights.
    pub fn step(&self, hw: &Hardware, stage: usize) -> f64 {
        let (params, _) = self.stage_params(stage);
        let shard = params / (self.dp * self.cp) as f64;
        shard * 18.0 * 2.0 / (hw.hbm_gbps * 1e9)
    }
}
