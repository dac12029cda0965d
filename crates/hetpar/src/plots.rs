//! The pictures a run leaves under `--out` (SVG, with `plotters`): `loss.svg`, the training
//! loss of every step in `metrics.jsonl` (earlier runs of a resumed job included) with the
//! held-out loss at each evaluation; `time.svg`, each rank's seconds by kind of action over
//! the run, stacked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use hetpar_data::files::read_regular_text;
use plotters::prelude::*;

/// Points of a curve: (step, loss).
type Curve = Vec<(f64, f64)>;

/// Training and held-out losses by step, from `metrics.jsonl` (non-finite values, written
/// as null, are left out).
pub fn losses(metrics: &str) -> (Curve, Curve) {
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for line in metrics.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let Some(step) = v["step"].as_f64() else { continue };
        if let Some(l) = v["loss"].as_f64() {
            // Step s's loss is measured with the parameters after s updates, as the
            // held-out loss at s is.
            train.push((step, l));
        }
        if let Some(l) = v["heldout"]["loss"].as_f64() {
            held.push((step, l));
        }
    }
    (train, held)
}

/// What a drawing error of `file` says: the file and the plotting library's reason.
fn draw_err<E: std::fmt::Display>(file: &Path) -> impl Fn(E) -> anyhow::Error + '_ {
    move |e| anyhow!("cannot draw {}: {e}", file.display())
}

/// Writes `loss.svg` under `out` from its `metrics.jsonl`.
pub fn loss_curve(out: &Path, title: &str) -> anyhow::Result<PathBuf> {
    let metrics = read_regular_text(&out.join("metrics.jsonl"))
        .with_context(|| format!("cannot read {}", out.join("metrics.jsonl").display()))?;
    let (train, held) = losses(&metrics);
    let file = out.join("loss.svg");
    let steps = train.iter().chain(&held).map(|p| p.0).fold(1.0f64, f64::max);
    let top = train.iter().chain(&held).map(|p| p.1).fold(0.0f64, f64::max) * 1.05;
    let root = SVGBackend::new(&file, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(&file))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title}: loss"), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..steps, 0.0..top.max(1e-3))
        .map_err(draw_err(&file))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (mean over target tokens)")
        .draw()
        .map_err(draw_err(&file))?;
    chart
        .draw_series(LineSeries::new(train.iter().copied(), BLUE.stroke_width(2)))
        .map_err(draw_err(&file))?
        .label("training batch")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if !held.is_empty() {
        chart
            .draw_series(LineSeries::new(held.iter().copied(), RED.stroke_width(2)))
            .map_err(draw_err(&file))?
            .label("held-out")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        chart
            .draw_series(held.iter().map(|&p| Circle::new(p, 4, RED.filled())))
            .map_err(draw_err(&file))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err(&file))?;
    root.present().map_err(draw_err(&file))?;
    drop(chart);
    drop(root);
    Ok(file)
}

/// Writes `time.svg` under `out`: for each rank, its seconds by kind of action over the
/// run (`per_rank[r]`), stacked in one bar.
pub fn time_bars(
    out: &Path,
    title: &str,
    per_rank: &[BTreeMap<String, f64>],
) -> anyhow::Result<PathBuf> {
    let file = out.join("time.svg");
    let kinds: Vec<&String> = {
        let mut k: Vec<&String> = per_rank.iter().flat_map(BTreeMap::keys).collect();
        k.sort();
        k.dedup();
        k
    };
    let top = per_rank.iter().map(|m| m.values().sum::<f64>()).fold(0.0f64, f64::max) * 1.45;
    let root = SVGBackend::new(&file, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(&file))?;
    let n = per_rank.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title}: time per rank by action"), ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(-0.5..n as f64 - 0.5, 0.0..top.max(1e-3))
        .map_err(draw_err(&file))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| format!("rank {}", x.round() as i64))
        .x_desc("rank")
        .y_desc("seconds over the run")
        .draw()
        .map_err(draw_err(&file))?;
    for (i, kind) in kinds.iter().enumerate() {
        let colour = Palette99::pick(i).to_rgba();
        let bars = per_rank.iter().enumerate().map(|(r, m)| {
            let below: f64 = kinds[..i].iter().map(|k| m.get(*k).copied().unwrap_or(0.0)).sum();
            let h = m.get(*kind).copied().unwrap_or(0.0);
            let x = r as f64;
            Rectangle::new([(x - 0.3, below), (x + 0.3, below + h)], colour.filled())
        });
        chart
            .draw_series(bars)
            .map_err(draw_err(&file))?
            .label(kind.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_err(&file))?;
    root.present().map_err(draw_err(&file))?;
    drop(chart);
    drop(root);
    Ok(file)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::losses;

    #[test]
    fn losses_come_from_step_and_heldout_lines_and_skip_nulls() {
        let m = [
            r#"{"step":0,"heldout":{"loss":6.5}}"#,
            r#"{"step":0,"loss":6.0}"#,
            r#"{"step":1,"loss":null,"nonfinite":["loss"]}"#,
            r#"{"step":2,"loss":4.0}"#,
            r#"{"step":3,"heldout":{"loss":4.5}}"#,
            "not json",
        ]
        .join("\n");
        let (train, held) = losses(&m);
        assert_eq!(train, vec![(0.0, 6.0), (2.0, 4.0)]);
        assert_eq!(held, vec![(0.0, 6.5), (3.0, 4.5)]);
    }
}
