//! The executor: walks one rank's action list of a step as the schedule gives it, and
//! derives nothing. Forward and backward call the rank's [`Stage`]s; communication actions
//! post their messages as one batch (`Communicator::batch_p2p`); reductions and optimizer
//! steps run the step's gradient side. Received activations become leaves whose gradients
//! go back; a stage's backward is seeded with the gradient its output received, plus the
//! loss it added to the objective.
//!
//! The first optimizer step on a rank joins one job-wide sum (the squared gradient norm's
//! shares, the reported loss, the count of non-finite gradients): every rank reaches it
//! after its own reductions, so it needs no place in the schedule.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor, Var};
use hetpar_comm::{CommExt, Communicator, P2p, ReduceOp};
use hetpar_layout::ModuleId;
use hetpar_schedule::{Action, Compute, MsgId, Pass, Post, Role};

use crate::error::RuntimeError;
use crate::optim::{AdamState, AdamW, LrSchedule};
use crate::stage::{Forward, Stage};
use crate::step::{Grads, clip_factor, norm_sq_share, reduce};

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
}

/// The outcome of one step, the same on every rank.
#[derive(Clone, Debug, PartialEq)]
pub struct StepReport {
    /// Loss over the global count of target tokens.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied (false: skipped for a non-finite gradient).
    pub applied: bool,
    /// The actions this rank ran, in order.
    pub executed: Vec<Action>,
}

type Key = (ModuleId, usize, usize);

/// A forward waiting for its backward.
struct Live {
    input: Option<Var>,
    fwd: Forward,
}

#[derive(Default)]
struct Stash {
    /// Received activations by the (module, vstage, mb) that consumes them.
    inputs: HashMap<Key, Var>,
    live: HashMap<Key, Live>,
    /// Gradients received for the outputs of (module, vstage, mb).
    out_grads: HashMap<Key, Tensor>,
    /// Input gradients (module, vstage, mb) produced, waiting to be sent.
    in_grads: HashMap<Key, Tensor>,
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

/// The tag of a pipeline message: both sides derive it from the message itself.
fn tag(msg: &MsgId) -> Result<u32> {
    let (kind, module, vstage, mb) = match *msg {
        MsgId::Act { module, vstage, mb, .. } => (0, module, vstage, mb),
        MsgId::Grad { module, vstage, mb, .. } => (1, module, vstage, mb),
        _ => return Err(RuntimeError::Model(format!("{msg:?} is not a pipeline message"))),
    };
    if module >= 128 || vstage >= 4096 || mb >= 4096 {
        return Err(RuntimeError::Model(format!(
            "pipeline message tags hold 128 modules, 4096 virtual stages and 4096 microbatches: {msg:?}"
        )));
    }
    Ok((kind << 31) | ((module as u32) << 24) | ((vstage as u32) << 12) | mb as u32)
}

/// One rank's modules, their optimizer states and the options.
pub struct Executor {
    stages: Vec<Box<dyn Stage>>,
    states: Vec<AdamState>,
    opts: TrainOptions,
    skipped: usize,
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
        let states = stages.iter().map(|s| AdamState::new(&s.params())).collect::<Result<_>>()?;
        Ok(Executor { stages, states, opts, skipped: 0 })
    }

    /// This rank's stages.
    pub fn stages(&self) -> &[Box<dyn Stage>] {
        &self.stages
    }

