//! The Llama LLM as a [`Stage`]: virtual stage `v` holds an even share of the layers (the
//! earlier stages take the remainder), the embedding on stage 0, the final norm, head and
//! loss on the last.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use hetpar_comm::{CommExt, ReduceOp};
use hetpar_layout::ownership::SeqSplit;
use hetpar_layout::{BatchManifest, ModuleId};
use hetpar_nn::layers::attention::CpPositions;
use hetpar_nn::layers::loss::cross_entropy;
use hetpar_nn::models::llama::{Boundary, Llama, LlamaBatch, LlamaConfig};
use hetpar_nn::{Build, HasParams, ParallelCtx, Param};

use crate::error::RuntimeError;
use crate::stage::{BoundaryIn, Forward, NO_TOP, Scored, Stage};

/// The text of one step: every sample's token ids and next-token targets (negative where
/// no loss is taken: padding, encoder rows and the positions before them), `seq` per
/// sample, samples in canonical order. Encoder rows replace the tokens at their positions.
#[derive(Clone, Debug, PartialEq)]
pub struct TextBatch {
    /// Positions per sample.
    pub seq: usize,
    /// Token ids, `[samples, seq]`.
    pub tokens: Vec<u32>,
    /// Targets, `[samples, seq]`.
    pub targets: Vec<i64>,
    /// Whether the last stage scores each target (held-out batches: is the model's top
    /// token the target?).
    pub score: bool,
}

impl TextBatch {
    /// Samples.
    pub fn samples(&self) -> usize {
        self.tokens.len() / self.seq
    }

    /// Target tokens of the whole step: the loss's denominator.
    pub fn n_targets(&self) -> usize {
        self.targets.iter().filter(|&&t| t >= 0).count()
    }
}

/// Where a Llama stage gets each step's text.
pub trait TextSource: Send + Sync {
    /// The text of step `step` with manifest `manifest`, the same on every rank.
    fn text(&self, step: usize, manifest: &BatchManifest) -> Result<TextBatch, RuntimeError>;
}

/// Layers of virtual stage `v` of `n` over `layers` (earlier stages take the remainder).
pub fn stage_layers(layers: usize, n: usize, v: usize) -> Range<usize> {
    let start = |v: usize| v * (layers / n) + v.min(layers % n);
    start(v)..start(v + 1)
}

/// A Llama module's virtual stages on one rank.
pub struct LlamaStage {
    module: ModuleId,
    ctx: Arc<ParallelCtx>,
    cfg: LlamaConfig,
    dtype: DType,
    microbatches: usize,
    n_vstages: usize,
    /// Chunks by virtual stage.
    chunks: Vec<(usize, Llama)>,
    source: Arc<dyn TextSource>,
    step: Option<(TextBatch, BatchManifest)>,
    positions: CpPositions,
    /// Index of each sequence position this rank holds in its local (SP-cut) sequence.
    local: HashMap<usize, usize>,
}

impl std::fmt::Debug for LlamaStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v: Vec<usize> = self.chunks.iter().map(|c| c.0).collect();
        write!(f, "LlamaStage(rank {}, virtual stages {v:?})", self.ctx.rank)
    }
}

impl LlamaStage {
    /// This rank's chunks of a Llama model with `vpp` virtual stages per pipeline rank.
    pub fn new(
        b: &Build,
        module: ModuleId,
        cfg: LlamaConfig,
        vpp: usize,
        microbatches: usize,
        seq: usize,
        source: Arc<dyn TextSource>,
    ) -> Result<LlamaStage, RuntimeError> {
        let ctx = b.ctx.clone();
        let pp = ctx.layout.pp();
        let n = pp * vpp;
        let chunks = (0..vpp)
            .map(|c| {
                let v = c * pp + ctx.coords.pp_idx;
                let layers = stage_layers(cfg.layers, n, v);
                Ok((v, Llama::stage(b, cfg, layers, v == 0, v == n - 1)?))
            })
            .collect::<Result<_, RuntimeError>>()?;
        let positions = CpPositions::sequence(&ctx.layout, seq, ctx.coords.cp_idx);
        let owned = SeqSplit::new(seq, &ctx.layout).owned(ctx.coords.cp_idx, ctx.coords.tp_idx);
        let local = owned.into_iter().flatten().enumerate().map(|(i, p)| (p, i)).collect();
        Ok(LlamaStage {
            local,
            module,
            cfg,
            dtype: b.dtype,
            microbatches,
            n_vstages: n,
            chunks,
            source,
            step: None,
            positions,
            ctx,
        })
    }

