//! Test support (feature `testing`): run an edge plan's forward and backward on any
//! communicator and compare with the symbolic executor, bitwise, and with the plan's bytes;
//! and a fixed set of plans for a given world size (the MPI runner uses both); the fault
//! cases' model and its injected faults (the local fault tests and the MPI runner).

use hetpar_comm::{CommExt, Communicator, Log, Recording};
use hetpar_layout::symbolic::{Label, execute, initial_state};
use hetpar_layout::{
    BatchManifest, Direction, EdgeGeometry, EdgePlan, Item, LayoutSpec, ModuleLayout, RowId,
    Sample, Span, Strategy,
};

use candle_core::Tensor;
use hetpar_layout::{Config, EdgeId, ItemRef, ModelGraph};

use crate::error::RuntimeError;
use crate::stages::encoder::ItemSource;
use crate::stages::llama::{TextBatch, TextSource};
use crate::synthetic::Synthetic;
use crate::{Groups, run_boundary};

/// Values per row in the checks.
pub const WIDTH: usize = 3;

/// An exactly representable f32 naming a row, the rank whose copy it is, and a column.
pub fn enc(row: RowId, origin: usize, col: usize) -> f32 {
    (((row.sample * 64 + row.token) * 128 + origin) * 8 + col) as f32
}

fn encode(labels: &[Option<Label>]) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity(labels.len() * WIDTH);
    for l in labels {
        let l = l.ok_or("the symbolic executor left a slot empty")?;
        out.extend((0..WIDTH).map(|c| enc(l.row, l.origin, c)));
    }
    Ok(out)
}

/// Runs both directions of `plan` on this rank of `comm` (a world communicator) and checks
/// the received rows and gradients bitwise against the symbolic executor, and the bytes this
/// rank sent and received against the plan's traffic.
pub fn check_boundary(comm: &dyn Communicator, plan: &EdgePlan, name: &str) -> Result<(), String> {
    let log = Log::new();
    let rec = Recording::new(Box::new(comm), log.clone());
    let rank = comm.global_rank();
    let geo = &plan.geometry;
    if !geo.held.contains_key(&rank) {
        return Ok(()); // not a rank of either module
    }
    let mut groups = Groups::new();
    groups.prepare(&rec, [&plan.forward, &plan.backward]).map_err(|e| format!("{name}: {e}"))?;
    let ids = |m: &std::collections::BTreeMap<usize, Vec<usize>>| -> Vec<RowId> {
        m.get(&rank).map(|v| v.iter().map(|&i| geo.rows[i].id).collect()).unwrap_or_default()
    };
    let (held_ids, needed_ids) = (ids(&geo.held), ids(&geo.needed));
    let fill = |ids: &[RowId]| -> Vec<f32> {
        ids.iter().flat_map(|&r| (0..WIDTH).map(move |c| enc(r, rank, c))).collect()
    };
    let run = |dir, held: &mut Vec<f32>, needed: &mut Vec<f32>| {
        run_boundary(&rec, &groups, plan, dir, name, WIDTH, 7, held, needed)
            .map_err(|e| format!("{name} {dir:?}: {e}"))
    };
    let (mut held, mut needed) = (fill(&held_ids), vec![0.0f32; needed_ids.len() * WIDTH]);
    run(Direction::Forward, &mut held, &mut needed)?;
    let want = execute(&plan.forward, initial_state(plan, Direction::Forward))?;
    if needed != encode(&want[&rank].needed)? {
        return Err(format!(
            "{name}: rank {rank} forward rows differ from the symbolic prediction"
        ));
    }
    let (mut held, mut needed) = (vec![0.0f32; held_ids.len() * WIDTH], fill(&needed_ids));
    run(Direction::Backward, &mut held, &mut needed)?;
    let want = execute(&plan.backward, initial_state(plan, Direction::Backward))?;
    if held != encode(&want[&rank].held)? {
        return Err(format!(
            "{name}: rank {rank} backward gradients differ from the symbolic prediction"
        ));
    }
    let (tf, tb) = (plan.forward.traffic(), plan.backward.traffic());
    let want = (
        (tf.sent[&rank] + tb.sent[&rank]) * WIDTH * 4,
        (tf.received[&rank] + tb.received[&rank]) * WIDTH * 4,
    );
    let got = log.bytes_by_rank().get(&rank).map_or((0, 0), |&(s, r)| (s as usize, r as usize));
    if got != want {
        return Err(format!(
            "{name}: rank {rank} moved {got:?} bytes (sent, received), the plan says {want:?}"
        ));
    }
    Ok(())
}

fn layout(
    name: &str,
    span: (usize, usize),
    tp: usize,
    cp: usize,
    pp: usize,
    sp: bool,
) -> ModuleLayout {
    let spec = LayoutSpec { tp, cp, pp, sp, ..LayoutSpec::default() };
    ModuleLayout::new(name, Span::new(span.0, span.1), spec).expect("fixed layouts are valid")
}

