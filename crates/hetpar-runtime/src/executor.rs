//! The executor: walks one rank's action list of a step as the schedule gives it, and
//! derives nothing. Forward and backward call the rank's [`Stage`]s; communication actions
//! post their messages as one batch (`Communicator::batch_p2p`), then run the boundary
//! transforms they carry (each edge's routing plan, in edge order); reductions and
//! optimizer steps run the step's gradient side. On the destination's first stage the
//! rows an edge delivered are leaves at their slots; after its backward their gradients go
//! back through the edge's backward program and seed the source's last stage. Received activations become leaves whose gradients
//! go back; a stage's backward is seeded with the gradient its output received, plus the
//! loss it added to the objective.
//!
//! The first optimizer step on a rank joins one job-wide sum (the squared gradient norm's
//! shares, the reported loss, the count of non-finite gradients): every rank reaches it
//! after its own reductions, so it needs no place in the schedule.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use candle_core::{DType, Device, Tensor, Var, WithDType};
use hetpar_comm::{CommExt, Communicator, Element, P2p, ReduceOp};
use hetpar_layout::{Direction, EdgeId, ModuleId};
use hetpar_nn::Param;
use hetpar_schedule::{Action, Compute, MsgId, Pass, Post, Role};

use crate::boundary::{Groups, run_boundary};
use crate::error::RuntimeError;
use crate::memory::{HostCopy, Resident, bytes};
use crate::optim::{AdamState, AdamW, LrSchedule};
use crate::plans::StepPlans;
use crate::stage::{BoundaryIn, Forward, Scored, Stage};
use crate::step::{Grads, clip_factor, finite, norm_sq_share, reduce};

type Result<T> = std::result::Result<T, RuntimeError>;

/// What a step does when a gradient holds a NaN or an infinity (`[train] on_nonfinite`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnNonFinite {
    /// End the run with an error naming the module and parameter.
    Stop,
    /// Leave the parameters and optimizer state as they were and go on.
    Skip,
}

/// How the optimizer runs.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    /// AdamW's constants.
    pub adam: AdamW,
    /// Learning-rate schedule per module.
    pub lr: BTreeMap<ModuleId, LrSchedule>,
    /// Global gradient-norm bound (0: no clipping).
    pub clip: f64,
    /// Non-finite policy.
    pub on_nonfinite: OnNonFinite,
    /// Modules whose forward keeps no activations: the backward runs the forward again.
    pub recompute: BTreeSet<ModuleId>,
    /// Frozen modules (`trainable = false`): no gradients kept, no optimizer state, no part
    /// in the norm. A frozen module's backward (when something trainable feeds it) still
    /// carries gradients to its inputs.
    pub frozen: BTreeSet<ModuleId>,
    /// Modules the schedule runs forwards only (`Schedule::backward`): their forwards keep
    /// no graph.
    pub forward_only: BTreeSet<ModuleId>,
}

/// The outcome of one step, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Loss over the global count of target tokens.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Each module's part of it (its own gradient norm), by module id.
    pub module_norms: Vec<f64>,
    /// Whether the update was applied (false: skipped for a non-finite gradient).
    pub applied: bool,
    /// Where a skipped step found non-finite values, job-wide: `loss` first where the loss
    /// was not finite, then in module order `NAME` for a module with a non-finite gradient,
    /// then in edge order `boundary SRC -> DST` for an edge whose rows or row gradients
    /// arrived non-finite. Empty when the step was applied.
    pub nonfinite_at: Vec<String>,
    /// Forward passes this rank ran again before their backward (`recompute`).
    pub recomputed: usize,
    /// Seconds this rank spent per kind of action: `forward`, `backward`, `pipeline`
    /// (point-to-point batches), `boundary` (transforms), `reduce`, `optimizer`.
    pub seconds: BTreeMap<&'static str, f64>,
    /// The actions this rank ran, in order.
    pub executed: Vec<Action>,
    /// Seconds each of them took, in the same order.
    pub durations: Vec<f64>,
    /// Bytes each module's ranks put into the module's own collectives and messages
    /// (tensor, context, expert and data parallel, gradient reduction) in the step, summed
    /// over the job, by module id. Pipeline messages and boundary transforms are not in it.
    pub collective_bytes: Vec<u64>,
    /// What each module holds in memory, the largest over its ranks, by module id.
    pub resident: Vec<Resident>,
    /// Target tokens this rank scored (held-out batches; see [`Scored`]).
    pub scored: Vec<Scored>,
    /// Each rank's peak over the step of everything the executor holds for all its
    /// modules, by global rank.
    pub rank_peaks: Vec<u64>,
}

type Key = (ModuleId, usize, usize);

/// The job-wide sums of a step.
struct Outcome {
    norm: f64,
    module_norms: Vec<f64>,
    loss: f64,
    apply: bool,
    clip: f64,
    collective_bytes: Vec<u64>,
    nonfinite_at: Vec<String>,
}

/// A forward waiting for its backward.
struct Live {
    /// The forward kept no graph: run it again before the backward.
    recompute: bool,
    input: Option<Var>,
    /// Rows the edges into the module delivered (first stage).
    boundary: Vec<(EdgeId, Var)>,
    fwd: Forward,
}