    fn chunk(&self, vstage: usize) -> Result<&Llama, RuntimeError> {
        self.chunks.iter().find(|c| c.0 == vstage).map(|c| &c.1).ok_or_else(|| {
            RuntimeError::Model(format!(
                "rank {} holds no virtual stage {vstage} of the llm",
                self.ctx.rank
            ))
        })
    }

    fn step(&self) -> Result<&(TextBatch, BatchManifest), RuntimeError> {
        self.step.as_ref().ok_or_else(|| RuntimeError::Model("no step has begun".into()))
    }

    /// Samples of this rank's replica in microbatch `mb`.
    fn samples(&self, mb: usize) -> Result<Range<usize>, RuntimeError> {
        let (_, manifest) = self.step()?;
        Ok(manifest.replica_samples(self.ctx.layout.dp(), self.ctx.coords.dp_idx, mb))
    }

    /// The encoder rows of `boundary` placed at their slots in this rank's embedded tokens
    /// (`[samples * local_seq]`, sample-major), all edges together.
    fn boundary(
        &self,
        mb: usize,
        boundary: &[BoundaryIn<'_>],
    ) -> Result<Option<Boundary>, RuntimeError> {
        if boundary.is_empty() {
            return Ok(None);
        }
        let samples = self.samples(mb)?;
        let per = self.local.len();
        let mut slots = Vec::new();
        let mut rows = Vec::with_capacity(boundary.len());
        for b in boundary {
            let needed = b.geometry.needed.get(&self.ctx.rank).map_or(&[][..], |v| &v[..]);
            if b.rows.dims2()? != (needed.len(), self.cfg.hidden) {
                return Err(RuntimeError::Boundary {
                    edge: format!("edge {}", b.edge),
                    message: format!(
                        "rank {} received rows {:?}, the plan needs {} rows of width {}",
                        self.ctx.rank,
                        b.rows.dims(),
                        needed.len(),
                        self.cfg.hidden
                    ),
                });
            }
            for &i in needed {
                let row = &b.geometry.rows[i];
                let local = self.local.get(&row.pos).filter(|_| samples.contains(&row.id.sample));
                let Some(&local) = local else {
                    return Err(RuntimeError::Boundary {
                        edge: format!("edge {}", b.edge),
                        message: format!(
                            "rank {} is given row {} at position {}, which it does not hold",
                            self.ctx.rank, row.id, row.pos
                        ),
                    });
                };
                slots.push((row.id.sample - samples.start) * per + local);
            }
            rows.push(b.rows.clone());
        }
        Ok(Some(Boundary { rows: Tensor::cat(&rows, 0)?, slots }))
    }

    /// `field` (token ids or targets) of this rank's samples at its cp positions.
    fn local<T: Copy>(&self, mb: usize, field: &[T]) -> Result<Vec<T>, RuntimeError> {
        let seq = self.step()?.0.seq;
        let own = self.positions.own();
        Ok(self.samples(mb)?.flat_map(|s| own.iter().map(move |&p| field[s * seq + p])).collect())
    }

    /// Whether the top logit at each target position this rank holds the column of is the
    /// target: the row's maximum over the whole vocabulary (one max all-reduce over tp),
    /// compared with the target's logit by the tp rank holding it, so each target is
    /// scored once. A tie counts as correct. With it, the row's top token: the target where
    /// it holds the maximum, else the lowest column holding it (one min all-reduce over tp
    /// of each shard's first; none where the maximum is NaN).
    /// Only three values per row leave the logits (its maximum, its first column holding
    /// it and the target's logit), so scoring costs no copy of the vocabulary shard.
    fn score(&self, mb: usize, logits: &Tensor) -> Result<Vec<Scored>, RuntimeError> {
        let targets = self.local(mb, &self.step()?.0.targets)?;
        let logits = logits.detach();
        let width = logits.dim(1)?;
        let host = |t: Tensor| -> Result<Vec<f64>, RuntimeError> {
            Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
        };
        let local = host(logits.max_keepdim(1)?)?;
        let mut max = local.clone();
        if let Some(c) = self.ctx.tp.comm() {
            c.all_reduce(&mut max, ReduceOp::Max)?;
        }
        let cols = self.ctx.tp.rank * width..(self.ctx.tp.rank + 1) * width;
        // This shard's first column holding the row's maximum (none: `f64::MAX`, which
        // becomes `NO_TOP`), then the lowest over tp. Token ids are exact in f64.
        let first: Vec<u32> = logits.argmax_keepdim(1)?.flatten_all()?.to_vec1()?;
        let mut top: Vec<f64> = (0..local.len())
            .map(|r| {
                if local[r] >= max[r] { (cols.start + first[r] as usize) as f64 } else { f64::MAX }
            })
            .collect();
        if let Some(c) = self.ctx.tp.comm() {
            c.all_reduce(&mut top, ReduceOp::Min)?;
        }
        // The column of each row's target in this shard (0 where another rank holds it).
        let mine = |t: i64| usize::try_from(t).ok().filter(|t| cols.contains(t));
        let at: Vec<u32> =
            targets.iter().map(|&t| mine(t).map_or(0, |t| (t - cols.start) as u32)).collect();
        let at = Tensor::from_vec(at, (targets.len(), 1), logits.device())?;
        let picked = host(logits.gather(&at, 1)?)?;
        let (own, samples) = (self.positions.own(), self.samples(mb)?);
        let mut out = Vec::new();
        for (r, &t) in targets.iter().enumerate() {
            if let Some(target) = mine(t) {
                let top = match top[r] {
                    _ if picked[r] >= max[r] => target as u32,
                    id if id < f64::from(NO_TOP) => id as u32,
                    _ => NO_TOP,
                };
                out.push(Scored {
                    sample: samples.start + r / own.len(),
                    pos: own[r % own.len()],
                    target: target as u32,
                    top,
                });
            }
        }
        Ok(out)
    }

    /// Token ids and targets of this rank's samples at its cp positions.
    fn batch(&self, mb: usize) -> Result<LlamaBatch, RuntimeError> {
        let text = &self.step()?.0;
        Ok(LlamaBatch {
            tokens: self.local(mb, &text.tokens)?,
            batch: self.samples(mb)?.len(),
            positions: self.positions.clone(),
            boundary: None,
            targets: Arc::new(self.local(mb, &text.targets)?),
        })
    }
}

impl Stage for LlamaStage {
    fn module(&self) -> ModuleId {
        self.module
    }

