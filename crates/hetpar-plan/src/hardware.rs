//! Accelerators as data (`hardware.toml`): peak rate, memory, HBM bandwidth and the two
//! network tiers (inside a node, across nodes). `hetpar calibrate` writes the same format
//! for the machine it runs on.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{PlanError, Result};

/// One accelerator and its network.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// What it is.
    pub description: String,
    /// Dense peak of the training dtype, TFLOP/s.
    pub peak_tflops: f64,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Memory bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Devices per node.
    pub gpus_per_node: usize,
    /// Collective bus bandwidth inside a node, GB/s per device.
    pub intra_node_gbps: f64,
    /// Collective bus bandwidth across nodes, GB/s per device.
    pub inter_node_gbps: f64,
    /// Fixed cost per collective step, microseconds.
    pub latency_us: f64,
    /// Host <-> device bandwidth (offload), GB/s.
    #[serde(default = "default_host")]
    pub host_gbps: f64,
    /// Efficiency factors of the cost model.
    #[serde(default)]
    pub efficiency: Efficiency,
}

fn default_host() -> f64 {
    50.0
}

/// The few factors the cost model cannot derive from a datasheet. The defaults are fitted
/// to the H100 measurements in PUBLISHED.md (the LLM-only Megatron-Core table, the
/// multimodal 8K table) and the three long-context rows of the same heterogeneous-parallelism
/// sweep (`validation::MULTIMODAL`); `hetpar calibrate` measures its own for the machine it
/// runs on.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Efficiency {
    /// Fraction of peak a large GEMM reaches. Fitted: a Hopper GPU measures 0.67-0.74 for
    /// the LLMs' wide layer GEMMs (`scripts/hopper/gemm.py`, BENCHMARKS.md).
    pub gemm: f64,
    /// Per-GPU GEMM width (hidden / tp) at which GEMMs run at half of `gemm`: the rate is
    /// `gemm * w / (w + gemm_half_width)`.
    pub gemm_half_width: f64,
    /// Fraction of peak the attention core (flash attention) reaches in the forward pass;
    /// its backward takes 2.5 times the forward time. Fitted: above what cuDNN's fused
    /// attention measures on a Hopper GPU at head dim 128 (0.49-0.66 of peak forward,
    /// backward 2.7-3.0x).
    pub attention: f64,
    /// Slowdown of the attention core under context parallelism at `cp = 2`, fitted to the
    /// published long-context rows: what they lose against the rest of the model, charged
    /// to CP attention. Not ring attention's kernels and merges, which a Hopper GPU runs at
    /// 0.81-0.94 of one kernel's rate (`scripts/hopper/ring.py`); the key/value
    /// exchange is costed apart (`cp_overlap`). Nor context parallelism's cost in general:
    /// they put Meta's Llama 3 405B at 131K with CP 16 (`validation::LLAMA3`) at a sixth of
    /// its published rate, which the measured ring cost (1.2, `cp_step` 0, the exchange
    /// exposed: `examples/hardware/h100-ring-cp.toml`) predicts.
    pub cp_attention: f64,
    /// Further slowdown per ring step beyond two: the attention runs at
    /// `attention / (cp_attention * (1 + cp_step * (cp - 2)))` of peak.
    pub cp_step: f64,
    /// Share of a ring step's attention that hides the step's key/value transfer.
    pub cp_overlap: f64,
    /// Bytes of HBM traffic per token and hidden unit that a layer's element-wise work
    /// (norms, residuals, activations, rotary, dropout) moves in the forward pass. Fitted:
    /// a Hopper GPU runs an LLM layer's element-wise work (no dropout) in the time of 47-58
    /// such bytes when fused and 264-312 op by op (`scripts/hopper/elementwise.py`,
    /// BENCHMARKS.md), so the fitted value carries more than that work.
    pub elementwise_bytes: f64,
    /// Fraction of a layer's GEMM time that can hide its tensor-parallel communication
    /// (overlapped chunks); communication beyond it is exposed. Wide layers hide nearly all
    /// of it, narrow ones (a small encoder split over many ranks) little.
    pub tp_overlap: f64,
    /// Share of one microbatch's backward (forward) that the data-parallel gradient
    /// reduce-scatter (parameter all-gather) can hide behind: 1 when the reduction streams
    /// with the last backward (Megatron's overlap options), 0 when it runs after it.
    pub dp_overlap: f64,
    /// Fraction of the bus bandwidth an all-to-all (expert dispatch) reaches.
    pub all_to_all: f64,
    /// Memory per GPU no model state accounts for (runtime context, communication buffers,
    /// allocator fragmentation), GiB.
    pub overhead_gib: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        // Fitted by `examples/fit_published.rs -- --restarts 3` to the LLM-only table, the 8K
        // multimodal table and the three long-context rows (`validation::MULTIMODAL`).
        Efficiency {
            gemm: 0.847,
            gemm_half_width: 103.0,
            attention: 0.80,
            cp_attention: 5.0,
            cp_step: 0.19,
            cp_overlap: 1.0,
            elementwise_bytes: 197.0,
            tp_overlap: 0.136,
            dp_overlap: 1.0,
            all_to_all: 0.6,
            overhead_gib: 7.7,
        }
    }
}

/// Bytes in a GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

const BUILTIN: &str = include_str!("hardware.toml");

