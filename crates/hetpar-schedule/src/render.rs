//! Timelines people read: a text grid (one row per rank, one column per unit time slot) and
//! an SVG picture with modules coloured.

use std::fmt::Write as _;

use crate::action::{Action, Pass};
use crate::build::Schedule;
use crate::validate::Timeline;

/// The grid of a schedule simulated with unit durations: each action that takes time
/// occupies its working slots, waiting shows as `.`; each row starts with the rank's idle
/// slots.
pub fn text_grid(s: &Schedule, t: &Timeline) -> String {
    let slots = t.makespan.round() as usize;
    let mut rows: Vec<(usize, Vec<String>)> = Vec::new();
    for (&rank, actions) in &s.ranks {
        let mut cells = vec![String::new(); slots];
        for (a, &(_, end, busy)) in actions.iter().zip(&t.spans[&rank]) {
            let (from, to) = ((end - busy).round() as usize, end.round() as usize);
            let label = s.labels.cell(a);
            for cell in cells.iter_mut().take(to).skip(from) {
                cell.clone_from(&label);
            }
        }
        rows.push((rank, cells));
    }
    let width = rows.iter().flat_map(|(_, c)| c.iter().map(String::len)).max().unwrap_or(1).max(1);
    let rank_width = rows.last().map_or(1, |(r, _)| r.to_string().len());
    let idle_width = slots.to_string().len();
    let mut out = String::new();
    for (rank, cells) in rows {
        let idle = (t.makespan - t.busy(rank)).round() as usize;
        let body: Vec<String> = cells
            .iter()
            .map(|c| format!("{:<width$}", if c.is_empty() { "." } else { c }))
            .collect();
        let body = body.join(" ");
        writeln!(out, "rank {rank:>rank_width$} idle {idle:>idle_width$} | {}", body.trim_end())
            .expect("string");
    }
    out
}

const PALETTE: [&str; 6] = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2"];

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// An SVG timeline: a lane per rank, a box per action that takes time, coloured by module
/// (forward light, backward dark), boundary transforms grey, reductions and steps dark grey.
pub fn svg(s: &Schedule, t: &Timeline, title: &str) -> String {
    let (left, top, lane, scale) = (70.0, 40.0, 22.0, (1000.0 / t.makespan.max(1e-9)).min(60.0));
    let width = left + t.makespan * scale + 20.0;
    let height = top + s.ranks.len() as f64 * lane + 60.0;
    let mut out = String::new();
    writeln!(out, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" font-family="monospace" font-size="10">"#).expect("string");
    writeln!(out, r#"<text x="{left}" y="20" font-size="13">{}</text>"#, escape(title))
        .expect("string");
    for (lane_idx, (&rank, actions)) in s.ranks.iter().enumerate() {
        let y = top + lane_idx as f64 * lane;
        writeln!(out, r#"<text x="5" y="{:.1}">rank {rank}</text>"#, y + lane * 0.65)
            .expect("string");
        for (a, &(_, end, busy)) in actions.iter().zip(&t.spans[&rank]) {
            if busy <= 0.0 {
                continue;
            }
            let (fill, opacity) = match a {
                Action::Compute(c) => (
                    PALETTE[c.module % PALETTE.len()],
                    if c.pass == Pass::Forward { 0.55 } else { 1.0 },
                ),
                _ if a.has_boundary() => ("#9c9c9c", 1.0),
                _ => ("#555555", 1.0),
            };
            let x = left + (end - busy) * scale;
            let w = busy * scale;
            let text = s.labels.cell(a);
            let label = escape(&text);
            writeln!(out, r#"<rect x="{x:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{fill}" fill-opacity="{opacity}" stroke="white"><title>rank {rank}: {}</title></rect>"#, y + 2.0, w.max(0.5), lane - 4.0, escape(&s.labels.action(a))).expect("string");
            if w >= 7.0 * label.len() as f64 {
                writeln!(
                    out,
                    r#"<text x="{:.1}" y="{:.1}" fill="black">{label}</text>"#,
                    x + 2.0,
                    y + lane * 0.65
                )
                .expect("string");
            }
        }
    }
    let legend_y = top + s.ranks.len() as f64 * lane + 25.0;
    let mut x = left;
    let mut entries: Vec<(String, &str)> = s
        .labels
        .modules
        .iter()
        .enumerate()
        .map(|(m, name)| (name.clone(), PALETTE[m % PALETTE.len()]))
        .collect();
    entries.push(("boundary".into(), "#9c9c9c"));
    entries.push(("reduce/step".into(), "#555555"));
    for (name, fill) in entries {
        writeln!(out, r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{fill}"/><text x="{:.1}" y="{:.1}">{}</text>"#, legend_y - 10.0, x + 16.0, legend_y, escape(&name)).expect("string");
        x += 30.0 + 7.0 * name.len() as f64;
    }
    writeln!(
        out,
        r#"<text x="{left}" y="{:.1}">step time {:.3}; forward light, backward dark</text>"#,
        legend_y + 22.0,
        t.makespan
    )
    .expect("string");
    out.push_str("</svg>\n");
    out
}
