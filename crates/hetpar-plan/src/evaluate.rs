//! Predicting a candidate: per-module costs, memory, and the step time from simulating the
//! candidate's schedule.
//!
//! The schedule is the one `hetpar-schedule` builds for the candidate, collapsed to one rank
//! per pipeline stage (every tp/cp/dp position of a stage runs the same actions at the same
//! times): three-phase when encoders share the LLM's ranks, graph-aware 1F1B on islands,
//! plain or interleaved 1F1B for the homogeneous baseline, whose encoders run inside the
//! LLM's first stage. Action durations come from [`crate::cost`], boundary transfers from the
//! routing plans ([`crate::boundary`]), so bubbles, three-phase serialization and island
//! imbalance come out of the simulated schedule.

use hetpar_layout::{LayoutSpec, ModuleLayout, Span};
use hetpar_schedule::{
    Action, Durations, MsgId, Options, Pass, PipeModule, PipelineGraph, Schedule, simulate,
};

use crate::boundary::BoundaryCache;
use crate::candidate::{Candidate, Choice, Kind, Memory, Prediction};
use crate::cost::{ACT_BYTES, PassTime, Run};
use crate::error::{PlanError, Result};
use crate::hardware::{GIB, Hardware};
use crate::workload::Workload;

/// Evaluates candidates of one workload on one machine; caches boundary plans.
#[derive(Debug)]
pub struct Evaluator<'a> {
    /// The workload.
    pub wl: &'a Workload,
    /// The machine.
    pub hw: &'a Hardware,
    boundary: BoundaryCache,
}

/// Costs of one module in the collapsed schedule.
#[derive(Clone, Debug, Default)]
struct ModCost {
    start: usize,
    pp: usize,
    vstage: Vec<PassTime>,
    p2p: f64,
    reduce: Vec<f64>,
    step: Vec<f64>,
}

impl ModCost {
    /// The costs of `r` on `hw`, its first stage on collapsed rank `start`.
    fn of(r: &Run<'_>, hw: &Hardware, start: usize) -> Self {
        let vstage: Vec<PassTime> = (0..r.pp * r.vpp).map(|v| r.vstage(hw, v)).collect();
        ModCost {
            start,
            pp: r.pp,
            p2p: r.p2p(hw),
            reduce: (0..r.pp).map(|s| r.reduce(hw, s, &vstage)).collect(),
            step: (0..r.pp).map(|s| r.step(hw, s)).collect(),
            vstage,
        }
    }

    fn stage(&self, rank: usize) -> usize {
        if self.pp == 1 { 0 } else { rank - self.start }
    }

    /// Stage `s`'s own work in a step of `m` microbatches: its passes, its exposed
    /// reduction and its optimizer step.
    fn busy(&self, s: usize, m: f64) -> f64 {
        let passes: f64 = (0..self.vstage.len())
            .filter(|v| v % self.pp == s)
            .map(|v| self.vstage[v].fwd + self.vstage[v].bwd)
            .sum();
        m * passes + self.reduce[s] + self.step[s]
    }

    /// The busiest stage's own work in a step of `m` microbatches.
    fn busiest(&self, m: f64) -> f64 {
        (0..self.pp).map(|s| self.busy(s, m)).fold(0.0, f64::max)
    }
}

/// A candidate with its costs and memory, ready to simulate.
#[derive(Debug)]
pub struct Prepared {
    /// The candidate.
    pub candidate: Candidate,
    modules: Vec<ModCost>,
    /// Largest memory per GPU.
    pub memory: Memory,
    /// The busiest rank's work: no schedule of the candidate is shorter.
    pub lower_bound: f64,
}

struct SimCosts {
    modules: Vec<ModCost>,
    boundary: Vec<[f64; 2]>,
}

impl Durations for SimCosts {
    fn action(&self, rank: usize, action: &Action) -> f64 {
        match action {
            Action::Compute(c) => {
                let t = self.modules[c.module].vstage[c.vstage];
                match c.pass {
                    Pass::Forward => t.fwd,
                    Pass::Backward => t.bwd,
                }
            }
            Action::Step(m) => {
                let mc = &self.modules[*m];
                mc.step[mc.stage(rank)]
            }
            // Host copies run on their own engine while the LLM pipeline computes.
            _ => 0.0,
        }
    }