impl Stash {
    /// Bytes of the tensors held for module `m`: its kept outputs and losses, received
    /// activations, delivered boundary rows and the gradients waiting to move.
    fn bytes_of(&self, m: ModuleId, plans: &StepPlans) -> u64 {
        let live = self.live.iter().filter(|(k, _)| k.0 == m).map(|(_, l)| {
            bytes(l.fwd.out.iter().chain(&l.fwd.loss))
                + bytes(l.input.iter().map(Var::as_tensor))
                + bytes(l.boundary.iter().map(|b| b.1.as_tensor()))
        });
        let keyed = |map: &HashMap<Key, Tensor>| {
            bytes(map.iter().filter(|(k, _)| k.0 == m).map(|(_, t)| t))
        };
        live.sum::<u64>()
            + bytes(self.inputs.iter().filter(|(k, _)| k.0 == m).map(|(_, v)| v.as_tensor()))
            + keyed(&self.out_grads)
            + keyed(&self.in_grads)
            + bytes(
                self.boundary_in
                    .iter()
                    .filter(|(k, _)| k.0 == m)
                    .flat_map(|(_, v)| v.iter().map(|b| b.1.as_tensor())),
            )
            + bytes(
                self.boundary_grads.iter().filter(|(k, _)| plans.edges[k.0].1 == m).map(|(_, t)| t),
            )
    }
}

#[derive(Default)]
struct Stash {
    /// Forwards run again before their backward.
    recomputed: usize,
    /// Received activations by the (module, vstage, mb) that consumes them.
    inputs: HashMap<Key, Var>,
    live: HashMap<Key, Live>,
    /// Gradients received for the outputs of (module, vstage, mb).
    out_grads: HashMap<Key, Tensor>,
    /// Input gradients (module, vstage, mb) produced, waiting to be sent.
    in_grads: HashMap<Key, Tensor>,
    /// Rows delivered by each edge into (module, mb), waiting for its first stage.
    boundary_in: HashMap<(ModuleId, usize), Vec<(EdgeId, Var)>>,
    /// Gradients of delivered rows by (edge, mb), waiting for the backward transform.
    boundary_grads: HashMap<(EdgeId, usize), Tensor>,
    /// Targets this rank's forwards scored.
    scored: Vec<Scored>,
    /// Edges whose rows or row gradients reached this rank non-finite (under the skip
    /// policy; the stop policy ends the step there).
    nonfinite_edges: BTreeSet<EdgeId>,
}

/// One message's bytes in the module's element type.
enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

impl Buf {
    fn of(t: &Tensor) -> Result<Buf> {
        let t = t.flatten_all()?;
        Ok(match t.dtype() {
            DType::F64 => Buf::F64(t.to_vec1()?),
            DType::F32 => Buf::F32(t.to_vec1()?),
            other => {
                return Err(RuntimeError::Model(format!(
                    "pipeline messages in {other:?} are not supported"
                )));
            }
        })
    }

    fn zeros(dtype: DType, n: usize) -> Result<Buf> {
        Ok(match dtype {
            DType::F64 => Buf::F64(vec![0.0; n]),
            DType::F32 => Buf::F32(vec![0.0; n]),
            other => {
                return Err(RuntimeError::Model(format!(
                    "pipeline messages in {other:?} are not supported"
                )));
            }
        })
    }

    fn tensor(self, shape: &[usize]) -> Result<Tensor> {
        Ok(match self {
            Buf::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
            Buf::F64(v) => Tensor::from_vec(v, shape, &Device::Cpu)?,
        })
    }

    fn send(&self, peer: usize, tag: u32) -> P2p<'_> {
        match self {
            Buf::F32(v) => P2p::send(v, peer, tag),
            Buf::F64(v) => P2p::send(v, peer, tag),
        }
    }

    fn recv(&mut self, peer: usize, tag: u32) -> P2p<'_> {
        match self {
            Buf::F32(v) => P2p::recv(v, peer, tag),
            Buf::F64(v) => P2p::recv(v, peer, tag),
        }
    }
}

/// The tag of a message, derived by both sides from the message itself, below 2^23 (the
/// smallest tag bound of the MPI builds in use: OpenMPI over UCX; the standard promises
/// only 2^15): 2 bits of kind, then module or edge, virtual stage or direction and
/// microbatch, each modulo its field (4, 8 and 9 bits). Tags only need to tell apart the
/// messages one batch posts between a pair; messages of later batches with an equal tag
/// match in order (MPI does not overtake), as both sides post them in schedule order.
fn tag(msg: &MsgId) -> Result<u32> {
    let (kind, module, vstage, mb) = match *msg {
        MsgId::Act { module, vstage, mb, .. } => (0, module, vstage, mb),
        MsgId::Grad { module, vstage, mb, .. } => (1, module, vstage, mb),
        MsgId::Boundary { edge, mb, dir } => (2, edge, usize::from(dir == Direction::Backward), mb),
        MsgId::Reduce { .. } => {
            return Err(RuntimeError::Model(format!("{msg:?} is not a point-to-point message")));
        }
    };
    let field = |v: usize, bits: u32| (v % (1 << bits)) as u32;
    Ok(kind | field(module, 4) << 2 | field(vstage, 8) << 6 | field(mb, 9) << 14)
}

