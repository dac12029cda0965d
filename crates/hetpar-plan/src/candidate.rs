//! A candidate: one layout and placement per module plus the microbatch count, and what the
//! cost model and the simulator predict for it.

use serde::Serialize;

use crate::workload::Workload;

/// Placement family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Every module uses the LLM's tp and cp, encoders run on the LLM's first pipeline stage
    /// and repeat their work on every CP rank (the baseline without heterogeneity).
    Homogeneous,
    /// Encoders have their own layout on the LLM's ranks (three-phase schedule).
    Colocated,
    /// Every module on its own rank island (graph-aware 1F1B).
    NonColocated,
}

impl Kind {
    /// `homogeneous`, `colocated`, `non_colocated` (the JSON spelling).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Homogeneous => "homogeneous",
            Kind::Colocated => "colocated",
            Kind::NonColocated => "non_colocated",
        }
    }

    /// All three.
    pub const ALL: [Kind; 3] = [Kind::Homogeneous, Kind::Colocated, Kind::NonColocated];
}

/// One module's layout and placement in a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Choice {
    /// First rank.
    pub start: usize,
    /// One past the last rank.
    pub end: usize,
    /// Tensor parallel (with sequence parallelism when > 1).
    pub tp: usize,
    /// Context parallel.
    pub cp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Virtual stages per rank.
    pub vpp: usize,
    /// Expert parallel.
    pub ep: usize,
    /// Quarters of each stage's layers whose activations are recomputed in the backward
    /// (0: none, 4: all, keeping only each layer's input). A colocated encoder at 4 drops
    /// its activations after phase 1 and recomputes them in phase 3.
    pub recompute: u8,
    /// Colocated encoders: parameters and optimizer state in host memory during phase 2.
    pub offload: bool,
}

impl Choice {
    /// Ranks.
    pub fn ranks(&self) -> usize {
        self.end - self.start
    }

    /// Data-parallel replicas.
    pub fn dp(&self) -> usize {
        self.ranks() / (self.tp * self.cp * self.pp)
    }

    /// Samples per replica per microbatch of an LLM laid out so, with `microbatches` a step.
    pub fn samples(&self, wl: &Workload, microbatches: usize) -> f64 {
        wl.global_batch as f64 / (microbatches * self.dp()) as f64
    }

    /// `tp/cp/dp/pp` with ep, vpp, recompute and offload when set.
    pub fn describe(&self) -> String {
        let mut s = format!("tp{} cp{} dp{} pp{}", self.tp, self.cp, self.dp(), self.pp);
        if self.vpp > 1 {
            s += &format!(" vpp{}", self.vpp);
        }
        if self.ep > 1 {
            s += &format!(" ep{}", self.ep);
        }
        match self.recompute {
            0 => {}
            4 => s += " recompute",
            q => s += &format!(" recompute {q}/4"),
        }
        if self.offload {
            s += " offload";
        }
        s
    }
}

/// Layouts of every module and the microbatch count.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Candidate {
    /// Placement family.
    pub kind: Kind,
    /// The LLM.
    pub llm: Choice,
    /// Encoders in workload order.
    pub encoders: Vec<Choice>,
    /// Global microbatches per step.
    pub microbatches: usize,
}

impl Candidate {
    /// LLM samples per replica per microbatch.
    pub fn llm_mbs(&self, wl: &Workload) -> f64 {
        self.llm.samples(wl, self.microbatches)
    }

    /// Whether hetpar's runtime accepts the candidate as a config: the LLM's `dp` divides
    /// the samples of a global microbatch. Encoders split items (SEMANTICS.md section 3), so
    /// any encoder `dp` runs.
    pub fn runnable(&self, wl: &Workload) -> bool {
        let b = wl.global_batch;
        b.is_multiple_of(self.microbatches) && (b / self.microbatches).is_multiple_of(self.llm.dp())
    }
}

/// Memory per GPU by part, bytes (the largest over the candidate's ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Memory {
    /// Weights, gradients and optimizer state.
    pub states: f64,
    /// Activations kept for the backward pass (pipeline in-flight microbatches included).
    pub activations: f64,
    /// Boundary rows and their gradients, logits.
    pub buffers: f64,
    /// Runtime overhead.
    pub overhead: f64,
}

impl Memory {
    /// Sum.
    pub fn total(&self) -> f64 {
        self.states + self.activations + self.buffers + self.overhead
    }
}

/// What the planner predicts for a candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// Simulated step time, seconds.
    pub step_time_s: f64,
    /// Model FLOPs of the step over step time and every GPU, TFLOP/s.
    pub tflops_per_gpu: f64,
    /// LLM tokens per second.
    pub tokens_per_s: f64,
    /// Largest memory per GPU.
    pub memory: Memory,
    /// Idle share of rank time in the simulated step.
    pub bubble: f64,
    /// Per module: busy time of its busiest rank, of it exposed communication, seconds.
    pub busy: Vec<(String, f64, f64)>,
    /// Boundary transfer time on the critical rank per step, seconds.
    pub boundary_s: f64,
    /// Whether it fits the GPU memory.
    pub fits: bool,
}
