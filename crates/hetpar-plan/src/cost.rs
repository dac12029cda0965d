//! Time of one module's work on one rank: forward and backward of each virtual stage for one
//! microbatch, the pipeline messages, the exposed gradient reduction and the optimizer step.
//!
//! Per layer and microbatch a rank with `t` local tokens (its replica's tokens over `cp`)
//! spends
//! - GEMMs: `t * gemm_flops / 3 / tp` at `peak * gemm * w / (w + w0)` with `w = hidden / tp`
//!   (narrow shards run below peak);
//! - attention core: `t * attention_flops / 3 / tp` at `peak * attention`; under context
//!   parallelism (ring attention, Transformer Engine's p2p CP as Megatron runs it) at that
//!   rate over `cp_attention * (1 + cp_step * (cp - 2))`. The two factors are a fit, not a
//!   derivation: they carry what the published long-context rows (the only
//!   context-parallel measurements of that stack we have) lose against everything else the
//!   model derives. They are not ring attention's own cost: measured on a Hopper GPU
//!   (`scripts/hopper/ring.py`, BENCHMARKS.md), one rank's partial kernels and
//!   online-softmax merges run at 0.81-0.94 of one whole kernel's rate, where the factors
//!   divide it by 5 (cp 2) to 10.7 (cp 8). What they stand for is not known; the key/value
//!   exchange is the separate term below;
//! - element-wise work: `t * elementwise_bytes * hidden` bytes of HBM traffic, split over
//!   `tp` by sequence parallelism (without it, Korthikanti's `h`-wide part stays whole);
//! - tensor parallelism: two all-gathers and two reduce-scatters (or two all-reduces) of
//!   the `t x hidden` activation per layer, hidden behind up to `tp_overlap` of the layer's
//!   GEMM time under sequence parallelism and not at all without;
//! - context parallelism: `cp - 1` ring steps, each sending the local key/value chunk (and
//!   in the backward also its gradient) to the next CP rank at the slowest hop's speed (the
//!   network when the `tp * cp` ranks span more than a node), hidden behind `cp_overlap` of
//!   that step's attention;
//! - expert parallelism: dispatch and combine all-to-alls of `t * top_k` rows.
//!
//! An encoder in a homogeneous layout runs Megatron's vision model: the LLM's tp without
//! sequence parallelism or communication overlap (`Run::sp`), its work repeated on every CP
//! rank. Data-parallel reduction streams with the last microbatch's backward and the
//! parameter gather with the first forward ([`Run::reduce`]).
//!
//! The backward pass takes twice the forward GEMM, element-wise and communication time and
//! 2.5 times the attention time (flash attention's backward); recomputing a share of the
//! layers adds that share of a forward. The last LLM stage adds the LM head and the
//! cross-entropy over the vocabulary, an encoder's last stage its projector.

use crate::hardware::Hardware;
use crate::model::ModuleShape;

/// Bytes of an activation element (bf16).
pub const ACT_BYTES: f64 = 2.0;
/// Bytes per parameter of the distributed optimizer's gradient reduce-scatter (fp32).
pub const GRAD_BYTES: f64 = 4.0;
/// Bytes per parameter of its parameter all-gather (bf16).
pub const PARAM_BYTES: f64 = 2.0;
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
    /// Sequence parallelism inside tp: element-wise work and activations split over `tp`,
    /// tensor-parallel communication overlapped with GEMMs. False for an encoder in a
    /// homogeneous layout, which runs Megatron's vision model: tensor parallel without
    /// sequence parallelism or communication overlap (Megatron-LM
    /// `examples/multimodal/model.py`: "Vision model and projection do not use SP/CP").
    pub sp: bool,
}

