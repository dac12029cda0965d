//! Why: what limits the best homogeneous candidate and why the winner beats it, in numbers
//! taken from the predictions.

use crate::candidate::{Candidate, Kind};
use crate::evaluate::Evaluator;
use crate::hardware::{GIB, Hardware};
use crate::search::{Plan, Ranked};
use crate::workload::Workload;

/// Encoder seconds per step on the rank that runs the most of it.
fn encoder_seconds(ev: &Evaluator<'_>, c: &Candidate) -> f64 {
    let hw = ev.hw;
    (0..c.encoders.len())
        .map(|i| {
            let r = ev.encoder_run(c, i);
            let per_stage = (0..r.pp)
                .map(|v| {
                    let t = r.vstage(hw, v);
                    t.fwd + t.bwd
                })
                .fold(0.0, f64::max);
            per_stage * c.microbatches as f64
        })
        .sum()
}

/// GEMM efficiency of a module at `tp` (fraction of peak).
fn gemm_eff(hw: &Hardware, hidden: usize, tp: usize) -> f64 {
    let w = hidden as f64 / tp as f64;
    hw.efficiency.gemm * w / (w + hw.efficiency.gemm_half_width)
}

/// One line per limiting factor of `r`.
fn limits(ev: &Evaluator<'_>, r: &Ranked) -> Vec<String> {
    let (c, p) = (&r.candidate, &r.prediction);
    let wl = ev.wl;
    let hw = ev.hw;
    let step = p.step_time_s;
    let mut out = Vec::new();
    let comm: f64 = p.busy.iter().map(|b| b.2).sum();
    if p.bubble > 0.02 {
        out.push(format!(
            "idle {:.0}% of rank time (pipeline fill and drain, waits between phases or islands)",
            p.bubble * 100.0
        ));
    }
    if comm / step > 0.02 {
        out.push(format!(
            "exposed tensor/context/expert-parallel communication {:.0}% of the step",
            comm / step * 100.0
        ));
    }
    if !wl.encoders.is_empty() {
        let enc = encoder_seconds(ev, c);
        let mut line =
            format!("encoders {:.0}% of the step on their busiest rank", enc / step * 100.0);
        if c.kind == Kind::Homogeneous {
            let e = &wl.encoders[0].shape;
            if c.llm.tp > 1 {
                line += &format!(
                    ", their GEMMs split {} ways run at {:.0}% of peak (tp1: {:.0}%)",
                    c.llm.tp,
                    gemm_eff(hw, e.hidden, c.llm.tp) * 100.0,
                    gemm_eff(hw, e.hidden, 1) * 100.0
                );
            }
            if c.llm.cp > 1 {
                line += &format!(", repeated on each of the LLM's {} CP ranks", c.llm.cp);
            }
        }
        out.push(line);
    }
    if c.llm.recompute > 0 || c.encoders.iter().any(|e| e.recompute > 0) {
        out.push(
            "recomputes activations to fit memory (a share of one more forward per backward)"
                .into(),
        );
    }
    if p.boundary_s / step > 0.01 {
        out.push(format!("boundary transfers {:.0}% of the step", p.boundary_s / step * 100.0));
    }
    out.push(format!("{} of {:.0} GiB per GPU", digits(p.memory.total() / GIB), hw.memory_gib));
    out
}

/// `x` with one decimal, or under one (a CPU's TFLOPS from `calibrate`, a small model's
/// GiB) with three significant digits, where one decimal would print 0.0 for every row.
pub fn digits(x: f64) -> String {
    // Rounded to three significant digits first, so 0.9996 reads 1.0, not 1.000.
    let rounded = format!("{x:.2e}").parse::<f64>().unwrap_or(x);
    match rounded.abs() {
        a if a >= 1.0 || a == 0.0 || !a.is_finite() => format!("{x:.1}"),
        a => format!("{x:.*}", (2 - a.log10().floor() as i64).max(1) as usize),
    }
}

/// Layout of every module, `llm: tp.. | vision: tp..`.
pub fn layouts(wl: &Workload, c: &Candidate) -> String {
    let mut parts = Vec::new();
    for (e, ch) in wl.encoders.iter().zip(&c.encoders) {
        let s = match c.kind {
            Kind::Homogeneous => format!("tp{} on the LLM's first stage", c.llm.tp),
            Kind::Colocated => ch.describe(),
            Kind::NonColocated => format!("{} on ranks {}..{}", ch.describe(), ch.start, ch.end),
        };
        parts.push(format!("{}: {s}", e.shape.name));
    }
    let mut l = c.llm.describe();
    if c.kind == Kind::NonColocated {
        l += &format!(" on ranks {}..{}", c.llm.start, c.llm.end);
    }
    parts.push(format!("{}: {l}", wl.llm_name));
    parts.push(format!("{} microbatches", c.microbatches));
    parts.join(" | ")
}

/// Encoder `i`'s layout in words.
fn encoder_layout(c: &Candidate, i: usize) -> String {
    match c.kind {
        Kind::Homogeneous => format!("the LLM's tp{} cp{}", c.llm.tp, c.llm.cp),
        _ => c.encoders[i].describe(),
    }
}