/// What the rows each edge delivered to microbatch `mb` look like to a stage.
fn boundary_inputs<'a>(
    rows: &'a [(EdgeId, Var)],
    mb: usize,
    plans: &'a StepPlans,
) -> Result<Vec<BoundaryIn<'a>>> {
    rows.iter()
        .map(|(e, v)| {
            let geometry = &plans.plan(*e, mb)?.geometry;
            Ok(BoundaryIn { edge: *e, rows: v.as_tensor(), geometry })
        })
        .collect()
}

/// A module's state while offloaded: the host copy and how many of its tensors are first
/// moments, second moments, gradients and parameters (none where an autograd graph still
/// references them).
struct Offloaded {
    copy: HostCopy,
    counts: [usize; 4],
}

/// One rank's modules, their optimizer states and the options.
pub struct Executor {
    stages: Vec<Box<dyn Stage>>,
    states: Vec<AdamState>,
    offloaded: Vec<Option<Offloaded>>,
    opts: TrainOptions,
    skipped: usize,
    groups: Groups,
    /// Forwards keep no autograd graph (held-out batches: no backward follows).
    evaluating: bool,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let modules: Vec<ModuleId> = self.stages.iter().map(|s| s.module()).collect();
        write!(f, "Executor(modules {modules:?}, {} steps skipped)", self.skipped)
    }
}

impl Executor {
    /// The executor of this rank's `stages` (one per module it holds).
    pub fn new(stages: Vec<Box<dyn Stage>>, opts: TrainOptions) -> Result<Executor> {
        let states = stages
            .iter()
            .map(|s| AdamState::new(&trained(s.as_ref(), &opts)))
            .collect::<Result<_>>()?;
        let offloaded = stages.iter().map(|_| None).collect();
        Ok(Executor {
            stages,
            states,
            offloaded,
            opts,
            skipped: 0,
            groups: Groups::new(),
            evaluating: false,
        })
    }

    /// The parameters of stage `i` that train (none of a frozen module).
    fn trained(&self, i: usize) -> Vec<&Param> {
        trained(self.stages[i].as_ref(), &self.opts)
    }

    /// This rank's stages.
    pub fn stages(&self) -> &[Box<dyn Stage>] {
        &self.stages
    }

    /// While `on`, every forward keeps only its values, no autograd graph, as a module that
    /// runs forwards only does: for steps of forwards alone (held-out batches).
    pub fn set_evaluating(&mut self, on: bool) {
        self.evaluating = on;
    }

    /// Steps skipped for non-finite gradients so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Sets the count of skipped steps (a resumed run continues the saved count).
    pub fn set_skipped(&mut self, n: usize) {
        self.skipped = n;
    }

    /// The optimizer state of stage `i`.
    pub fn state(&self, i: usize) -> &AdamState {
        &self.states[i]
    }

    /// Replaces stage `i`'s optimizer state (a resume); the moments must match its trained
    /// parameters' local shapes.
    pub fn restore_state(&mut self, i: usize, state: AdamState) -> Result<()> {
        let params = self.trained(i);
        let fits = |m: &[Tensor]| {
            m.len() == params.len()
                && m.iter().zip(&params).all(|(t, p)| t.dims() == p.tensor().dims())
        };
        if !fits(&state.m) || !fits(&state.v) {
            return Err(RuntimeError::Model(format!(
                "module {}: the optimizer state does not match its parameters",
                self.stages[i].ctx().layout.name()
            )));
        }
        self.states[i] = state;
        Ok(())
    }

    fn index(&self, m: ModuleId) -> Result<usize> {
        self.stages
            .iter()
            .position(|s| s.module() == m)
            .ok_or_else(|| RuntimeError::Model(format!("this rank holds no stage of module {m}")))
    }

