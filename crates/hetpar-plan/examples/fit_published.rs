//! Fits the H100 efficiency factors to PUBLISHED.md by coordinate descent and prints the
//! factors with the errors they give. `cargo run --release -p hetpar-plan --example
//! fit_published`. The defaults in `hardware.rs` come from this.

#![allow(clippy::print_stdout)]

use hetpar_plan::hardware::builtin;
use hetpar_plan::validation::{llm_only, multimodal};
use hetpar_plan::{Efficiency, Hardware};

/// Per-row errors: LLM-only TFLOPS/GPU, multimodal TFLOPS/GPU, multimodal gain (points).
fn errors(hw: &Hardware) -> Option<(Vec<f64>, Vec<f64>, Vec<f64>)> {
    let llm: Vec<f64> = llm_only(hw)
        .ok()?
        .iter()
        .map(|(_, r, m)| (r.prediction.tflops_per_gpu - m).abs() / m)
        .collect();
    let (mut mm, mut gain) = (Vec::new(), Vec::new());
    for (row, (_, ph), (_, pt)) in multimodal(hw).ok()? {
        let (a, b) = (ph.tflops_per_gpu, pt.tflops_per_gpu);
        mm.push((a - row.measured.0).abs() / row.measured.0);
        mm.push((b - row.measured.1).abs() / row.measured.1);
        gain.push(((b / a) - (row.measured.1 / row.measured.0)).abs());
    }
    Some((llm, mm, gain))
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn worst(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// Mean errors of all three kinds, gains weighted double.
fn loss(hw: &Hardware) -> f64 {
    errors(hw).map_or(f64::INFINITY, |(l, m, g)| mean(&l) + mean(&m) + 2.0 * mean(&g))
}

/// The acceptance numbers: median LLM-only error, worst multimodal error, worst gain error.
fn summary(hw: &Hardware) -> String {
    let Some((mut l, m, g)) = errors(hw) else { return "no prediction".into() };
    l.sort_by(f64::total_cmp);
    format!(
        "median LLM-only error {:.1}%, worst multimodal error {:.1}%, worst gain error {:.1} points",
        l[l.len() / 2] * 100.0,
        worst(&m) * 100.0,
        worst(&g) * 100.0
    )
}

fn get(e: &mut Efficiency, i: usize) -> &mut f64 {
    match i {
        0 => &mut e.gemm,
        1 => &mut e.gemm_half_width,
        2 => &mut e.attention,
        3 => &mut e.elementwise_bytes,
        4 => &mut e.tp_overlap,
        _ => &mut e.dp_exposed,
    }
}

/// Every row with its prediction and where the time goes.
fn show(hw: &Hardware) {
    for (name, r, m) in llm_only(hw).expect("predictions") {
        println!(
            "{name}: {:.1} (measured {m}) {} idle {:.1}%",
            r.prediction.tflops_per_gpu,
            r.candidate.llm.describe(),
            r.prediction.bubble * 100.0
        );
    }
    for (row, (hc, ph), (tc, pt)) in multimodal(hw).expect("predictions") {
        for (label, c, p, m) in [("homo", hc, ph, row.measured.0), ("het", tc, pt, row.measured.1)]
        {
            println!(
                "{} {label}: {:.1} (measured {m}) step {:.2} s idle {:.1}% boundary {:.2} s busy {:?} llm {} enc {}",
                row.name,
                p.tflops_per_gpu,
                p.step_time_s,
                p.bubble * 100.0,
                p.boundary_s,
                p.busy,
                c.llm.describe(),
                c.encoders[0].describe()
            );
        }
    }
}

fn main() {
    let mut hw = builtin("h100").expect("h100");
    if std::env::args().any(|a| a == "--show") {
        show(&hw);
        return;
    }
    let names =
        ["gemm", "gemm_half_width", "attention", "elementwise_bytes", "tp_overlap", "dp_exposed"];
    let bounds = [(0.5, 0.9), (16.0, 2048.0), (0.2, 0.8), (5.0, 300.0), (0.0, 1.0), (0.0, 1.0)];
    let mut best = loss(&hw);
    println!("start: loss {best:.4}: {}", summary(&hw));
    let mut step = 0.25;
    while step > 0.01 {
        let mut improved = false;
        for (i, bound) in bounds.iter().enumerate() {
            for dir in [1.0 + step, 1.0 / (1.0 + step)] {
                let mut trial = hw.clone();
                let v = get(&mut trial.efficiency, i);
                *v = (*v * dir).clamp(bound.0, bound.1);
                let l = loss(&trial);
                if l < best {
                    best = l;
                    hw = trial;
                    improved = true;
                }
            }
        }
        if !improved {
            step /= 2.0;
            println!("step {step:.3} loss {best:.4} {:?}", hw.efficiency);
        }
    }
    println!("{}", summary(&hw));
    for (i, n) in names.iter().enumerate() {
        println!("{n} = {}", get(&mut hw.efficiency.clone(), i));
    }
}