    fn ctx(&self) -> &ParallelCtx {
        &self.ctx
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn n_vstages(&self) -> usize {
        self.n_vstages
    }

    fn width(&self) -> usize {
        self.cfg.hidden
    }

    fn begin_step(&mut self, step: usize, manifest: &BatchManifest) -> Result<(), RuntimeError> {
        if manifest.n_microbatches() != self.microbatches {
            return Err(RuntimeError::Model(format!(
                "the manifest has {} microbatches, the llm was built for {}",
                manifest.n_microbatches(),
                self.microbatches
            )));
        }
        let text = self.source.text(step, manifest)?;
        self.step = Some((text, manifest.clone()));
        Ok(())
    }

    fn input_shape(&self, _vstage: usize, mb: usize) -> Result<Vec<usize>, RuntimeError> {
        Ok(vec![self.samples(mb)?.len(), self.local.len(), self.cfg.hidden])
    }

    fn forward(
        &mut self,
        vstage: usize,
        mb: usize,
        input: Option<&Tensor>,
        boundary: &[BoundaryIn<'_>],
    ) -> Result<Forward, RuntimeError> {
        let chunk = self.chunk(vstage)?;
        let x = match input {
            Some(x) => x.clone(),
            None => {
                let mut batch = self.batch(mb)?;
                batch.boundary = self.boundary(mb, boundary)?;
                chunk.embed(&batch)?
            }
        };
        let (x, aux) = chunk.layers(&x, &self.positions)?;
        let aux = (self.cfg.experts > 0).then_some(aux);
        if vstage + 1 < self.n_vstages {
            return Ok(Forward { out: Some(x), loss: aux, ..Forward::default() });
        }
        let text = &self.step()?.0;
        let (targets, n) = (Arc::new(self.local(mb, &text.targets)?), text.n_targets().max(1));
        let logits = chunk.logits(&x)?;
        let scored = if text.score { self.score(mb, &logits)? } else { Vec::new() };
        let loss_sum = cross_entropy(&self.ctx, &logits, targets)?.sum_all()?;
        let ce = (loss_sum / n as f64)?;
        // Every tp rank holds the same loss; tp rank 0 reports it.
        let reported = if self.ctx.coords.tp_idx == 0 {
            ce.to_dtype(DType::F64)?.to_scalar::<f64>()?
        } else {
            0.0
        };
        let loss = match aux {
            Some(a) => (ce + a)?,
            None => ce,
        };
        Ok(Forward { out: None, loss: Some(loss), reported, scored })
    }

    fn params(&self) -> Vec<&Param> {
        self.chunks.iter().flat_map(|c| c.1.params()).collect()
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.chunks.iter_mut().flat_map(|c| c.1.params_mut()).collect()
    }
}