    /// Runs step `step` (0-based): this rank's `actions`, in order, with the step's
    /// `plans` (which every rank derives alike).
    pub fn step(
        &mut self,
        world: &dyn Communicator,
        actions: &[Action],
        step: usize,
        plans: &StepPlans,
    ) -> Result<StepReport> {
        for s in &mut self.stages {
            s.begin_step(step, &plans.manifest)?;
        }
        self.groups.prepare(world, plans.all().flat_map(|p| [&p.forward, &p.backward]))?;
        let mut grads: Vec<Grads> = (0..self.stages.len())
            .map(|i| Grads::zeros(&self.trained(i)))
            .collect::<Result<_>>()?;
        let mut stash = Stash::default();
        let mut reported = 0.0;
        let mut outcome: Option<Outcome> = None;
        let mut executed = Vec::with_capacity(actions.len());
        let mut durations = Vec::with_capacity(actions.len());
        let mut seconds: BTreeMap<&'static str, f64> = BTreeMap::new();
        let traffic: Vec<u64> = self.stages.iter().map(|s| s.ctx().traffic.bytes()).collect();
        let mut resident = vec![Resident::default(); plans.names.len()];
        let mut rank_peak = 0u64;
        for a in actions {
            let start = std::time::Instant::now();
            let kind = match a {
                Action::Compute(c) if c.pass == Pass::Forward => "forward",
                Action::Compute(_) => "backward",
                Action::Comm(posts)
                    if posts.iter().any(|p| matches!(p.msg, MsgId::Boundary { .. })) =>
                {
                    "boundary"
                }
                Action::Comm(_) => "pipeline",
                Action::Boundary(_) => "boundary",
                Action::Reduce(_) => "reduce",
                Action::Step(_) => "optimizer",
                Action::Offload(_) | Action::Reload(_) => "offload",
            };
            if let Some(m) = needs_resident(a) {
                let i = self.index(m)?;
                if self.offloaded[i].is_some() {
                    return Err(RuntimeError::Model(format!(
                        "{a:?}: module {} is offloaded here (no reload before it)",
                        self.stages[i].ctx().layout.name()
                    )));
                }
            }
            match a {
                Action::Compute(c) if c.pass == Pass::Forward => {
                    reported += self.forward(c, &mut stash, plans)?;
                }
                Action::Compute(c) => self.backward(c, &mut stash, &mut grads, plans)?,
                Action::Comm(posts) => self.comm(world, posts, &mut stash, plans)?,
                Action::Boundary(post) => self.boundary(world, &post.msg, &mut stash, plans)?,
                Action::Reduce(post) => {
                    let MsgId::Reduce { module, .. } = post.msg else {
                        return Err(RuntimeError::Model(format!("reduce of {:?}", post.msg)));
                    };
                    let i = self.index(module)?;
                    reduce(self.stages[i].ctx(), &self.trained(i), &mut grads[i])?;
                }
                Action::Step(m) => {
                    if outcome.is_none() {
                        let o = self.finish(world, &grads, reported, &traffic, &stash, plans)?;
                        outcome = Some(o);
                    }
                    let (ok, clip) =
                        outcome.as_ref().map(|o| (o.apply, o.clip)).expect("computed above");
                    if ok {
                        let i = self.index(*m)?;
                        let lr = self.opts.lr.get(m).map_or(0.0, |s| s.at(step));
                        let params = trained(self.stages[i].as_ref(), &self.opts);
                        let state = &mut self.states[i];
                        if let Some(j) =
                            state.update(&self.opts.adam, &params, &grads[i], lr, clip)?
                        {
                            return Err(RuntimeError::UpdateOverflow {
                                module: self.stages[i].ctx().layout.name().to_string(),
                                param: params[j].name.clone(),
                                lr: format!("{lr:e}"),
                            });
                        }
                    }
                }
                Action::Offload(m) => self.offload(*m, &mut grads, &stash)?,
                Action::Reload(m) => self.reload(*m, &mut grads)?,
            }
            let took = start.elapsed().as_secs_f64();
            *seconds.entry(kind).or_default() += took;
            durations.push(took);
            rank_peak = rank_peak.max(self.sample(a, &grads, &stash, plans, &mut resident));
            executed.push(a.clone());
        }
        let o = match outcome {
            Some(o) => o,
            None => self.finish(world, &grads, reported, &traffic, &stash, plans)?,
        };
        // The largest of each module's memory over its ranks, and each rank's own peak (its
        // slot, zero elsewhere), in one reduction.
        let mut peaks: Vec<f64> =
            resident.iter().flat_map(|r| [r.peak, r.llm_phase, r.host]).map(|b| b as f64).collect();
        let modules = peaks.len();
        peaks.resize(modules + world.size(), 0.0);
        peaks[modules + world.rank()] = rank_peak as f64;
        world.all_reduce(&mut peaks, ReduceOp::Max)?;
        let rank_peaks = peaks[modules..].iter().map(|&b| b as u64).collect();
        let resident = peaks[..modules]
            .chunks_exact(3)
            .map(|c| Resident { peak: c[0] as u64, llm_phase: c[1] as u64, host: c[2] as u64 })
            .collect();
        Ok(StepReport {
            loss: o.loss,
            grad_norm: o.norm,
            module_norms: o.module_norms,
            applied: o.apply,
            nonfinite_at: o.nonfinite_at,
            recomputed: stash.recomputed,
            seconds,
            executed,
            durations,
            collective_bytes: o.collective_bytes,
            resident,
            scored: stash.scored,
            rank_peaks,
        })
    }

    /// Moves module `m`'s optimizer state, gradients and (where no forward of it kept its
    /// autograd graph, as under `recompute`) parameters into one host buffer, dropping the
    /// tensors. A kept graph references the parameters, so releasing them would free
    /// nothing.
    fn offload(&mut self, m: ModuleId, grads: &mut [Grads], stash: &Stash) -> Result<()> {
        let i = self.index(m)?;
        if self.offloaded[i].is_some() {
            return Err(RuntimeError::Model(format!("module {m} is offloaded twice")));
        }
        let graph_kept = !self.opts.forward_only.contains(&m)
            && stash.live.iter().any(|(k, l)| k.0 == m && !l.recompute);
        let params: Vec<Var> = if graph_kept {
            Vec::new()
        } else {
            self.stages[i]
                .params_mut()
                .into_iter()
                .map(Param::release)
                .collect::<std::result::Result<_, _>>()?
        };
        let (st, g) = (&mut self.states[i], &mut grads[i]);
        let counts = [st.m.len(), st.v.len(), g.tensors.len(), params.len()];
        let all: Vec<Tensor> =
            st.m.drain(..)
                .chain(st.v.drain(..))
                .chain(g.tensors.drain(..))
                .chain(params.into_iter().map(Var::into_inner))
                .collect();
        let copy = HostCopy::pack(&all, self.stages[i].dtype())?;
        self.offloaded[i] = Some(Offloaded { copy, counts });
        Ok(())
    }