    fn message(&self, msg: &MsgId) -> f64 {
        match *msg {
            MsgId::Act { module, .. } | MsgId::Grad { module, .. } => self.modules[module].p2p,
            MsgId::Boundary { edge, dir, .. } => {
                self.boundary[edge][usize::from(dir == hetpar_layout::Direction::Backward)]
            }
            MsgId::Reduce { module, group } => {
                let mc = &self.modules[module];
                mc.reduce[mc.stage(group)]
            }
        }
    }
}

impl<'a> Evaluator<'a> {
    /// An evaluator with an empty cache.
    pub fn new(wl: &'a Workload, hw: &'a Hardware) -> Self {
        Evaluator { wl, hw, boundary: BoundaryCache::default() }
    }

    /// The LLM's run in `c`, its layers split evenly over the virtual stages (a homogeneous
    /// LLM's first stage also runs the encoders, which overloads it, as in Megatron).
    pub fn llm_run(&self, c: &Candidate) -> Run<'a> {
        self.llm_run_of(&c.llm, c.microbatches)
    }

    /// [`Self::llm_run`] of layout `l` with `microbatches` microbatches a step.
    fn llm_run_of(&self, l: &Choice, microbatches: usize) -> Run<'a> {
        Run {
            shape: &self.wl.llm,
            tp: l.tp,
            cp: l.cp,
            dp: l.dp(),
            pp: l.pp,
            vpp: l.vpp,
            ep: l.ep,
            recompute: f64::from(l.recompute) / 4.0,
            tokens: l.samples(self.wl, microbatches) * self.wl.seq_len as f64,
            seq: self.wl.seq_len,
            rows: 0.0,
            cp_split: true,
            sp: true,
        }
    }

    /// Encoder `i`'s run in `c` (in a homogeneous candidate: with the LLM's tp and cp, on
    /// its first stage, every CP rank repeating the work). Its replicas split the items of a
    /// microbatch in contiguous ranges (SEMANTICS.md section 3), so the busiest replica,
    /// which every collective after it waits for, encodes `ceil(n / dp)` of the `n` items.
    pub fn encoder_run(&self, c: &Candidate, i: usize) -> Run<'a> {
        self.encoder_run_of(c.kind, i, (&c.encoders[i], &c.llm), c.microbatches)
    }

    /// [`Self::encoder_run`] of encoder `i` laid out as `ch` next to LLM layout `l` in a
    /// candidate of `kind` with `microbatches` microbatches a step.
    fn encoder_run_of(
        &self,
        kind: Kind,
        i: usize,
        (ch, l): (&Choice, &Choice),
        microbatches: usize,
    ) -> Run<'a> {
        let e = &self.wl.encoders[i];
        let mb = self.wl.global_batch as f64 / microbatches as f64;
        let (tp, cp, dp, pp, split) = match kind {
            Kind::Homogeneous => (l.tp, l.cp, l.dp(), 1, false),
            _ => (ch.tp, ch.cp, ch.dp(), ch.pp, true),
        };
        // Whole items per microbatch; a workload with items has at least one per microbatch.
        let n_items = ((e.items_per_sample * mb).round() as usize).max(1);
        let items = n_items.div_ceil(dp) as f64;
        Run {
            shape: &e.shape,
            tp,
            cp,
            dp,
            pp,
            vpp: 1,
            ep: 1,
            recompute: f64::from(match kind {
                Kind::Homogeneous => l.recompute,
                _ => ch.recompute,
            }) / 4.0,
            tokens: items * e.seq as f64,
            seq: e.seq,
            rows: items * e.rows_per_item as f64,
            cp_split: split,
            sp: split,
        }
    }

    /// Checks that `c` is a layout the model can run: sizes divide the shapes and spans.
    pub fn check(&self, c: &Candidate) -> Result<()> {
        let bad = |m: String| Err(PlanError(m));
        let wl = self.wl;
        let world = if c.kind == Kind::NonColocated {
            c.llm.ranks() + c.encoders.iter().map(Choice::ranks).sum::<usize>()
        } else {
            c.llm.ranks()
        };
        if world != wl.gpus {
            return bad(format!("candidate uses {world} GPUs, the cluster has {}", wl.gpus));
        }
        let l = &c.llm;
        check_choice(&wl.llm_name, l, &wl.llm, wl.seq_len)?;
        if l.vpp > 1 && l.pp == 1 {
            return bad("vpp needs pp > 1".into());
        }
        if l.vpp > 1 && !c.microbatches.is_multiple_of(l.pp) {
            return bad(format!(
                "interleaving needs microbatches({}) divisible by pp({})",
                c.microbatches, l.pp
            ));
        }
        if l.pp * l.vpp > wl.llm.layers {
            return bad(format!("pp*vpp {} is more than {} layers", l.pp * l.vpp, wl.llm.layers));
        }
        if wl.llm.experts > 0
            && (!wl.llm.experts.is_multiple_of(l.ep)
                || !(l.tp * l.cp * l.dp()).is_multiple_of(l.ep))
        {
            return bad(format!("ep({}) must divide experts and tp*cp*dp", l.ep));
        }
        if wl.llm.experts == 0 && l.ep != 1 {
            return bad("ep needs experts".into());
        }
        if c.microbatches == 0 || !wl.global_batch.is_multiple_of(c.microbatches * l.dp()) {
            return bad(format!(
                "global_batch({}) does not split into {} microbatches over dp({})",
                wl.global_batch,
                c.microbatches,
                l.dp()
            ));
        }
        for (i, ch) in c.encoders.iter().enumerate() {
            let e = &wl.encoders[i];
            if c.kind == Kind::Homogeneous {
                // Costed at cp 1 (each CP rank encodes its items whole), but written on the
                // LLM's grid, its cp included, so its items' rows must split as a config
                // requires there.
                check_choice(
                    &e.shape.name,
                    &Choice { tp: l.tp, cp: l.cp, ..*ch },
                    &e.shape,
                    e.seq,
                )?;
                continue;
            }
            check_choice(&e.shape.name, ch, &e.shape, e.seq)?;
            if ch.pp > e.shape.layers {
                return bad(format!("{}: pp({}) is more than its layers", e.shape.name, ch.pp));
            }
            if c.kind == Kind::Colocated && (ch.start, ch.end, ch.pp) != (l.start, l.end, 1) {
                return bad(format!(
                    "{}: a colocated encoder spans the LLM's ranks with pp 1",
                    e.shape.name
                ));
            }
        }
        Ok(())
    }

    /// Costs, memory and a lower bound on the step time of `c`, without boundary plans or
    /// simulation (cheap enough for every candidate of a search).
    pub fn prepare(&self, c: &Candidate) -> Result<Prepared> {
        self.check(c)?;
        let hw = self.hw;
        let llm = self.llm_run(c);
        let encs: Vec<Run<'a>> = (0..c.encoders.len()).map(|i| self.encoder_run(c, i)).collect();
        let m = c.microbatches as f64;
        let module_cost = |r: &Run<'_>, start: usize| ModCost::of(r, hw, start);
        let mut modules = Vec::new();
        match c.kind {
            Kind::Homogeneous => {
                let mut mc = module_cost(&llm, 0);
                for r in &encs {
                    let pass = r.vstage(hw, 0);
                    mc.vstage[0] = mc.vstage[0] + pass;
                    mc.reduce[0] += r.reduce(hw, 0, &[pass]);
                    mc.step[0] += r.step(hw, 0);
                }
                modules.push(mc);
            }
            Kind::Colocated => {
                modules.extend(encs.iter().map(|r| module_cost(r, 0)));
                modules.push(module_cost(&llm, 0));
            }
            Kind::NonColocated => {
                let mut next = 0;
                for r in &encs {
                    modules.push(module_cost(r, next));
                    next += r.pp;
                }
                modules.push(module_cost(&llm, next));
            }
        }
        // No schedule beats, on any LLM rank `s`, its own work plus the forwards of
        // microbatch 0 on the virtual stages before it (its first forward waits for them)
        // and, outside the three-phase schedule, their backwards of the last microbatch
        // (they run after its last backward). Islands also wait for the encoders' first
        // forward. Encoder ranks bound by their own work.
        let busy = |mc: &ModCost, s: usize| mc.busy(s, m);
        let n_enc = modules.len() - 1;
        let llm_cost = &modules[n_enc];
        let enc_on_llm_ranks: f64 = match c.kind {
            Kind::Colocated => modules[..n_enc].iter().map(|mc| busy(mc, 0)).sum(),
            _ => 0.0,
        };
        let enc_first: f64 = match c.kind {
            Kind::NonColocated => modules[..n_enc]
                .iter()
                .map(|mc| mc.vstage.iter().map(|t| t.fwd).sum::<f64>())
                .fold(0.0, f64::max),
            _ => 0.0,
        };
        let mut lower_bound: f64 = (0..llm.pp)
            .map(|s| {
                let front: f64 = llm_cost.vstage[..s].iter().map(|t| t.fwd).sum();
                let back: f64 = if c.kind == Kind::Colocated {
                    0.0
                } else {
                    llm_cost.vstage[..s].iter().map(|t| t.bwd).sum()
                };
                enc_first + front + busy(llm_cost, s) + enc_on_llm_ranks + back
            })
            .fold(0.0, f64::max);
        if c.kind == Kind::NonColocated {
            for mc in &modules[..n_enc] {
                lower_bound = (0..mc.pp).map(|s| busy(mc, s)).fold(lower_bound, f64::max);
            }
        }
        let memory = self.memory(c, &llm, &encs);
        Ok(Prepared { candidate: c.clone(), modules, memory, lower_bound })
    }

    /// A lower bound on the step time of every non-colocated candidate with `microbatches`
    /// microbatches that lays encoder `i` out as `ch` on its island: the busiest island
    /// stage's own work without recomputation (which only adds work), which
    /// [`Self::prepare`]'s bound never falls below.
    pub fn island_bound(&self, i: usize, ch: &Choice, microbatches: usize) -> f64 {
        let ch = Choice { recompute: 0, ..*ch };
        let r = self.encoder_run_of(Kind::NonColocated, i, (&ch, &ch), microbatches);
        ModCost::of(&r, self.hw, 0).busiest(microbatches as f64)
    }

    /// As [`Self::island_bound`], for the LLM laid out as `l` (any placement: the LLM's
    /// ranks run at least their own work).
    pub fn llm_bound(&self, l: &Choice, microbatches: usize) -> f64 {
        let l = Choice { recompute: 0, ..*l };
        let r = self.llm_run_of(&l, microbatches);
        ModCost::of(&r, self.hw, 0).busiest(microbatches as f64)
    }

    /// `c` prepared with the least LLM recomputation (quarters 0 to 4) that fits memory,
    /// its encoders recomputing `enc` quarters; more recomputation only costs time, so no
    /// other level is worth simulating. `Ok(None)` when even full recomputation does not
    /// fit; an error when `c` is not a valid layout.
    pub fn least_recompute(&self, mut c: Candidate, enc: u8) -> Result<Option<Prepared>> {
        for e in &mut c.encoders {
            e.recompute = enc;
        }
        for llm in 0..=4u8 {
            c.llm.recompute = llm;
            let p = self.prepare(&c)?;
            if p.memory.total() <= self.hw.memory_bytes() {
                return Ok(Some(p));
            }
        }
        Ok(None)
    }

    /// Predicts `c`: step time from the simulated schedule, memory, throughput.
    pub fn evaluate(&mut self, c: &Candidate) -> Result<Prediction> {
        let p = self.prepare(c)?;
        self.finish(p)
    }

    /// Builds the boundary plans and the schedule of a prepared candidate and simulates it.
    pub fn finish(&mut self, p: Prepared) -> Result<Prediction> {
        let Prepared { candidate: c, modules, memory, .. } = p;
        let hw = self.hw;
        let m = c.microbatches;
        let layout = |name: &str, mc: &ModCost, n: usize| {
            ModuleLayout::new(
                name,
                Span::new(mc.start, mc.start + n),
                LayoutSpec { pp: mc.pp, ..LayoutSpec::default() },
            )
            .map_err(PlanError::from)
        };
        let llm_mc = modules.last().expect("the LLM");
        let mut pipe = Vec::new();
        let mut edges = Vec::new();
        let mut boundary = Vec::new();
        if c.kind != Kind::Homogeneous {
            for (i, mc) in modules[..modules.len() - 1].iter().enumerate() {
                let name = &self.wl.encoders[i].shape.name;
                let n = if c.kind == Kind::Colocated { llm_mc.pp } else { mc.pp };
                pipe.push(PipeModule {
                    name: name.clone(),
                    layout: layout(name, mc, n)?,
                    vpp: 1,
                    offload: c.encoders[i].offload,
                    trainable: true,
                });
                edges.push((i, modules.len() - 1));
                boundary.push(self.boundary.times(self.wl, hw, i, &c)?);
            }
        }
        pipe.push(PipeModule {
            name: self.wl.llm_name.clone(),
            layout: layout(&self.wl.llm_name, llm_mc, llm_mc.pp)?,
            vpp: c.llm.vpp,
            offload: false,
            trainable: true,
        });
        let costs = SimCosts { modules, boundary };
        let graph = PipelineGraph::new(pipe, edges, m).map_err(|e| PlanError(e.to_string()))?;
        let schedule =
            Schedule::build(&graph, Options::default()).map_err(|e| PlanError(e.to_string()))?;
        let timeline = simulate(&schedule, &costs).map_err(|e| PlanError(e.to_string()))?;
        let step = timeline.makespan;
        let mut busy = Vec::new();
        for (id, mc) in costs.modules.iter().enumerate() {
            let (mut work, mut comm) = (0.0f64, 0.0f64);
            for s in 0..mc.pp {
                let passes: Vec<usize> = (0..mc.vstage.len()).filter(|v| v % mc.pp == s).collect();
                let w: f64 =
                    passes.iter().map(|&v| mc.vstage[v].fwd + mc.vstage[v].bwd).sum::<f64>()
                        * m as f64;
                let cm: f64 = passes.iter().map(|&v| mc.vstage[v].comm).sum::<f64>() * m as f64;
                if w > work {
                    (work, comm) = (w, cm);
                }
            }
            busy.push((graph.modules()[id].name.clone(), work, comm));
        }
        let boundary_s = costs.boundary.iter().map(|b| (b[0] + b[1]) * m as f64).sum();
        let flops = self.wl.step_flops();
        Ok(Prediction {
            step_time_s: step,
            tflops_per_gpu: flops / step / self.wl.gpus as f64 / 1e12,
            tokens_per_s: self.wl.step_tokens() / step,
            fits: memory.total() <= hw.memory_bytes(),
            memory,
            bubble: timeline.bubble_fraction(),
            busy,
            boundary_s,
        })
    }

    /// Largest memory per GPU over the candidate's ranks.
    pub fn memory(&self, c: &Candidate, llm: &Run<'_>, encs: &[Run<'_>]) -> Memory {
        let m = c.microbatches;
        let overhead = self.hw.efficiency.overhead_gib * GIB;
        let mut worst = Memory::default();
        let mut consider = |mem: Memory| {
            if mem.total() > worst.total() {
                worst = mem;
            }
        };
        let step_rows: Vec<f64> = self
            .wl
            .encoders
            .iter()
            .map(|e| e.rows_per_sample() * self.wl.global_batch as f64)
            .collect();
        let h_llm = self.wl.llm.hidden as f64;
        for s in 0..llm.pp {
            let mut mem = Memory {
                states: states(llm, s),
                activations: activations(llm, s, in_flight(llm, s, m, 0)),
                buffers: logits(llm, s),
                overhead,
            };
            match c.kind {
                Kind::Homogeneous => {
                    if s == 0 {
                        for r in encs {
                            mem.states += states(r, 0);
                            mem.activations += activations(r, 0, in_flight(llm, 0, m, 0));
                        }
                    }
                    consider(mem);
                }
                Kind::Colocated => {
                    // Boundary leaves of the whole step: encoder outputs and the LLM's
                    // received rows, each with its gradient.
                    let mut leaves = 0.0;
                    for (i, r) in encs.iter().enumerate() {
                        // The busiest encoder replica's rows of every microbatch.
                        let held = r.rows * m as f64 / (r.tp * r.cp) as f64;
                        leaves += held * h_llm * ACT_BYTES * 2.0;
                        if s == 0 {
                            leaves += step_rows[i] / (llm.dp * llm.tp * llm.cp) as f64
                                * h_llm
                                * ACT_BYTES
                                * 2.0;
                        }
                    }
                    let mut phase2 = mem;
                    phase2.buffers += leaves;
                    let mut phase3 = Memory {
                        states: states(llm, s),
                        activations: 0.0,
                        buffers: leaves,
                        overhead,
                    };
                    for r in encs {
                        // Phase 1 keeps every microbatch's saved tensors until phase 3,
                        // which also needs one layer's working set when recomputing.
                        let kept = saved(r, 0) * m as f64;
                        phase2.activations += kept;
                        phase3.activations += kept + working(r);
                        phase3.states += states(r, 0);
                    }
                    for (i, r) in encs.iter().enumerate() {
                        if !c.encoders[i].offload {
                            phase2.states += states(r, 0);
                        }
                    }
                    consider(phase2);
                    consider(phase3);
                }
                Kind::NonColocated => consider(mem),
            }
        }
        if c.kind == Kind::NonColocated {
            for r in encs {
                for s in 0..r.pp {
                    consider(Memory {
                        states: states(r, s),
                        activations: activations(r, s, in_flight(r, s, m, llm.pp)),
                        buffers: 0.0,
                        overhead,
                    });
                }
            }
        }
        worst
    }
}