/// Every accelerator in `text` (a TOML table per name). Errors name the line and table,
/// or the accelerator and the field whose value no cost can divide by.
pub fn parse(text: &str) -> Result<BTreeMap<String, Hardware>> {
    let table: BTreeMap<String, Hardware> = hetpar_layout::config::parse_toml(text).map_err(|e| {
        let renamed = if e.message.contains("`dp_exposed`") {
            " (`dp_exposed` became `dp_overlap`, its complement: dp_overlap = 1 - dp_exposed; rerun `hetpar calibrate` or edit the file)"
        } else {
            ""
        };
        PlanError(format!("hardware table, {}: {}{renamed}", e.field, e.message))
    })?;
    for (name, h) in &table {
        let rates = [
            ("peak_tflops", h.peak_tflops),
            ("memory_gib", h.memory_gib),
            ("hbm_gbps", h.hbm_gbps),
            ("intra_node_gbps", h.intra_node_gbps),
            ("inter_node_gbps", h.inter_node_gbps),
            ("host_gbps", h.host_gbps),
        ];
        if let Some((field, v)) = rates.iter().find(|(_, v)| !(v.is_finite() && *v > 0.0)) {
            return Err(PlanError(format!("hardware {name}: {field} must be positive, got {v}")));
        }
        if h.gpus_per_node == 0 || !(h.latency_us.is_finite() && h.latency_us >= 0.0) {
            return Err(PlanError(format!(
                "hardware {name}: gpus_per_node must be at least 1 and latency_us 0 or more, got {} and {}",
                h.gpus_per_node, h.latency_us
            )));
        }
        h.efficiency.check().map_err(|e| PlanError(format!("hardware {name}: efficiency.{e}")))?;
    }
    Ok(table)
}

impl Efficiency {
    /// Each factor in the range its meaning allows, else `field ..., got v`: a rate above
    /// peak (a fraction above 1, a slowdown below 1), a negative time or a share above the
    /// whole would predict the impossible (thousands of TFLOPS a GPU), and a zero one
    /// divide by zero.
    fn check(&self) -> std::result::Result<(), String> {
        let e = self;
        let fractions = [
            ("gemm", e.gemm, "peak"),
            ("attention", e.attention, "peak"),
            ("all_to_all", e.all_to_all, "the bus bandwidth"),
        ];
        if let Some((f, v, of)) = fractions.iter().find(|(_, v, _)| !(*v > 0.0 && *v <= 1.0)) {
            return Err(format!("{f} is a fraction of {of}: more than 0 and at most 1, got {v}"));
        }
        if !(e.cp_attention.is_finite() && e.cp_attention >= 1.0) {
            return Err(format!(
                "cp_attention is a slowdown of the attention (its rate divided by it): 1 or more, got {}",
                e.cp_attention
            ));
        }
        let shares = [
            ("cp_overlap", e.cp_overlap),
            ("tp_overlap", e.tp_overlap),
            ("dp_overlap", e.dp_overlap),
        ];
        if let Some((f, v)) = shares.iter().find(|(_, v)| !(*v >= 0.0 && *v <= 1.0)) {
            return Err(format!("{f} is a share: from 0 to 1, got {v}"));
        }
        let amounts = [
            ("gemm_half_width", e.gemm_half_width),
            ("cp_step", e.cp_step),
            ("elementwise_bytes", e.elementwise_bytes),
            ("overhead_gib", e.overhead_gib),
        ];
        if let Some((f, v)) = amounts.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(format!("{f} must be a finite number, 0 or more, got {v}"));
        }
        Ok(())
    }
}

/// A built-in accelerator by name (`h100`, `h200`, `a100`).
pub fn builtin(name: &str) -> Result<Hardware> {
    let table = parse(BUILTIN).expect("the built-in hardware table parses");
    let names: Vec<&str> = table.keys().map(String::as_str).collect();
    table.get(name).cloned().ok_or_else(|| {
        PlanError(format!(
            "unknown hardware {name:?}: built in are {}, `local` after `hetpar calibrate`, or a .toml file with one hardware table",
            names.join(", ")
        ))
    })
}

impl Hardware {
    /// Bus bandwidth (bytes/s) of a group that spans `span` consecutive ranks: inside a node
    /// if the span fits one, across nodes otherwise.
    pub fn group_bandwidth(&self, span: usize) -> f64 {
        if span <= self.gpus_per_node {
            self.intra_node_gbps * 1e9
        } else {
            self.inter_node_gbps * 1e9
        }
    }

    /// Time of a ring collective (all-gather, reduce-scatter; an all-reduce is both) moving
    /// `bytes` (the full tensor) over `n` members spanning `span` ranks, nccl-tests' bus
    /// bandwidth convention.
    pub fn ring_time(&self, bytes: f64, n: usize, span: usize) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n_f = n as f64;
        bytes * (n_f - 1.0) / n_f / self.group_bandwidth(span)
            + (n_f - 1.0) * self.latency_us * 1e-6
    }

    /// Time of a point-to-point transfer of `bytes` between ranks `distance` apart.
    pub fn p2p_time(&self, bytes: f64, distance: usize) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        let same_node = distance < self.gpus_per_node;
        bytes / self.group_bandwidth(if same_node { 1 } else { usize::MAX })
            + self.latency_us * 1e-6
    }

    /// Peak rate in FLOP/s.
    pub fn peak(&self) -> f64 {
        self.peak_tflops * 1e12
    }

    /// Memory in bytes.
    pub fn memory_bytes(&self) -> f64 {
        self.memory_gib * GIB
    }
}