    /// Brings module `m`'s state back from its host buffer.
    fn reload(&mut self, m: ModuleId, grads: &mut [Grads]) -> Result<()> {
        let i = self.index(m)?;
        let Some(Offloaded { copy, counts }) = self.offloaded[i].take() else {
            return Err(RuntimeError::Model(format!("module {m} is reloaded but not offloaded")));
        };
        let [nm, nv, ng, np] = counts;
        let mut all = copy.unpack(nm + nv + ng)?.into_iter();
        self.states[i].m = all.by_ref().take(nm).collect();
        self.states[i].v = all.by_ref().take(nv).collect();
        grads[i].tensors = all.by_ref().take(ng).collect();
        if np > 0 {
            for (p, t) in self.stages[i].params_mut().into_iter().zip(all) {
                p.restore(Var::from_tensor(&t)?)?;
            }
        }
        Ok(())
    }

    /// Records each module's memory after action `a`; returns this rank's total.
    fn sample(
        &self,
        a: &Action,
        grads: &[Grads],
        stash: &Stash,
        plans: &StepPlans,
        resident: &mut [Resident],
    ) -> u64 {
        // The LLM (the module no edge leaves) computing: phase 2 of a colocated step.
        let llm_phase =
            matches!(a, Action::Compute(c) if !plans.edges.iter().any(|e| e.0 == c.module));
        let mut total = 0;
        for (i, s) in self.stages.iter().enumerate() {
            let m = s.module();
            let params = bytes(s.params().iter().map(|p| p.tensor()));
            let st = &self.states[i];
            let held = params
                + bytes(&grads[i].tensors)
                + bytes(st.m.iter().chain(&st.v))
                + stash.bytes_of(m, plans);
            let host = self.offloaded[i].as_ref().map_or(0, |o| o.copy.len());
            let now = Resident { peak: held, llm_phase: if llm_phase { held } else { 0 }, host };
            resident[m] = resident[m].max(now);
            total += held;
        }
        total
    }

    fn forward(&mut self, c: &Compute, stash: &mut Stash, plans: &StepPlans) -> Result<f64> {
        let key = (c.module, c.vstage, c.mb);
        let input = stash.inputs.remove(&key);
        if c.vstage > 0 && input.is_none() {
            return Err(RuntimeError::Model(format!(
                "forward of module {} stage {} mb {}: its input never arrived",
                c.module, c.vstage, c.mb
            )));
        }
        let mut boundary = if c.vstage == 0 {
            stash.boundary_in.remove(&(c.module, c.mb)).unwrap_or_default()
        } else {
            Vec::new()
        };
        boundary.sort_by_key(|b| b.0);
        if c.vstage == 0 {
            // Every edge into the module delivers this microbatch's rows first (an empty
            // set where it has none), never silently nothing.
            let into = plans.edges.iter().enumerate().filter(|(_, e)| e.1 == c.module);
            if let Some((e, _)) = into.clone().find(|(e, _)| !boundary.iter().any(|b| b.0 == *e)) {
                return Err(RuntimeError::Boundary {
                    edge: plans.edge_name(e),
                    message: format!(
                        "microbatch {}: the forward transform did not run before the first stage needed its rows",
                        c.mb
                    ),
                });
            }
        }
        let inputs = boundary_inputs(&boundary, c.mb, plans)?;
        let i = self.index(c.module)?;
        let mut fwd =
            self.stages[i].forward(c.vstage, c.mb, input.as_ref().map(Var::as_tensor), &inputs)?;
        let reported = fwd.reported;
        stash.scored.append(&mut fwd.scored);
        let recompute = self.opts.recompute.contains(&c.module);
        if recompute || self.evaluating || self.opts.forward_only.contains(&c.module) {
            // Keep the values the next stage or the edge reads, drop the graph behind them.
            fwd.out = fwd.out.map(|t| t.detach());
            fwd.loss = fwd.loss.map(|t| t.detach());
        }
        stash.live.insert(key, Live { recompute, input, boundary, fwd });
        Ok(reported)
    }