    /// Steps skipped for non-finite gradients so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    fn index(&self, m: ModuleId) -> Result<usize> {
        self.stages
            .iter()
            .position(|s| s.module() == m)
            .ok_or_else(|| RuntimeError::Model(format!("this rank holds no stage of module {m}")))
    }

    /// Runs step `step` (0-based): this rank's `actions`, in order.
    pub fn step(
        &mut self,
        world: &dyn Communicator,
        actions: &[Action],
        step: usize,
    ) -> Result<StepReport> {
        for s in &mut self.stages {
            s.begin_step(step)?;
        }
        let mut grads: Vec<Grads> =
            self.stages.iter().map(|s| Grads::zeros(&s.params())).collect::<Result<_>>()?;
        let mut stash = Stash::default();
        let mut reported = 0.0;
        let mut outcome: Option<(f64, f64, bool, f64)> = None;
        let mut executed = Vec::with_capacity(actions.len());
        for a in actions {
            match a {
                Action::Compute(c) if c.pass == Pass::Forward => {
                    reported += self.forward(c, &mut stash)?;
                }
                Action::Compute(c) => self.backward(c, &mut stash, &mut grads)?,
                Action::Comm(posts) => self.comm(world, posts, &mut stash)?,
                Action::Reduce(post) => {
                    let MsgId::Reduce { module, .. } = post.msg else {
                        return Err(RuntimeError::Model(format!("reduce of {:?}", post.msg)));
                    };
                    let i = self.index(module)?;
                    let s = &self.stages[i];
                    reduce(s.ctx(), &s.params(), &mut grads[i])?;
                }
                Action::Step(m) => {
                    if outcome.is_none() {
                        outcome = Some(self.finish(world, &grads, reported)?);
                    }
                    let (_, _, ok, clip) = outcome.expect("computed above");
                    if ok {
                        let i = self.index(*m)?;
                        let lr = self.opts.lr.get(m).map_or(0.0, |s| s.at(step));
                        let params = self.stages[i].params();
                        self.states[i].update(&self.opts.adam, &params, &grads[i], lr, clip)?;
                    }
                }
                Action::Boundary(_) | Action::Offload(_) | Action::Reload(_) => {
                    return Err(RuntimeError::Model(format!(
                        "this executor runs pipelines of one module; {a:?} needs the boundary and offload support that comes next"
                    )));
                }
            }
            executed.push(a.clone());
        }
        let (grad_norm, loss, applied, _) = match outcome {
            Some(o) => o,
            None => self.finish(world, &grads, reported)?,
        };
        Ok(StepReport { loss, grad_norm, applied, executed })
    }

    fn forward(&mut self, c: &Compute, stash: &mut Stash) -> Result<f64> {
        let key = (c.module, c.vstage, c.mb);
        let input = stash.inputs.remove(&key);
        if c.vstage > 0 && input.is_none() {
            return Err(RuntimeError::Model(format!(
                "forward of module {} stage {} mb {}: its input never arrived",
                c.module, c.vstage, c.mb
            )));
        }
        let i = self.index(c.module)?;
        let fwd = self.stages[i].forward(c.vstage, c.mb, input.as_ref().map(Var::as_tensor))?;
        let reported = fwd.reported;
        stash.live.insert(key, Live { input, fwd });
        Ok(reported)
    }

    fn backward(&mut self, c: &Compute, stash: &mut Stash, grads: &mut [Grads]) -> Result<()> {
        let key = (c.module, c.vstage, c.mb);
        let what = || format!("backward of module {} stage {} mb {}", c.module, c.vstage, c.mb);
        let live = stash
            .live
            .remove(&key)
            .ok_or_else(|| RuntimeError::Model(format!("{}: no forward ran", what())))?;
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
        grads[i].accumulate(&self.stages[i].params(), &store)?;
        if let Some(input) = &live.input {
            let g = match store.get(input.as_tensor()) {
                Some(g) => g.clone(),
                None => input.as_tensor().zeros_like()?,
            };
            stash.in_grads.insert(key, g);
        }
        Ok(())
    }

    fn comm(&self, world: &dyn Communicator, posts: &[Post], stash: &mut Stash) -> Result<()> {
        let mut sends: Vec<(usize, u32, Buf)> = Vec::new();
        // Receives: the stash key they fill, whether an activation, the shape, the buffer.
        let mut recvs: Vec<(usize, u32, Key, bool, Vec<usize>, Buf)> = Vec::new();
        for p in posts {
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
                    let shape = s.input_shape(vstage + 1, mb);
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
        Ok(())
    }

    /// The job-wide sums before the first update: (norm, loss, apply, clip factor).
    fn finish(
        &mut self,
        world: &dyn Communicator,
        grads: &[Grads],
        reported: f64,
    ) -> Result<(f64, f64, bool, f64)> {
        let mut share = 0.0;
        let mut bad: Option<(String, String)> = None;
        for (s, g) in self.stages.iter().zip(grads) {
            let params = s.params();
            if bad.is_none()
                && let Some(p) = g.first_nonfinite(&params)?
            {
                bad = Some((s.ctx().layout.name().to_string(), p.to_string()));
            }
            share += norm_sq_share(s.ctx(), &params, g)?;
        }
        let mut sums =
            [if bad.is_some() { 0.0 } else { share }, reported, f64::from(u8::from(bad.is_some()))];
        world.all_reduce(&mut sums, ReduceOp::Sum)?;
        let (norm, loss, nonfinite) = (sums[0].sqrt(), sums[1], sums[2] > 0.0);
        if !nonfinite {
            return Ok((norm, loss, true, clip_factor(norm, self.opts.clip)));
        }
        match (self.opts.on_nonfinite, bad) {
            (OnNonFinite::Skip, _) => {
                self.skipped += 1;
                Ok((f64::NAN, loss, false, 0.0))
            }
            (OnNonFinite::Stop, Some((module, param))) => {
                Err(RuntimeError::NonFinite { module, param })
            }
            (OnNonFinite::Stop, None) => Err(RuntimeError::Model(
                "a gradient on another rank is not finite (that rank names it); the step was not applied".into(),
            )),
        }
    }
}

fn missing(what: &str, msg: &MsgId) -> RuntimeError {
    RuntimeError::Model(format!("no {what} for {msg:?}"))
}