/// Divisibility of one module's tp and cp by its shape and sequence.
fn check_choice(
    name: &str,
    ch: &Choice,
    shape: &crate::model::ModuleShape,
    seq: usize,
) -> Result<()> {
    let bad = |m: String| Err(PlanError(format!("{name}: {m}")));
    if ch.tp == 0 || ch.cp == 0 || ch.pp == 0 || ch.vpp == 0 || ch.ep == 0 {
        return bad("sizes must be at least 1".into());
    }
    if !ch.ranks().is_multiple_of(ch.tp * ch.cp * ch.pp) || ch.ranks() == 0 {
        return bad(format!(
            "tp*cp*pp = {} does not divide {} ranks",
            ch.tp * ch.cp * ch.pp,
            ch.ranks()
        ));
    }
    // As a config requires (hetpar-layout): tp splits whole query and key/value heads.
    if !shape.heads.is_multiple_of(ch.tp) || !shape.kv_heads.is_multiple_of(ch.tp) {
        return bad(format!(
            "tp({}) does not split {} heads ({} kv)",
            ch.tp, shape.heads, shape.kv_heads
        ));
    }
    if !shape.ffn.is_multiple_of(ch.tp) || (shape.vocab > 0 && !shape.vocab.is_multiple_of(ch.tp)) {
        return bad(format!("tp({}) does not divide ffn or vocab", ch.tp));
    }
    // As a config requires: the LLM's sequence in 2*cp load-balanced chunks where cp > 1,
    // each rank's share of it split over tp by sequence parallelism.
    let chunks = if shape.encoder || ch.cp == 1 { ch.cp } else { 2 * ch.cp };
    if !seq.is_multiple_of(chunks) || !(seq / ch.cp).is_multiple_of(ch.tp) {
        return bad(format!("sequence {seq} does not split over cp({}) x tp({})", ch.cp, ch.tp));
    }
    Ok(())
}