    fn backward(
        &mut self,
        c: &Compute,
        stash: &mut Stash,
        grads: &mut [Grads],
        plans: &StepPlans,
    ) -> Result<()> {
        let key = (c.module, c.vstage, c.mb);
        let what = || format!("backward of module {} stage {} mb {}", c.module, c.vstage, c.mb);
        let mut live = stash
            .live
            .remove(&key)
            .ok_or_else(|| RuntimeError::Model(format!("{}: no forward ran", what())))?;
        if live.recompute {
            // The same forward on the same inputs (deterministic), this time with its graph.
            let inputs = boundary_inputs(&live.boundary, c.mb, plans)?;
            let i = self.index(c.module)?;
            let input = live.input.as_ref().map(Var::as_tensor);
            live.fwd = self.stages[i].forward(c.vstage, c.mb, input, &inputs)?;
            stash.recomputed += 1;
        }
        let mut root = live.fwd.loss.clone();
        if let Some(out) = &live.fwd.out {
            let seed = stash.out_grads.remove(&key).ok_or_else(|| {
                RuntimeError::Model(format!("{}: the gradient of its output never arrived", what()))
            })?;
            let term = (out * seed.to_dtype(out.dtype())?)?.sum_all()?;
            root = Some(match root {
                Some(r) => (r + term)?,
                None => term,
            });
        }
        let root = root
            .ok_or_else(|| RuntimeError::Model(format!("{}: nothing to differentiate", what())))?;
        let store = root.backward()?;
        let i = self.index(c.module)?;
        grads[i].accumulate(&self.trained(i), &store)?;
        if self.opts.frozen.contains(&c.module) {
            // A frozen module's fused nodes still wrote their weights' gradients, the linear
            // layers' and the pre-norms' (candle runs every backward its graph reaches);
            // nothing reads them.
            for p in self.stages[i].params() {
                p.sink.clear()?;
            }
        }
        let grad_of = |v: &Var| -> Result<Tensor> {
            Ok(match store.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => v.as_tensor().zeros_like()?,
            })
        };
        if let Some(input) = &live.input {
            stash.in_grads.insert(key, grad_of(input)?);
        }
        for (e, v) in &live.boundary {
            // Rows from a module that runs no backward take no gradient back.
            if !self.opts.forward_only.contains(&plans.edges[*e].0) {
                stash.boundary_grads.insert((*e, c.mb), grad_of(v)?);
            }
        }
        Ok(())
    }

    /// Runs the boundary transform `msg` (one edge, one microbatch, one direction) on this
    /// rank's side: the source's rows or the destination's row gradients in, the other
    /// side's out.
    fn boundary(
        &mut self,
        world: &dyn Communicator,
        msg: &MsgId,
        stash: &mut Stash,
        plans: &StepPlans,
    ) -> Result<()> {
        let MsgId::Boundary { edge, mb, dir } = *msg else {
            return Err(RuntimeError::Model(format!("{msg:?} is not a boundary transform")));
        };
        let dtype = self
            .stages
            .iter()
            .find(|s| {
                let (src, dst) = plans.edges[edge];
                s.module() == src || s.module() == dst
            })
            .map(|s| s.dtype())
            .ok_or_else(|| {
                RuntimeError::Model(format!(
                    "{}: this rank holds neither end of the edge",
                    plans.edge_name(edge)
                ))
            })?;
        match dtype {
            DType::F32 => self.boundary_typed::<f32>(world, edge, mb, dir, stash, plans),
            DType::F64 => self.boundary_typed::<f64>(world, edge, mb, dir, stash, plans),
            other => {
                Err(RuntimeError::Model(format!("boundary rows in {other:?} are not supported")))
            }
        }
    }

    fn boundary_typed<T: Element + WithDType>(
        &mut self,
        world: &dyn Communicator,
        edge: EdgeId,
        mb: usize,
        dir: Direction,
        stash: &mut Stash,
        plans: &StepPlans,
    ) -> Result<()> {
        let (src, dst) = plans.edges[edge];
        let plan = plans.plan(edge, mb)?;
        let name = plans.edge_name(edge);
        let me = world.global_rank();
        // The source's last stage holds rows, the destination's first stage needs them.
        let src_stage = self.index(src).ok().filter(|&i| {
            let s = &self.stages[i];
            s.ctx().coords.pp_idx + 1 == s.ctx().layout.pp()
        });
        let dst_stage = self.index(dst).ok().filter(|&i| self.stages[i].ctx().coords.pp_idx == 0);
        let width = src_stage.or(dst_stage).map_or(0, |i| self.stages[i].width());
        let count = |m: &BTreeMap<usize, Vec<usize>>| m.get(&me).map_or(0, Vec::len);
        let (n_held, n_needed) = (count(&plan.geometry.held), count(&plan.geometry.needed));
        let flat = |t: &Tensor| -> Result<Vec<T>> { Ok(t.flatten_all()?.to_vec1::<T>()?) };
        let t = tag(&MsgId::Boundary { edge, mb, dir })?;
        let bad = |what: &str| {
            RuntimeError::Model(format!(
                "boundary {name} microbatch {mb}: a non-finite {what} reached rank {me}"
            ))
        };
        match dir {
            Direction::Forward => {
                let mut held = match src_stage {
                    Some(i) => {
                        let v = self.stages[i].n_vstages() - 1;
                        let out = stash
                            .live
                            .get(&(src, v, mb))
                            .and_then(|l| l.fwd.out.as_ref())
                            .ok_or_else(|| {
                                missing("encoder output", &MsgId::Boundary { edge, mb, dir })
                            })?;
                        flat(out)?
                    }
                    None => Vec::new(),
                };
                let mut needed = vec![T::zeroed(); n_needed * width];
                run_boundary(
                    world,
                    &self.groups,
                    plan,
                    dir,
                    &name,
                    width,
                    t,
                    &mut held,
                    &mut needed,
                )
                .map_err(|e| in_transform(e, &name, mb, dir))?;
                if dst_stage.is_some() {
                    let rows = Tensor::from_vec(needed, (n_needed, width), &Device::Cpu)?;
                    if !finite(&rows)? {
                        if self.opts.on_nonfinite == OnNonFinite::Stop {
                            return Err(bad("activation"));
                        }
                        stash.nonfinite_edges.insert(edge);
                    }
                    stash
                        .boundary_in
                        .entry((dst, mb))
                        .or_default()
                        .push((edge, Var::from_tensor(&rows)?));
                }
            }
            Direction::Backward => {
                let mut needed = match dst_stage {
                    Some(_) => {
                        let g = stash.boundary_grads.remove(&(edge, mb)).ok_or_else(|| {
                            missing("row gradient", &MsgId::Boundary { edge, mb, dir })
                        })?;
                        flat(&g)?
                    }
                    None => Vec::new(),
                };
                let mut held = vec![T::zeroed(); n_held * width];
                run_boundary(
                    world,
                    &self.groups,
                    plan,
                    dir,
                    &name,
                    width,
                    t,
                    &mut held,
                    &mut needed,
                )
                .map_err(|e| in_transform(e, &name, mb, dir))?;
                if let Some(i) = src_stage {
                    let g = Tensor::from_vec(held, (n_held, width), &Device::Cpu)?;
                    if !finite(&g)? {
                        if self.opts.on_nonfinite == OnNonFinite::Stop {
                            return Err(bad("gradient"));
                        }
                        stash.nonfinite_edges.insert(edge);
                    }
                    let v = self.stages[i].n_vstages() - 1;
                    stash.out_grads.insert((src, v, mb), g);
                }
            }
        }
        Ok(())
    }

    fn comm(
        &mut self,
        world: &dyn Communicator,
        posts: &[Post],
        stash: &mut Stash,
        plans: &StepPlans,
    ) -> Result<()> {
        let mut sends: Vec<(usize, u32, Buf)> = Vec::new();
        let mut transforms: Vec<MsgId> = Vec::new();
        // Receives: the stash key they fill, whether an activation, the shape, the buffer.
        let mut recvs: Vec<(usize, u32, Key, bool, Vec<usize>, Buf)> = Vec::new();
        for p in posts {
            if let MsgId::Boundary { .. } = p.msg {
                if !transforms.contains(&p.msg) {
                    transforms.push(p.msg);
                }
                continue;
            }
            let t = tag(&p.msg)?;
            match (p.msg, p.role) {
                (MsgId::Act { module, vstage, mb, to, .. }, Role::Send) => {
                    let out = stash
                        .live
                        .get(&(module, vstage, mb))
                        .and_then(|l| l.fwd.out.as_ref())
                        .ok_or_else(|| missing("activation to send", &p.msg))?;
                    sends.push((to, t, Buf::of(out)?));
                }
                (MsgId::Act { module, vstage, mb, from, .. }, Role::Recv) => {
                    let s = &self.stages[self.index(module)?];
                    let shape = s.input_shape(vstage + 1, mb)?;
                    let buf = Buf::zeros(s.dtype(), shape.iter().product())?;
                    recvs.push((from, t, (module, vstage + 1, mb), true, shape, buf));
                }
                (MsgId::Grad { module, vstage, mb, to, .. }, Role::Send) => {
                    let g = stash
                        .in_grads
                        .remove(&(module, vstage, mb))
                        .ok_or_else(|| missing("gradient to send", &p.msg))?;
                    sends.push((to, t, Buf::of(&g)?));
                }
                (MsgId::Grad { module, vstage, mb, from, .. }, Role::Recv) => {
                    let key = (module, vstage - 1, mb);
                    let out = stash
                        .live
                        .get(&key)
                        .and_then(|l| l.fwd.out.as_ref())
                        .ok_or_else(|| missing("output awaiting this gradient", &p.msg))?;
                    let shape = out.dims().to_vec();
                    let buf = Buf::zeros(out.dtype(), out.elem_count())?;
                    recvs.push((from, t, key, false, shape, buf));
                }
                _ => {
                    return Err(RuntimeError::Model(format!(
                        "{:?} ({:?}) is not a pipeline message this executor runs",
                        p.msg, p.role
                    )));
                }
            }
        }
        {
            let mut ops: Vec<P2p<'_>> =
                sends.iter().map(|(peer, t, b)| b.send(*peer, *t)).collect();
            ops.extend(recvs.iter_mut().map(|(peer, t, _, _, _, b)| b.recv(*peer, *t)));
            world.batch_p2p(&mut ops)?;
        }
        for (_, _, key, act, shape, buf) in recvs {
            let t = buf.tensor(&shape)?;
            if act {
                stash.inputs.insert(key, Var::from_tensor(&t)?);
            } else {
                stash.out_grads.insert(key, t);
            }
        }
        // The point-to-point messages of an action complete without waiting on any
        // transform, so running the transforms after them (in one order on every rank)
        // keeps the action's rendezvous.
        transforms.sort();
        for msg in transforms {
            self.boundary(world, &msg, stash, plans)?;
        }
        Ok(())
    }

    /// The job-wide sums before the first update over `modules` modules: the norm (and each
    /// module's), the loss, whether to apply, the clip factor, where values were non-finite.
    fn finish(
        &mut self,
        world: &dyn Communicator,
        grads: &[Grads],
        reported: f64,
        traffic: &[u64],
        stash: &Stash,
        plans: &StepPlans,
    ) -> Result<Outcome> {
        let (modules, edges) = (plans.names.len(), plans.edges.len());
        // [loss, non-finite count, each module's squared norm share, each module's
        // collective bytes since the step began, each module's and each edge's non-finite
        // findings]
        let found = 2 + 2 * modules;
        let mut sums = vec![0.0; found + modules + edges];
        sums[0] = reported;
        for (s, t0) in self.stages.iter().zip(traffic) {
            sums[2 + modules + s.module()] = (s.ctx().traffic.bytes() - t0) as f64;
        }
        let mut bad: Option<(String, String)> = None;
        for (s, g) in self.stages.iter().zip(grads) {
            let params = trained(s.as_ref(), &self.opts);
            if let Some(p) = g.first_nonfinite(&params)? {
                sums[found + s.module()] = 1.0;
                if bad.is_none() {
                    bad = Some((s.ctx().layout.name().to_string(), p.to_string()));
                }
            }
            sums[2 + s.module()] += norm_sq_share(s.ctx(), &params, g)?;
        }
        if bad.is_some() {
            sums[1] = 1.0;
        }
        for &e in &stash.nonfinite_edges {
            sums[found + modules + e] = 1.0;
        }
        world.all_reduce(&mut sums, ReduceOp::Sum)?;
        let loss = sums[0];
        let nonfinite = nonfinite_step(sums[1], loss);
        let shares = &sums[2..2 + modules];
        let module_norms: Vec<f64> = shares.iter().map(|x| x.sqrt()).collect();
        let norm = shares.iter().sum::<f64>().sqrt();
        let collective_bytes = sums[2 + modules..found].iter().map(|&b| b as u64).collect();
        if !nonfinite {
            let clip = clip_factor(norm, self.opts.clip);
            let nonfinite_at = Vec::new();
            return Ok(Outcome {
                norm,
                module_norms,
                loss,
                apply: true,
                clip,
                collective_bytes,
                nonfinite_at,
            });
        }
        match (self.opts.on_nonfinite, bad) {
            (OnNonFinite::Skip, _) => {
                self.skipped += 1;
                let norm = f64::NAN;
                let flags = &sums[found..];
                let edge = |e: usize| format!("boundary {}", plans.edge_name(e));
                let nonfinite_at = (!loss.is_finite())
                    .then(|| "loss".to_string())
                    .into_iter()
                    .chain((0..modules).filter(|&m| flags[m] > 0.0).map(|m| plans.names[m].clone()))
                    .chain((0..edges).filter(|&e| flags[modules + e] > 0.0).map(edge))
                    .collect();
                Ok(Outcome {
                    norm,
                    module_norms,
                    loss,
                    apply: false,
                    clip: 0.0,
                    collective_bytes,
                    nonfinite_at,
                })
            }
            (OnNonFinite::Stop, Some((module, param))) => {
                Err(RuntimeError::NonFinite { module, param })
            }
            (OnNonFinite::Stop, None) if !loss.is_finite() => Err(RuntimeError::Model(format!(
                "the loss is not finite ({loss}); the step was not applied"
            ))),
            (OnNonFinite::Stop, None) => Err(RuntimeError::Model(
                "a gradient on another rank is not finite (that rank names it); the step was not applied".into(),
            )),
        }
    }
}