/// What differs from `from` to `to`, in the numbers that decide the step time.
fn differences(ev: &Evaluator<'_>, from: &Ranked, to: &Ranked) -> Vec<String> {
    let mut why = Vec::new();
    let (fc, tc) = (&from.candidate, &to.candidate);
    if fc.llm.tp != tc.llm.tp || fc.llm.pp != tc.llm.pp || fc.llm.cp != tc.llm.cp {
        why.push(format!(
            "the LLM runs tp{} cp{} pp{} instead of tp{} cp{} pp{}",
            tc.llm.tp, tc.llm.cp, tc.llm.pp, fc.llm.tp, fc.llm.cp, fc.llm.pp
        ));
    }
    for (i, e) in ev.wl.encoders.iter().enumerate() {
        let (fd, td) = (encoder_layout(fc, i), encoder_layout(tc, i));
        if fd != td {
            why.push(format!("{} runs {td} instead of {fd}", e.shape.name));
        }
    }
    if fc.microbatches != tc.microbatches {
        why.push(format!("{} microbatches instead of {}", tc.microbatches, fc.microbatches));
    }
    let step = from.prediction.step_time_s;
    let (fe, te) = (encoder_seconds(ev, fc), encoder_seconds(ev, tc));
    if (fe - te).abs() > 0.01 * step {
        why.push(format!("encoder time on the busiest rank {fe:.2} s -> {te:.2} s"));
    }
    let fcomm: f64 = from.prediction.busy.iter().map(|b| b.2).sum();
    let tcomm: f64 = to.prediction.busy.iter().map(|b| b.2).sum();
    if (fcomm - tcomm).abs() > 0.01 * step {
        why.push(format!("exposed communication {fcomm:.2} s -> {tcomm:.2} s"));
    }
    if (from.prediction.bubble - to.prediction.bubble).abs() > 0.01 {
        why.push(format!(
            "idle rank time {:.0}% -> {:.0}%",
            from.prediction.bubble * 100.0,
            to.prediction.bubble * 100.0
        ));
    }
    why
}

/// The explanation printed by `hetpar plan`.
pub fn explain(wl: &Workload, hw: &Hardware, plan: &Plan) -> Vec<String> {
    let ev = Evaluator::new(wl, hw);
    let mut out = Vec::new();
    let homo = plan.best_of(Kind::Homogeneous);
    if let Some(h) = homo {
        out.push(format!("homogeneous is limited by: {}", limits(&ev, h).join("; ")));
    }
    let Some(w) = plan.winner() else { return out };
    let gain = |a: &Ranked, b: &Ranked| {
        (a.prediction.tflops_per_gpu / b.prediction.tflops_per_gpu - 1.0) * 100.0
    };
    match homo {
        Some(h) if w.candidate.kind != Kind::Homogeneous => {
            let why = differences(&ev, h, w);
            out.push(format!(
                "{} wins by {:+.1}% TFLOPS/GPU: {}",
                w.candidate.kind.name(),
                gain(w, h),
                if why.is_empty() {
                    "same layouts, different placement".to_string()
                } else {
                    why.join("; ")
                }
            ));
        }
        Some(h) => {
            // Homogeneous wins: say what holds back the best heterogeneous candidate.
            let runner_up = [Kind::Colocated, Kind::NonColocated]
                .into_iter()
                .filter_map(|k| plan.best_of(k))
                .min_by(|a, b| a.prediction.step_time_s.total_cmp(&b.prediction.step_time_s));
            let Some(r) = runner_up else {
                out.push(if wl.encoders.is_empty() {
                    // Nothing to place apart: the LLM's best layout is the answer.
                    "an LLM alone: its best layout is homogeneous by definition (heterogeneous placements need an encoder)".into()
                } else {
                    format!(
                        "homogeneous wins: {}",
                        plan.none_of(&[Kind::Colocated, Kind::NonColocated], "heterogeneous")
                    )
                });
                return out;
            };
            let why = differences(&ev, r, h);
            let mut line = format!(
                "homogeneous wins by {:+.1}% TFLOPS/GPU over {}",
                gain(h, r),
                r.candidate.kind.name()
            );
            if !why.is_empty() {
                line +=
                    &format!(" ({} -> homogeneous: {})", r.candidate.kind.name(), why.join("; "));
            }
            out.push(line);
            let held = limits(&ev, r);
            out.push(format!("{} is limited by: {}", r.candidate.kind.name(), held.join("; ")));
        }
        None => out.push(format!(
            "{} wins ({})",
            w.candidate.kind.name(),
            plan.none_of(&[Kind::Homogeneous], "homogeneous")
        )),
    }
    out
}

#[cfg(test)]
mod tests {
    use super::digits;

    #[test]
    fn small_rates_and_sizes_keep_three_digits() {
        let shown: Vec<String> =
            [45.14, 1.0, 0.0, 0.5, 0.0415, 0.00603, 0.9996, 0.09996].map(digits).to_vec();
        assert_eq!(shown, ["45.1", "1.0", "0.0", "0.500", "0.0415", "0.00603", "1.0", "0.100"]);
    }
}