/// Weights, gradients and distributed-optimizer state of stage `s` on one rank.
fn states(r: &Run<'_>, s: usize) -> f64 {
    let (params, experts) = r.stage_params(s);
    let d = (r.dp * r.cp) as f64;
    let edp = ((r.dp * r.cp * r.tp) as f64 / r.ep as f64).max(1.0);
    (params - experts) * (6.0 + 12.0 / d) + experts * (6.0 + 12.0 / edp)
}

/// Tensors one microbatch leaves saved on stage `s` of one rank (all its virtual stages):
/// every layer's activations, or for recomputed layers only their input.
fn saved(r: &Run<'_>, s: usize) -> f64 {
    let layers: f64 = (0..r.vpp).map(|c| r.vstage_layers(c * r.pp + s) as f64).sum();
    let tokens = r.local_tokens();
    let full = tokens * r.per_rank(r.shape.layer_activation_bytes());
    // A recomputed layer keeps its input, split over tp only under sequence parallelism.
    let h = r.shape.hidden as f64 * ACT_BYTES;
    let input = tokens * if r.sp { h / r.tp as f64 } else { h };
    layers * (r.recompute * input + (1.0 - r.recompute) * full)
}

/// One layer's activations, live while a recomputed layer runs its backward.
fn working(r: &Run<'_>) -> f64 {
    if r.recompute > 0.0 {
        r.local_tokens() * r.per_rank(r.shape.layer_activation_bytes())
    } else {
        0.0
    }
}

/// Activations of stage `s` with `in_flight` microbatches in flight.
fn activations(r: &Run<'_>, s: usize, in_flight: f64) -> f64 {
    saved(r, s) * in_flight + working(r)
}

/// Microbatches whose activations stage `s` holds at once under 1F1B (`downstream` more
/// stages after this module: an encoder island feeding the LLM's pipeline).
fn in_flight(r: &Run<'_>, s: usize, m: usize, downstream: usize) -> f64 {
    let plain = m.min(r.pp - s + downstream) as f64;
    if r.vpp > 1 { plain * (1.0 + (r.pp - 1) as f64 / (r.pp * r.vpp) as f64) } else { plain }
}

/// fp32 logits and their gradient on the LLM's last stage.
fn logits(r: &Run<'_>, s: usize) -> f64 {
    if r.shape.encoder || s + 1 != r.pp {
        return 0.0;
    }
    r.local_tokens() / r.tp as f64 * r.shape.vocab as f64 * 4.0 * 2.0
}