/// One layer's time on one rank for one microbatch by term, seconds. Communication terms
/// are what stays exposed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerParts {
    /// Forward GEMMs (the backward runs twice their FLOPs at the same rate).
    pub gemm: f64,
    /// Forward attention core.
    pub attn_fwd: f64,
    /// Backward attention core.
    pub attn_bwd: f64,
    /// Forward element-wise work.
    pub elem: f64,
    /// Forward tensor-parallel communication not hidden behind GEMMs.
    pub tp_comm: f64,
    /// Forward context-parallel key/value exchange not hidden behind attention.
    pub cp_fwd: f64,
    /// Backward context-parallel exchange (key/value and their gradients).
    pub cp_bwd: f64,
    /// Forward expert dispatch and combine.
    pub ep_comm: f64,
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

    /// Of `bytes` per token split into `h`-wide tensors and tp-sharded ones as a layer's
    /// activations are, the part one rank holds: all of it over `tp` under sequence
    /// parallelism, else the wide part whole.
    pub fn per_rank(&self, bytes: f64) -> f64 {
        let tp = self.tp as f64;
        if self.sp {
            return bytes / tp;
        }
        let (wide, sharded) = self.shape.layer_activation_split();
        bytes * (wide + sharded / tp) / (wide + sharded)
    }

    /// Ranks of one pipeline stage of one replica (the TP x CP block).
    fn block(&self) -> usize {
        self.tp * self.cp
    }

    fn gemm_rate(&self, hw: &Hardware, width: f64) -> f64 {
        let e = &hw.efficiency;
        hw.peak() * e.gemm * width / (width + e.gemm_half_width)
    }

    /// One layer's time for one microbatch on one rank, term by term.
    pub fn layer_parts(&self, hw: &Hardware) -> LayerParts {
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
        let ring = self.cp > 1 && self.cp_split;
        let slow =
            if ring { e.cp_attention * (1.0 + e.cp_step * (self.cp - 2) as f64) } else { 1.0 };
        let attn_rate = hw.peak() * e.attention / slow;
        let attn_fwd = t * s.layer_attention_flops(self.seq) / 3.0 / tp / attn_rate;
        let attn_bwd = ATTENTION_BWD * attn_fwd;
        let elem = t * self.per_rank(e.elementwise_bytes * h) / (hw.hbm_gbps * 1e9);
        let act = t * h * ACT_BYTES;
        let overlap = if self.sp { e.tp_overlap } else { 0.0 };
        let tp_comm = (4.0 * hw.ring_time(act, self.tp, self.tp) - overlap * gemm).max(0.0);
        // Context parallelism (ring attention, as Transformer Engine's p2p CP): cp - 1 steps,
        // each sending this rank's key/value chunk to the next CP rank (forward) or the
        // chunk and its gradient (backward) while computing the attention of the chunk it
        // holds. A step's transfer hides behind that step's attention only. CP peers are
        // `tp` ranks apart, so a group of `tp * cp` ranks wider than a node crosses the
        // network on some hop, and the ring moves at that hop's point-to-point speed.
        let (cp_fwd, cp_bwd) = if ring {
            let kv = (s.kv_heads * (s.hidden / s.heads)) as f64;
            let chunk = t * 2.0 * kv * ACT_BYTES / tp;
            let bw = hw.group_bandwidth(self.tp * self.cp);
            let hop = |bytes: f64| bytes / bw + hw.latency_us * 1e-6;
            let steps = (self.cp - 1) as f64;
            let per = self.cp as f64;
            let hidden = e.cp_overlap;
            (
                steps * (hop(chunk) - hidden * attn_fwd / per).max(0.0),
                steps * (hop(2.0 * chunk) - hidden * attn_bwd / per).max(0.0),
            )
        } else {
            (0.0, 0.0)
        };
        let ep_comm = if s.experts > 0 && self.ep > 1 {
            let rows = t / tp * s.top_k as f64 * h * ACT_BYTES;
            let span = self.ep * self.tp;
            2.0 * hw.ring_time(rows, self.ep, span) / e.all_to_all
        } else {
            0.0
        };
        LayerParts { gemm, attn_fwd, attn_bwd, elem, tp_comm, cp_fwd, cp_bwd, ep_comm }
    }

    /// One layer's forward and backward for one microbatch.
    pub fn layer(&self, hw: &Hardware) -> PassTime {
        let p = self.layer_parts(hw);
        // Backward: twice the forward's GEMMs, element-wise work and TP/EP communication.
        let twice = p.gemm + p.elem + p.tp_comm + p.ep_comm;
        let fwd = twice + p.attn_fwd + p.cp_fwd;
        let bwd = 2.0 * twice + p.attn_bwd + p.cp_bwd + self.recompute * fwd;
        let comm = 3.0 * (p.tp_comm + p.ep_comm) + p.cp_fwd + p.cp_bwd;
        PassTime { fwd, bwd, comm: comm + self.recompute * (p.tp_comm + p.ep_comm + p.cp_fwd) }
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

    /// Layers of virtual stage `v` (of `pp * vpp`).
    pub fn vstage_layers(&self, v: usize) -> usize {
        stage_layers(self.shape.layers, self.pp * self.vpp, v)
    }

    /// Forward and backward of virtual stage `v` (of `pp * vpp`) for one microbatch.
    pub fn vstage(&self, hw: &Hardware, v: usize) -> PassTime {
        let n = self.pp * self.vpp;
        let layers = self.vstage_layers(v) as f64;
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
        let layers: f64 =
            (0..self.vpp).map(|c| self.vstage_layers(c * self.pp + stage) as f64).sum();
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
    /// optimizer over `dp * cp`; experts over their own data-parallel group). Gradients are
    /// accumulated over the step's microbatches and reduced as the last microbatch's
    /// backward produces them, parameters gathered as the first forward needs them
    /// (Megatron's `overlap_grad_reduce` and `overlap_param_gather`): the fp32
    /// reduce-scatter hides behind up to `dp_overlap` of one backward of the stage, the
    /// bf16 all-gather behind one forward, and the rest is exposed. Few microbatches per
    /// step (long context) expose more of it than many. `vstages` are this run's virtual
    /// stage times ([`Self::vstage`] for every `v`), computed once by the caller.
    pub fn reduce(&self, hw: &Hardware, stage: usize, vstages: &[PassTime]) -> f64 {
        let (params, experts) = self.stage_params(stage);
        let d = self.dp * self.cp;
        let span = d * self.block();
        let edp = (d * self.tp / self.ep).max(1);
        let gather = |bytes_per_param: f64| {
            hw.ring_time((params - experts) * bytes_per_param, d, span)
                + hw.ring_time(experts * bytes_per_param, edp, span)
        };
        let (rs, ag) = (gather(GRAD_BYTES), gather(PARAM_BYTES));
        let pass = (0..self.vpp)
            .map(|c| vstages[c * self.pp + stage])
            .fold(PassTime::default(), |a, b| a + b);
        let overlap = hw.efficiency.dp_overlap;
        (rs - overlap * pass.bwd).max(0.0) + (ag - overlap * pass.fwd).max(0.0)
    }

    /// Optimizer step of stage `stage`: read and write of the shard's fp32 master weights,
    /// two moments and gradient, and the bf16 weights.
    pub fn step(&self, hw: &Hardware, stage: usize) -> f64 {
        let (params, _) = self.stage_params(stage);
        let shard = params / (self.dp * self.cp) as f64;
        shard * 18.0 * 2.0 / (hw.hbm_gbps * 1e9)
    }
}
