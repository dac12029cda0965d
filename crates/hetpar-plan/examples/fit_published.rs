//! Fits the H100 efficiency factors to the published rows (the LLM-only table, the 8K
//! multimodal table, the three long-context rows) and prints the factors with the errors
//! they give, row by row and term by term. The defaults in `hardware.rs` come from
//!
//!     cargo run --release -p hetpar-plan --example fit_published -- --restarts 3
//!
//! The loss is the acceptance bounds as hinges (10% per row, 5 points per gain, 10% on the
//! LLM-only median, each with a margin), the 8K rows weighted ten times, plus a little of
//! the mean errors; Nelder-Mead then a pattern search, from the built-in factors and from
//! spread-out points. The published times per microbatch (the 64K row) and Meta's Llama 3
//! 405B rows are printed with their errors but not fitted. `--set name=value` overrides a
//! factor (the fit's start), `--fix name` holds one at that value (a measured rate, say),
//! `--show` prints the rows for the factors as they are. `--count weights` reads the
//! multimodal rows' rates as counting the weights' products only (no core attention), with
//! the microbatch size the 64K row's times then pin (two samples; BENCHMARKS.md).

#![allow(clippy::print_stdout)]

use hetpar_plan::hardware::builtin;
use hetpar_plan::validation::{
    counted_rate, llama3, llm_only, microbatch_ms, multimodal_counting, workload,
};
use hetpar_plan::{Efficiency, FlopCount, Hardware};

/// Per-row errors: LLM-only TFLOPS/GPU, multimodal TFLOPS/GPU, multimodal gain (points),
/// and the published times per microbatch.
struct Errors {
    llm: Vec<f64>,
    mm: Vec<f64>,
    gain: Vec<f64>,
    microbatch: Vec<f64>,
}