/// Plans for a world of `n` ranks (a multiple of 4): colocated fan-in, colocated into CP and
/// SP, non-colocated equal-DP and fan-in with pipeline stages, with every strategy that
/// applies; samples carry 0 to 9 rows.
pub fn fixed_plans(n: usize) -> Vec<(String, EdgePlan)> {
    assert!(n.is_multiple_of(4), "fixed plans need a multiple of 4 ranks, got {n}");
    let h = n / 2;
    let pairs = [
        ("fan-in", layout("enc", (0, n), 1, 1, 1, false), layout("llm", (0, n), n, 1, 1, false)),
        ("cp-sp", layout("enc", (0, n), 2, 1, 1, true), layout("llm", (0, n), 2, 2, 1, true)),
        ("islands", layout("enc", (0, h), 1, 1, 1, false), layout("llm", (h, n), 2, 1, 1, false)),
        (
            "islands-pp",
            layout("enc", (0, h), 1, 1, 2, false),
            layout("llm", (h, n), 1, 1, 2, false),
        ),
    ];
    let samples: Vec<Sample> = (0..2 * n)
        .map(|s| {
            let rows = (s * 5) % 10;
            Sample {
                len: 32,
                items: if rows == 0 {
                    vec![]
                } else {
                    vec![Item { edge: 0, pos: 1 + s % 4, rows }]
                },
            }
        })
        .collect();
    let manifest = BatchManifest::new(32, 1, 1, samples).expect("fixed manifest is valid");
    let mut out = Vec::new();
    for (name, src, dst) in pairs {
        let geo = EdgeGeometry::new(&src, &dst, &manifest, 0, 0);
        let max_stripes = src.stage_width().min(dst.stage_width());
        let mode = if src.span() == dst.span() {
            hetpar_layout::PlacementMode::Colocated
        } else {
            hetpar_layout::PlacementMode::NonColocated
        };
        for s in Strategy::all_for(mode, max_stripes) {
            out.push((format!("{name} {s}"), EdgePlan::new(geo.clone(), s)));
        }
    }
    out
}

/// Compares two runs' step reports: loss, global gradient norm and each module's norm
/// within `tol` relative, step by step.
pub fn compare_steps(
    what: &str,
    got: &[crate::StepReport],
    want: &[crate::StepReport],
    tol: f64,
) -> Result<(), String> {
    // Equal values (a frozen module's zero norm in both) differ by nothing.
    let rel = |a: f64, b: f64| if a == b { 0.0 } else { (a - b).abs() / b.abs() };
    for (s, (a, b)) in got.iter().zip(want).enumerate() {
        let norms = a.module_norms.iter().zip(&b.module_norms).all(|(x, y)| rel(*x, *y) <= tol);
        if rel(a.loss, b.loss) > tol || rel(a.grad_norm, b.grad_norm) > tol || !norms {
            return Err(format!(
                "{what} step {s}: loss {} vs {}, norm {} vs {}, module norms {:?} vs {:?}",
                a.loss, b.loss, a.grad_norm, b.grad_norm, a.module_norms, b.module_norms
            ));
        }
    }
    Ok(())
}

/// Compares every parameter reassembled from `got` with `want` by the norm of the
/// difference over the norm.
pub fn compare_values(
    what: &str,
    got: &[hetpar_nn::testing::RankReport],
    want: &std::collections::BTreeMap<String, hetpar_nn::testing::Global>,
    tol: f64,
) -> Result<(), String> {
    let params = hetpar_nn::testing::assemble(got, 0.0).map_err(|e| format!("{what}: {e}"))?;
    for (name, r) in want {
        let g = params.get(name).ok_or_else(|| format!("{what}: no parameter {name}"))?;
        let e = hetpar_nn::testing::norm_rel(&g.values, &r.values);
        if e > tol || e.is_nan() {
            return Err(format!("{what}: {name} differs by {e:e} (tolerance {tol:e})"));
        }
    }
    Ok(())
}

/// The fault cases' model: a ViT into an LLM at tp2, colocated on ranks 0-1 or with the
/// encoder on its own island (rank 0, the LLM on 1-2).
pub fn fault_graph(islands: bool) -> ModelGraph {
    let text = fault_config(islands);
    ModelGraph::from_config(&Config::from_toml(&text).expect("valid TOML")).expect("a valid graph")
}

/// The TOML of [`fault_graph`].
pub fn fault_config(islands: bool) -> String {
    let (vision, llm) = if islands { ("[0, 1]", "[1, 3]") } else { ("[0, 2]", "[0, 2]") };
    format!(
        r#"
name = "faults"
[train]
steps = 2
global_batch = 4
microbatches = 2
seq_len = 40
[modules.vision]
kind = "vit"
image_size = 16
patch_size = 4
hidden = 32
layers = 1
heads = 4
ffn = 48
[modules.vision.parallel]
ranks = {vision}
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = 2
heads = 4
kv_heads = 4
ffn = 48
[modules.llm.parallel]
ranks = {llm}
tp = 2
[[edges]]
from = "vision"
to = "llm"
"#
    )
}

/// Synthetic inputs, with a fault at the first item of step `at`: NaN pixels, or a panic.
#[derive(Debug)]
pub struct Faulty {
    /// The inputs without the fault.
    pub inner: Synthetic,
    /// The step that meets the fault.
    pub at: usize,
    /// Panic instead of NaN pixels.
    pub panic: bool,
}

impl ItemSource for Faulty {
    fn item(
        &self,
        step: usize,
        m: &BatchManifest,
        edge: EdgeId,
        item: ItemRef,
    ) -> Result<Tensor, RuntimeError> {
        let x = self.inner.item(step, m, edge, item)?;
        if step != self.at || m.microbatch_items(edge, 0).first() != Some(&item) {
            return Ok(x);
        }
        if self.panic {
            panic!("injected fault in the encoder");
        }
        Ok((x * f64::NAN)?)
    }
}

/// Synthetic text that fails at step `at` with an error (on the rank that owns it).
#[derive(Debug)]
pub struct FailingText {
    /// The text without the fault.
    pub inner: Synthetic,
    /// The step that fails.
    pub at: usize,
}

impl TextSource for FailingText {
    fn text(&self, step: usize, manifest: &BatchManifest) -> Result<TextBatch, RuntimeError> {
        if step == self.at {
            return Err(RuntimeError::Model("injected error in the LLM's data".into()));
        }
        self.inner.text(step, manifest)
    }
}
