//! The published measurements the cost model is calibrated and validated on
//! (PUBLISHED.md), with the workloads of `examples/workloads/` built in, and the
//! predictions for them. The validation tests and the fitting example read these.

use crate::candidate::{Candidate, Choice, Kind, Prediction};
use crate::error::{PlanError, Result};
use crate::evaluate::{Evaluator, Prepared};
use crate::hardware::Hardware;
use crate::search::{Ranked, search};
use crate::workload::Workload;

macro_rules! workload {
    ($name:literal) => {
        ($name, include_str!(concat!("../../../examples/workloads/", $name, ".toml")))
    };
}

/// Every workload in `examples/workloads/`, by name.
pub const WORKLOADS: [(&str, &str); 17] = [
    workload!("gpt-1.7b"),
    workload!("gpt-7.1b"),
    workload!("gpt-16b"),
    workload!("gpt-32b"),
    workload!("gpt-70b"),
    workload!("gpt-119b"),
    workload!("gpt-177b"),
    workload!("gpt-314b"),
    workload!("gpt-462b"),
    workload!("mm-1b-14b-8k"),
    workload!("mm-3b-14b-8k"),
    workload!("mm-3b-32b-8k"),
    workload!("mm-3b-70b-8k"),
    workload!("mm-1b-7b-8k"),
    workload!("mm-1b-7b-64k"),
    workload!("mm-6b-gptoss120b"),
    workload!("mm-12b-gptoss120b"),
];

/// A built-in workload by name.
pub fn workload(name: &str) -> Result<Workload> {
    let (_, text) = WORKLOADS
        .iter()
        .find(|(n, _)| *n == name)
        .ok_or_else(|| PlanError(format!("no built-in workload {name:?}")))?;
    Workload::from_toml(text)
}

/// The LLM-only H100 table (Megatron-Core): workload and measured TFLOPS/GPU. The
/// workloads pin the published TP and PP; the search picks the rest.
pub const LLM_ONLY: [(&str, f64); 9] = [
    ("gpt-1.7b", 408.8),
    ("gpt-7.1b", 465.9),
    ("gpt-16b", 489.1),
    ("gpt-32b", 459.6),
    ("gpt-70b", 419.7),
    ("gpt-119b", 420.5),
    ("gpt-177b", 432.8),
    ("gpt-314b", 474.4),
    ("gpt-462b", 459.9),
];

/// One row of the multimodal 8K table.
#[derive(Clone, Copy, Debug)]
pub struct MultimodalRow {
    /// Workload.
    pub name: &'static str,
    /// Homogeneous (tp, pp) over 64 GPUs.
    pub homogeneous: (usize, usize),
    /// Heterogeneous LLM (tp, pp); the encoder is tp1 dp64 with offload.
    pub llm: (usize, usize),
    /// Measured TFLOPS/GPU, homogeneous and heterogeneous.
    pub measured: (f64, f64),
}

/// The multimodal 8K table (NVIDIA's heterogeneous-parallelism article). The 3B+70B row's
/// homogeneous layout is written 8/4/1, which covers 32 GPUs; on 64 it is read as TP8 DP4
/// PP2.
pub const MULTIMODAL: [MultimodalRow; 4] = [
    MultimodalRow {
        name: "mm-1b-14b-8k",
        homogeneous: (4, 1),
        llm: (2, 2),
        measured: (415.1, 473.3),
    },
    MultimodalRow {
        name: "mm-3b-14b-8k",
        homogeneous: (4, 1),
        llm: (2, 2),
        measured: (441.4, 498.3),
    },
    MultimodalRow {
        name: "mm-3b-32b-8k",
        homogeneous: (4, 1),
        llm: (4, 2),
        measured: (432.0, 486.9),
    },
    MultimodalRow {
        name: "mm-3b-70b-8k",
        homogeneous: (8, 2),
        llm: (8, 2),
        measured: (408.0, 467.4),
    },
];

/// The best homogeneous candidate of each LLM-only row with its measurement.
pub fn llm_only(hw: &Hardware) -> Result<Vec<(&'static str, Ranked, f64)>> {
    LLM_ONLY
        .iter()
        .map(|&(name, measured)| {
            let wl = workload(name)?;
            let plan = search(&wl, hw, 1)?;
            let best = plan
                .best_of(Kind::Homogeneous)
                .cloned()
                .ok_or_else(|| PlanError(format!("{name}: no layout fits")))?;
            Ok((name, best, measured))
        })
        .collect()
}

fn choice(n: usize, tp: usize, pp: usize) -> Choice {
    Choice { start: 0, end: n, tp, cp: 1, pp, vpp: 1, ep: 1, recompute: 0, offload: false }
}

/// `c` with the least recomputation that fits memory, simulated: LLM quarters 0 to 4 first,
/// then a colocated encoder keeping its activations before recomputing them (a homogeneous
/// encoder follows the LLM); everything recomputed if nothing fits.
pub fn least_recompute(ev: &mut Evaluator<'_>, c: Candidate) -> Result<(Candidate, Prediction)> {
    let levels: &[u8] = if c.kind == Kind::Homogeneous { &[0] } else { &[0, 4] };
    let mut best: Option<Prepared> = None;
    for &enc in levels {
        if let Some(p) = ev.least_recompute(c.clone(), enc)? {
            let fewer = |b: &Prepared| p.candidate.llm.recompute < b.candidate.llm.recompute;
            if best.as_ref().is_none_or(fewer) {
                best = Some(p);
            }
        }
    }
    let p = match best {
        Some(p) => p,
        None => {
            let mut all = c;
            all.llm.recompute = 4;
            for e in &mut all.encoders {
                e.recompute = *levels.last().expect("a level");
            }
            ev.prepare(&all)?
        }
    };
    let c = p.candidate.clone();
    Ok((c, ev.finish(p)?))
}

/// A multimodal row with the homogeneous and the heterogeneous prediction.
pub type MultimodalPrediction = (MultimodalRow, (Candidate, Prediction), (Candidate, Prediction));

/// The published homogeneous and heterogeneous layouts of every multimodal row, each with
/// one sample per replica per microbatch (see [`least_recompute`]).
pub fn multimodal(hw: &Hardware) -> Result<Vec<MultimodalPrediction>> {
    MULTIMODAL
        .iter()
        .map(|row| {
            let wl = workload(row.name)?;
            let mut ev = Evaluator::new(&wl, hw);
            let n = wl.gpus;
            let per_replica = |tp: usize, pp: usize| wl.global_batch / (n / (tp * pp));
            let (htp, hpp) = row.homogeneous;
            let homo = Candidate {
                kind: Kind::Homogeneous,
                llm: choice(n, htp, hpp),
                encoders: vec![choice(n, htp, 1)],
                microbatches: per_replica(htp, hpp),
            };
            let (ltp, lpp) = row.llm;
            let het = Candidate {
                kind: Kind::Colocated,
                llm: choice(n, ltp, lpp),
                encoders: vec![Choice { offload: true, ..choice(n, 1, 1) }],
                microbatches: per_replica(ltp, lpp),
            };
            Ok((*row, least_recompute(&mut ev, homo)?, least_recompute(&mut ev, het)?))
        })
        .collect()
}
