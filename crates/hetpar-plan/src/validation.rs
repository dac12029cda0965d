//! The published measurements the cost model is calibrated and validated on
//! (PUBLISHED.md), with the workloads of `examples/workloads/` built in, and the
//! predictions for them. The validation tests and the fitting example read these.

use crate::candidate::{Candidate, Choice, Kind, Prediction};
use crate::error::{PlanError, Result};
use crate::evaluate::{Evaluator, Prepared};
use crate::hardware::Hardware;
use crate::search::{Ranked, search};
use crate::workload::{FlopCount, Workload};

macro_rules! workload {
    ($name:literal) => {
        ($name, include_str!(concat!("../../../examples/workloads/", $name, ".toml")))
    };
}

/// Every workload in `examples/workloads/`, by name.
pub const WORKLOADS: [(&str, &str); 22] = [
    workload!("gpt-1.7b"),
    workload!("gpt-7.1b"),
    workload!("gpt-16b"),
    workload!("gpt-32b"),
    workload!("gpt-70b"),
    workload!("gpt-119b"),
    workload!("gpt-177b"),
    workload!("gpt-314b"),
    workload!("gpt-462b"),
    workload!("llama3-405b-8k"),
    workload!("llama3-405b-131k"),
    workload!("mm-1b-14b-8k"),
    workload!("mm-3b-14b-8k"),
    workload!("mm-3b-32b-8k"),
    workload!("mm-3b-70b-8k"),
    workload!("mm-1b-7b-8k"),
    workload!("mm-1b-7b-16k"),
    workload!("mm-1b-14b-32k"),
    workload!("mm-1b-7b-64k"),
    workload!("mm-6b-gptoss120b"),
    workload!("mm-12b-gptoss120b"),
    workload!("vision-audio-8b"),
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

/// Meta's Llama 3 405B rows on H100 (PUBLISHED.md): workload, GPUs, measured TFLOPS/GPU.
/// The workloads pin the published TP, CP and PP; the search picks the rest. The fit never
/// sees these rows: they check the model, and the long-context one checks its context
/// parallelism against a stack other than the multimodal sweep the CP factors are fitted to.
pub const LLAMA3: [(&str, usize, f64); 3] = [
    ("llama3-405b-8k", 8192, 430.0),
    ("llama3-405b-8k", 16384, 400.0),
    ("llama3-405b-131k", 16384, 380.0),
];

/// The best homogeneous candidate of each [`LLAMA3`] row on its GPUs, with the measurement.
pub fn llama3(hw: &Hardware) -> Result<Vec<(&'static str, usize, Ranked, f64)>> {
    LLAMA3
        .iter()
        .map(|&(name, gpus, measured)| {
            let mut wl = workload(name)?;
            wl.gpus = gpus;
            Ok((name, gpus, best_homogeneous(&wl, hw)?, measured))
        })
        .collect()
}

/// One row of a published multimodal table: homogeneous against colocated heterogeneous.
#[derive(Clone, Copy, Debug)]
pub struct MultimodalRow {
    /// Workload.
    pub name: &'static str,
    /// Homogeneous LLM (tp, cp, pp); its encoders share the LLM's tp (and repeat on every
    /// CP rank).
    pub homogeneous: (usize, usize, usize),
    /// Heterogeneous LLM (tp, cp, pp).
    pub llm: (usize, usize, usize),
    /// Heterogeneous encoder tp (cp 1, on every rank, with offload).
    pub encoder_tp: usize,
    /// Measured TFLOPS/GPU, homogeneous and heterogeneous.
    pub measured: (f64, f64),
    /// Measured time per microbatch, homogeneous and heterogeneous, where the source gives
    /// it (see [`Microbatch`]).
    pub microbatch: Option<Microbatch>,
    /// Published memory per GPU, homogeneous and heterogeneous, as the source gives it
    /// ("GB"; the 8K table). The model's recomputation choice rests on its own memory
    /// estimate; `fit_published --show` prints it next to these (BENCHMARKS.md).
    pub memory_gb: Option<(f64, f64)>,
}

/// Published time per microbatch of a multimodal row. Where the source gives it, it also
/// pins the microbatch size that the tables leave open ([`microbatch_samples`]): at the
/// model's FLOP count, one sample per LLM replica and microbatch makes the 64K row's steps
/// 4 x 2569 and 2 x 3717 ms, whose ratio is the published TFLOPS/GPU ratio (71.3 against
/// 100.0) within 1.5% and which are 6-7% shorter than the steps those rates mean; with two
/// samples a microbatch the steps would be half as long as that.
#[derive(Clone, Copy, Debug)]
pub struct Microbatch {
    /// Milliseconds per microbatch, homogeneous and heterogeneous.
    pub ms: (f64, f64),
}

/// The published multimodal rows: the 8K table of NVIDIA's heterogeneous-parallelism
/// article (64 GPUs, encoder tp 1 with offload, LLM pp 2) and three long-context rows of the
/// same sweep (H100, 75% image rows, 1024 rows per image). The 3B+70B row's homogeneous
/// layout is written 8/4/1, which covers 32 GPUs; on 64 it is read as TP8 DP4 PP2.
pub const MULTIMODAL: [MultimodalRow; 7] = [
    MultimodalRow {
        name: "mm-1b-14b-8k",
        homogeneous: (4, 1, 1),
        llm: (2, 1, 2),
        encoder_tp: 1,
        measured: (415.1, 473.3),
        microbatch: None,
        memory_gb: Some((57.6, 58.2)),
    },
    MultimodalRow {
        name: "mm-3b-14b-8k",
        homogeneous: (4, 1, 1),
        llm: (2, 1, 2),
        encoder_tp: 1,
        measured: (441.4, 498.3),
        microbatch: None,
        memory_gb: Some((60.1, 58.3)),
    },
    MultimodalRow {
        name: "mm-3b-32b-8k",
        homogeneous: (4, 1, 1),
        llm: (4, 1, 2),
        encoder_tp: 1,
        measured: (432.0, 486.9),
        microbatch: None,
        memory_gb: Some((69.4, 55.9)),
    },
    MultimodalRow {
        name: "mm-3b-70b-8k",
        homogeneous: (8, 1, 2),
        llm: (8, 1, 2),
        encoder_tp: 1,
        measured: (408.0, 467.4),
        microbatch: None,
        memory_gb: Some((56.3, 62.9)),
    },
    MultimodalRow {
        name: "mm-1b-7b-16k",
        homogeneous: (2, 2, 1),
        llm: (2, 2, 1),
        encoder_tp: 1,
        measured: (266.9, 290.1),
        microbatch: None,
        memory_gb: None,
    },
    MultimodalRow {
        name: "mm-1b-14b-32k",
        homogeneous: (8, 2, 1),
        llm: (4, 2, 1),
        encoder_tp: 2,
        measured: (208.1, 267.2),
        microbatch: None,
        memory_gb: None,
    },
    MultimodalRow {
        name: "mm-1b-7b-64k",
        homogeneous: (4, 8, 1),
        llm: (2, 8, 1),
        encoder_tp: 1,
        measured: (71.3, 100.0),
        microbatch: Some(Microbatch { ms: (2569.0, 3717.0) }),
        memory_gb: None,
    },
];

/// Published numbers the cost model does not reproduce within the acceptance bounds (10% per
/// row, 5 points per gain), with what is known about why. The validation tests hold every
/// other number to the bounds and check that each miss here is still a miss, so a model
/// that fixes one must drop it from this list.
pub const KNOWN_MISSES: [(&str, &str); 1] = [(
    "mm-1b-7b-64k",
    "the homogeneous tp4 cp8 layout runs at 71.3 TFLOPS/GPU, about 19% below the model, and \
     the gain is predicted at about +25% against +40% measured. Per microbatch the model is \
     within 10% of both published times (homogeneous 2.32 s against 2.569, -9.6%; \
     heterogeneous 3.73 s against 3.717); the rest of the miss is between the microbatches \
     and the rate: at the model's FLOP count (2.53e16 a step) the published rates mean steps \
     0.79 s (homogeneous) and 0.46 s (heterogeneous) longer than their microbatches, where \
     the model's step is its microbatches and an exposed reduction of under 0.1 s. Read the \
     other way, the per-microbatch times mean the published rates count 2.34e16-2.38e16 \
     FLOPs a step, about the LLM's own 2.39e16; but counting only the LLM's FLOPs everywhere \
     puts the 3B-encoder 8K rows 21-23% low, and refitted it still leaves this row +16% \
     and breaks other bounds (a gain 24 points off). At two samples a microbatch they mean \
     half that, about the weights' products alone (FlopCount::Weights): read so, a refit \
     passes every bound, but the 8K rows would then run above every LLM-only measurement, \
     and NVIDIA's multimodal count (Megatron-LM examples/mimo/utils/flops.py) is the \
     model's (BENCHMARKS.md)",
)];

/// Whether `row`'s homogeneous prediction is a known miss.
pub fn homogeneous_miss(row: &str) -> bool {
    KNOWN_MISSES.iter().any(|(name, _)| *name == row)
}

/// The best homogeneous candidate of each LLM-only row with its measurement.
pub fn llm_only(hw: &Hardware) -> Result<Vec<(&'static str, Ranked, f64)>> {
    LLM_ONLY
        .iter()
        .map(|&(name, measured)| Ok((name, best_homogeneous(&workload(name)?, hw)?, measured)))
        .collect()
}

/// The best homogeneous candidate of a search of `wl`.
fn best_homogeneous(wl: &Workload, hw: &Hardware) -> Result<Ranked> {
    search(wl, hw, 1)?.best_of(Kind::Homogeneous).cloned().ok_or_else(|| {
        PlanError(format!("{} on {} GPUs: no homogeneous layout fits", wl.name, wl.gpus))
    })
}

fn choice(n: usize, (tp, cp, pp): (usize, usize, usize)) -> Choice {
    Choice { start: 0, end: n, tp, cp, pp, vpp: 1, ep: 1, recompute: 0, offload: false }
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

/// `c` with the microbatch count (`sizes`: LLM samples per replica and microbatch) and the
/// least recomputation that give the shortest step (the published tables give the layouts,
/// not the microbatch size, unless the row has [`Microbatch`] times).
fn best_microbatching(
    ev: &mut Evaluator<'_>,
    c: Candidate,
    sizes: &[usize],
) -> Result<(Candidate, Prediction)> {
    let wl = ev.wl;
    let mut best: Option<(Candidate, Prediction)> = None;
    for &mbs in sizes {
        let per_step = c.llm.dp() * mbs;
        if !wl.global_batch.is_multiple_of(per_step) {
            continue;
        }
        let trial = Candidate { microbatches: wl.global_batch / per_step, ..c.clone() };
        let (tc, tp) = least_recompute(ev, trial)?;
        let better =
            |b: &(Candidate, Prediction)| (tp.fits, -tp.step_time_s) > (b.1.fits, -b.1.step_time_s);
        if best.as_ref().is_none_or(better) {
            best = Some((tc, tp));
        }
    }
    best.ok_or_else(|| {
        PlanError(format!(
            "{}: global_batch({}) splits into no microbatch count with {sizes:?} samples per replica of the LLM's dp({})",
            wl.name,
            wl.global_batch,
            c.llm.dp()
        ))
    })
}

/// Predicted milliseconds per microbatch: the simulated step over its microbatch count.
pub fn microbatch_ms(c: &Candidate, p: &Prediction) -> f64 {
    p.step_time_s / c.microbatches as f64 * 1e3
}

/// Samples per LLM replica and microbatch that `row`'s published times per microbatch pin
/// when its rates count `count`'s FLOPs: of the sizes (1, 2, 4, ...) that split the global
/// batch on both published layouts, the one whose microbatch count times the published
/// time per microbatch comes closest to the step that the published rate means (the FLOPs
/// over the rate and the GPUs), by the sum of both layouts' log ratios. A size is pinned
/// only if that sum stays under `ln 2` (each layout within a factor of about `sqrt 2`,
/// nearer to it than to the next size); otherwise times and rates disagree and this is an
/// error. None where the row gives no times. `wl` is the row's workload.
pub fn microbatch_samples(
    row: &MultimodalRow,
    wl: &Workload,
    count: FlopCount,
) -> Result<Option<usize>> {
    let Some(m) = row.microbatch else { return Ok(None) };
    let flops = wl.step_flops_counting(count);
    let mut layouts = Vec::new();
    for (layout, rate, ms) in
        [(row.homogeneous, row.measured.0, m.ms.0), (row.llm, row.measured.1, m.ms.1)]
    {
        let c = choice(wl.gpus, layout);
        let block = c.tp * c.cp * c.pp;
        if block == 0 || !wl.gpus.is_multiple_of(block) {
            return Err(PlanError(format!(
                "{}: tp({})*cp({})*pp({}) = {block} does not divide gpus({})",
                row.name, c.tp, c.cp, c.pp, wl.gpus
            )));
        }
        let step = flops / (rate * 1e12 * wl.gpus as f64);
        layouts.push((c.dp(), step, ms / 1e3));
    }
    let mut best: Option<(f64, usize)> = None;
    let mut samples = 1;
    while samples <= wl.global_batch {
        let mut miss = 0.0;
        for &(dp, step, secs) in &layouts {
            let per_step = dp * samples;
            if !wl.global_batch.is_multiple_of(per_step) {
                miss = f64::INFINITY;
                break;
            }
            miss += ((wl.global_batch / per_step) as f64 * secs / step).ln().abs();
        }
        if miss.is_finite() && best.is_none_or(|(b, _)| miss < b) {
            best = Some((miss, samples));
        }
        samples *= 2;
    }
    match best {
        Some((miss, samples)) if miss < std::f64::consts::LN_2 => Ok(Some(samples)),
        Some((miss, samples)) => Err(PlanError(format!(
            "{}: the published times per microbatch ({} and {} ms) and rates ({} and {} TFLOPS/GPU, {flops:.3e} FLOPs a step) fit no microbatch size: the nearest, {samples} samples, is off by a summed log ratio of {miss:.2}",
            row.name, m.ms.0, m.ms.1, row.measured.0, row.measured.1
        ))),
        None => Err(PlanError(format!(
            "{}: global_batch({}) splits into no power-of-two microbatch size on both layouts (dp {} and {})",
            row.name, wl.global_batch, layouts[0].0, layouts[1].0
        ))),
    }
}

/// The published homogeneous and heterogeneous layouts of every multimodal row as
/// published (the heterogeneous encoder with its tp and cp 1 on every GPU, with offload),
/// each with its best microbatching (the size the published times pin where the row has
/// them, at the model's FLOP count) and least recomputation (see [`best_microbatching`]).
pub fn multimodal(hw: &Hardware) -> Result<Vec<MultimodalPrediction>> {
    multimodal_counting(hw, FlopCount::All)
}

/// [`multimodal`] with the microbatch sizes that the published times pin if the published
/// rates count `count`'s FLOPs. The predictions themselves are the same model's; compare
/// them with the published rates in that count through [`counted_rate`].
pub fn multimodal_counting(hw: &Hardware, count: FlopCount) -> Result<Vec<MultimodalPrediction>> {
    MULTIMODAL
        .iter()
        .map(|row| {
            let wl = workload(row.name)?;
            let mut ev = Evaluator::new(&wl, hw);
            let n = wl.gpus;
            let homo = Candidate {
                kind: Kind::Homogeneous,
                llm: choice(n, row.homogeneous),
                encoders: vec![choice(n, (row.homogeneous.0, 1, 1))],
                microbatches: 1,
            };
            let het = Candidate {
                kind: Kind::Colocated,
                llm: choice(n, row.llm),
                encoders: vec![Choice { offload: true, ..choice(n, (row.encoder_tp, 1, 1)) }],
                microbatches: 1,
            };
            let pinned = microbatch_samples(row, &wl, count)?.map(|s| [s]);
            let sizes: &[usize] = match &pinned {
                Some(s) => s,
                None => &[1, 2, 4],
            };
            Ok((
                *row,
                best_microbatching(&mut ev, homo, sizes)?,
                best_microbatching(&mut ev, het, sizes)?,
            ))
        })
        .collect()
}

/// A prediction's TFLOPS/GPU counting `count`'s FLOPs: the same step over fewer FLOPs where
/// `count` leaves some out.
pub fn counted_rate(wl: &Workload, p: &Prediction, count: FlopCount) -> f64 {
    p.tflops_per_gpu * wl.step_flops_counting(count) / wl.step_flops()
}