fn errors(hw: &Hardware, count: FlopCount) -> Option<Errors> {
    let llm: Vec<f64> = llm_only(hw)
        .ok()?
        .iter()
        .map(|(_, r, m)| (r.prediction.tflops_per_gpu - m).abs() / m)
        .collect();
    let (mut mm, mut gain, mut microbatch) = (Vec::new(), Vec::new(), Vec::new());
    for (row, (hc, ph), (tc, pt)) in multimodal_counting(hw, count).ok()? {
        let wl = workload(row.name).ok()?;
        let (a, b) = (counted_rate(&wl, &ph, count), counted_rate(&wl, &pt, count));
        mm.push((a - row.measured.0).abs() / row.measured.0);
        mm.push((b - row.measured.1).abs() / row.measured.1);
        gain.push(((b / a) - (row.measured.1 / row.measured.0)).abs());
        if let Some(m) = row.microbatch {
            microbatch.push((microbatch_ms(&hc, &ph) - m.ms.0).abs() / m.ms.0);
            microbatch.push((microbatch_ms(&tc, &pt) - m.ms.1).abs() / m.ms.1);
        }
    }
    Some(Errors { llm, mm, gain, microbatch })
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn worst(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// The acceptance bounds as hinges with a margin; see the module docs.
fn loss(hw: &Hardware, count: FlopCount) -> f64 {
    // The published microbatch times are reported, not fitted (see BENCHMARKS.md).
    errors(hw, count).map_or(f64::INFINITY, |Errors { mut llm, mm, gain, .. }| {
        llm.sort_by(f64::total_cmp);
        let hinge = |e: f64, bound: f64| (e - bound).max(0.0).powi(2) / (bound * bound);
        // The 8K rows come first in the table: two predictions and one gain each.
        let w = |i: usize, per_row: usize| if i < 4 * per_row { 10.0 } else { 1.0 };
        10.0 * hinge(llm[llm.len() / 2], 0.07)
            + mm.iter().enumerate().map(|(i, &e)| w(i, 2) * hinge(e, 0.07)).sum::<f64>()
            + gain.iter().enumerate().map(|(i, &e)| w(i, 1) * hinge(e, 0.035)).sum::<f64>()
            + 0.1 * (mean(&llm) + mean(&mm) + mean(&gain))
    })
}

/// The acceptance numbers: median LLM-only error, worst multimodal error, worst gain error;
/// and the worst error on the published microbatch times.
fn summary(hw: &Hardware, count: FlopCount) -> String {
    let Some(Errors { mut llm, mm, gain, microbatch }) = errors(hw, count) else {
        return "no prediction".into();
    };
    llm.sort_by(f64::total_cmp);
    format!(
        "median LLM-only error {:.1}%, worst multimodal error {:.1}%, worst gain error {:.1} points, worst microbatch-time error {:.1}%",
        llm[llm.len() / 2] * 100.0,
        worst(&mm) * 100.0,
        worst(&gain) * 100.0,
        worst(&microbatch) * 100.0
    )
}

/// The fitted factors in `get`'s order, each with the bounds the fit keeps it in.
const FACTORS: [(&str, f64, f64); 10] = [
    ("gemm", 0.5, 0.85),
    ("gemm_half_width", 16.0, 2048.0),
    ("attention", 0.2, 0.8),
    ("elementwise_bytes", 5.0, 300.0),
    ("tp_overlap", 0.0, 1.0),
    ("cp_attention", 1.0, 8.0),
    ("cp_overlap", 0.0, 1.0),
    ("dp_overlap", 0.0, 1.0),
    ("cp_step", 0.0, 1.0),
    ("overhead_gib", 2.0, 16.0),
];

fn get(e: &mut Efficiency, i: usize) -> &mut f64 {
    match i {
        0 => &mut e.gemm,
        1 => &mut e.gemm_half_width,
        2 => &mut e.attention,
        3 => &mut e.elementwise_bytes,
        4 => &mut e.tp_overlap,
        5 => &mut e.cp_attention,
        6 => &mut e.cp_overlap,
        7 => &mut e.dp_overlap,
        8 => &mut e.cp_step,
        _ => &mut e.overhead_gib,
    }
}

/// Every row with its prediction and where the time goes.
fn show(hw: &Hardware, count: FlopCount) {
    for (name, r, m) in llm_only(hw).expect("predictions") {
        println!(
            "{name}: {:.1} (measured {m}) {} idle {:.1}%",
            r.prediction.tflops_per_gpu,
            r.candidate.llm.describe(),
            r.prediction.bubble * 100.0
        );
    }
    for (name, gpus, r, m) in llama3(hw).expect("predictions") {
        println!(
            "{name} on {gpus} GPUs (not fitted): {:.1} (measured {m}, {:+.0}%) {} idle {:.1}%",
            r.prediction.tflops_per_gpu,
            (r.prediction.tflops_per_gpu / m - 1.0) * 100.0,
            r.candidate.llm.describe(),
            r.prediction.bubble * 100.0
        );
    }
    for (row, (hc, ph), (tc, pt)) in multimodal_counting(hw, count).expect("predictions") {
        let wl = workload(row.name).expect("workload");
        let ev = hetpar_plan::Evaluator::new(&wl, hw);
        let ms = row.microbatch.map(|m| m.ms);
        let gb = row.memory_gb;
        for (label, c, p, m, m_ms, m_gb) in [
            ("homo", hc, ph, row.measured.0, ms.map(|t| t.0), gb.map(|g| g.0)),
            ("het", tc, pt, row.measured.1, ms.map(|t| t.1), gb.map(|g| g.1)),
        ] {
            let per_mb = microbatch_ms(&c, &p);
            let rate = counted_rate(&wl, &p, count);
            let measured_mb = m_ms.map_or(String::new(), |ms| {
                format!(" ({ms:.0} measured, {:+.1}%)", (per_mb / ms - 1.0) * 100.0)
            });
            let memory = p.memory.total() / hetpar_plan::hardware::GIB;
            let published_memory = m_gb.map_or(String::new(), |g| {
                format!(" (published {g} GB, {:+.1} GiB reading GB as GiB)", memory - g)
            });
            let busy: Vec<String> =
                p.busy.iter().map(|(n, w, c)| format!("{n} {w:.2} s (comm {c:.2})")).collect();
            println!(
                "{} {label}: {:.1} (measured {m}, {:+.0}%) step {:.2} s ({:.2} s measured) per microbatch {per_mb:.0} ms{measured_mb} idle {:.1}% boundary {:.2} s {memory:.1} GiB{published_memory}, {} microbatches, llm {} enc {}; busy {}",
                row.name,
                rate,
                (rate / m - 1.0) * 100.0,
                p.step_time_s,
                p.step_time_s * rate / m,
                p.bubble * 100.0,
                p.boundary_s,
                c.microbatches,
                c.llm.describe(),
                c.encoders[0].describe(),
                busy.join(", ")
            );
            let g = hetpar_plan::hardware::GIB;
            println!(
                "    memory (GiB): states {:.1}, activations {:.1}, buffers {:.1}, overhead {:.1}",
                p.memory.states / g,
                p.memory.activations / g,
                p.memory.buffers / g,
                p.memory.overhead / g
            );
            let runs = std::iter::once(("llm", ev.llm_run(&c)))
                .chain((0..c.encoders.len()).map(|i| ("enc", ev.encoder_run(&c, i))));
            for (name, r) in runs {
                let l = r.layer_parts(hw);
                let n = r.shape.layers as f64 / r.pp as f64;
                let per = |x: f64| x * n * 1e3;
                let pass = r.vstage(hw, 0);
                println!(
                    "    {name}: per microbatch and stage (ms): gemm {:.0} (x3) attn {:.0}+{:.0} elem {:.0} (x3) tp {:.0} (x3) cp {:.0}+{:.0} ep {:.0}; pass {:.0}+{:.0}, reduce {:.0} ms, tokens {:.0}",
                    per(l.gemm),
                    per(l.attn_fwd),
                    per(l.attn_bwd),
                    per(l.elem),
                    per(l.tp_comm),
                    per(l.cp_fwd),
                    per(l.cp_bwd),
                    per(l.ep_comm),
                    pass.fwd * 1e3,
                    pass.bwd * 1e3,
                    r.reduce(
                        hw,
                        0,
                        &(0..r.pp * r.vpp).map(|v| r.vstage(hw, v)).collect::<Vec<_>>()
                    ) * 1e3,
                    r.local_tokens()
                );
            }
        }
    }
}

/// Coordinate pattern search in [0, 1]^n from `x` (loss `fx`): try `x +- step` along each
/// coordinate, keep improvements, halve the step when none helps.
fn pattern_search(
    f: &dyn Fn(&[f64]) -> f64,
    mut x: Vec<f64>,
    mut fx: f64,
    mut step: f64,
) -> (Vec<f64>, f64) {
    while step > 0.002 {
        let mut improved = false;
        for i in 0..x.len() {
            for dir in [step, -step] {
                let mut t = x.clone();
                t[i] = (t[i] + dir).clamp(0.0, 1.0);
                let ft = f(&t);
                if ft < fx {
                    (x, fx) = (t, ft);
                    improved = true;
                }
            }
        }
        if !improved {
            step /= 2.0;
        }
    }
    (x, fx)
}

/// Minimizes `f` from `x0` with a simplex of side `step`, for at most `iters` iterations.
fn nelder_mead(
    f: &dyn Fn(&[f64]) -> f64,
    x0: Vec<f64>,
    step: f64,
    iters: usize,
) -> (Vec<f64>, f64) {
    let n = x0.len();
    let mut simplex: Vec<(Vec<f64>, f64)> = (0..=n)
        .map(|i| {
            let mut x = x0.clone();
            if i > 0 {
                x[i - 1] += if x[i - 1] + step <= 1.0 { step } else { -step };
            }
            let v = f(&x);
            (x, v)
        })
        .collect();
    let point = |a: &[f64], b: &[f64], t: f64| -> Vec<f64> {
        a.iter().zip(b).map(|(x, y)| (x + t * (y - x)).clamp(0.0, 1.0)).collect()
    };
    for _ in 0..iters {
        simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
        if simplex[n].1 - simplex[0].1 < 1e-6 {
            break;
        }
        let centroid: Vec<f64> =
            (0..n).map(|j| simplex[..n].iter().map(|p| p.0[j]).sum::<f64>() / n as f64).collect();
        let worst = simplex[n].clone();
        let reflect = point(&worst.0, &centroid, 2.0);
        let fr = f(&reflect);
        if fr < simplex[0].1 {
            let expand = point(&worst.0, &centroid, 3.0);
            let fe = f(&expand);
            simplex[n] = if fe < fr { (expand, fe) } else { (reflect, fr) };
        } else if fr < simplex[n - 1].1 {
            simplex[n] = (reflect, fr);
        } else {
            let contract = point(&worst.0, &centroid, 0.5);
            let fc = f(&contract);
            if fc < worst.1 {
                simplex[n] = (contract, fc);
            } else {
                let best = simplex[0].0.clone();
                for p in simplex.iter_mut().skip(1) {
                    p.0 = point(&best, &p.0, 0.5);
                    p.1 = f(&p.0);
                }
            }
        }
    }
    simplex.sort_by(|a, b| a.1.total_cmp(&b.1));
    simplex.swap_remove(0)
}

fn main() {
    let mut hw = builtin("h100").expect("h100");
    // `--set name=value` overrides a factor (for `--show`, or as the fit's start).
    let args: Vec<String> = std::env::args().collect();
    for pair in args.windows(2).filter(|w| w[0] == "--set").map(|w| &w[1]) {
        let (k, v) = pair.split_once('=').expect("--set name=value");
        let i = FACTORS.iter().position(|f| f.0 == k).expect("a factor name");
        *get(&mut hw.efficiency, i) = v.parse().expect("a number");
    }
    let hw = hw;
    // `--count weights`: read the multimodal rates as counting the weights' products only.
    let at = args.iter().position(|a| a.starts_with("--count"));
    let count = match at.map(|i| (args[i].as_str(), args.get(i + 1).map(String::as_str))) {
        None => FlopCount::All,
        Some(("--count", Some("all"))) => FlopCount::All,
        Some(("--count", Some("weights"))) => FlopCount::Weights,
        Some((flag, value)) => {
            panic!("{flag} {}: write --count all or --count weights", value.unwrap_or(""))
        }
    };
    if args.iter().any(|a| a == "--show") {
        show(&hw, count);
        println!("{}", summary(&hw, count));
        return;
    }
    // A fixed factor's bounds close on its value, so the fit cannot move it.
    let fixed: Vec<&str> =
        args.windows(2).filter(|w| w[0] == "--fix").map(|w| w[1].as_str()).collect();
    for name in &fixed {
        assert!(FACTORS.iter().any(|f| f.0 == *name), "--fix {name}: not a factor name");
    }
    let bounds: Vec<(f64, f64)> = FACTORS
        .iter()
        .enumerate()
        .map(|(i, f)| {
            if fixed.contains(&f.0) {
                let v = *get(&mut hw.efficiency.clone(), i);
                (v, v)
            } else {
                (f.1, f.2)
            }
        })
        .collect();
    // Nelder-Mead on the parameters scaled to [0, 1] by their bounds, restarted from the
    // built-in factors and from a few spread-out points; the best result wins.
    let n = FACTORS.len();
    let to_hw = |u: &[f64]| {
        let mut h = hw.clone();
        for (i, &(lo, hi)) in bounds.iter().enumerate() {
            *get(&mut h.efficiency, i) = lo + (hi - lo) * u[i].clamp(0.0, 1.0);
        }
        h
    };
    let f = |u: &[f64]| loss(&to_hw(u), count);
    let start: Vec<f64> = bounds
        .iter()
        .enumerate()
        .map(|(i, &(lo, hi))| {
            if hi > lo {
                ((*get(&mut hw.efficiency.clone(), i) - lo) / (hi - lo)).clamp(0.0, 1.0)
            } else {
                0.0
            }
        })
        .collect();
    println!("start: loss {:.4}: {}", f(&start), summary(&hw, count));
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let restarts = std::env::args()
        .skip_while(|a| a != "--restarts")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let (mut best_u, mut best_l) = (start.clone(), f(&start));
    for r in 0..restarts {
        let x0: Vec<f64> =
            if r == 0 { start.clone() } else { (0..n).map(|_| 0.1 + 0.8 * rand()).collect() };
        let step = if r == 0 { 0.05 } else { 0.15 };
        let (u, l) = nelder_mead(&f, x0, step, 600);
        let (u, l) = pattern_search(&f, u, l, 0.1);
        println!("restart {r}: loss {l:.4}");
        if l < best_l {
            (best_u, best_l) = (u, l);
        }
    }
    let hw = to_hw(&best_u);
    println!("{}", summary(&hw, count));
    show(&hw, count);
    for (i, (n, _, _)) in FACTORS.iter().enumerate() {
        println!("{n} = {}", get(&mut hw.efficiency.clone(), i));
    }
}