/// Whether a step must not be applied: a gradient found non-finite on some rank (`flagged`,
/// the ranks' findings summed) or a loss that is not finite, whose gradients the step would
/// otherwise apply as they came (RELIABILITY.md row 6).
fn nonfinite_step(flagged: f64, loss: f64) -> bool {
    flagged > 0.0 || !loss.is_finite()
}

/// The module action `a` needs resident (not offloaded): a forward or backward, a gradient
/// reduction, an optimizer step.
fn needs_resident(a: &Action) -> Option<ModuleId> {
    match a {
        Action::Compute(c) => Some(c.module),
        Action::Reduce(p) => match p.msg {
            MsgId::Reduce { module, .. } => Some(module),
            _ => None,
        },
        Action::Step(m) => Some(*m),
        _ => None,
    }
}

/// The parameters of `stage` that train under `opts`: none of a frozen module.
fn trained<'s>(stage: &'s dyn Stage, opts: &TrainOptions) -> Vec<&'s Param> {
    if opts.frozen.contains(&stage.module()) { Vec::new() } else { stage.params() }
}

/// A transform's failure with the edge, microbatch and direction it happened in.
fn in_transform(e: RuntimeError, edge: &str, mb: usize, dir: Direction) -> RuntimeError {
    match e {
        RuntimeError::Boundary { .. } => e,
        other => RuntimeError::Boundary {
            edge: edge.to_string(),
            message: format!("microbatch {mb}, {dir:?} transform: {other}"),
        },
    }
}

fn missing(what: &str, msg: &MsgId) -> RuntimeError {
    RuntimeError::Model(format!("no {what} for {msg:?}"))
}

#[cfg(test)]
mod tests {
    use super::nonfinite_step;

    #[test]
    fn a_step_with_a_non_finite_loss_is_not_applied_even_with_finite_gradients() {
        assert!(!nonfinite_step(0.0, 1.5));
        assert!(nonfinite_step(1.0, 1.5));
        for loss in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(nonfinite_step(0.0, loss), "{loss}");
        }
    }
}
