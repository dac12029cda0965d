//! What the encoders share: the pre-LN transformer layer with bidirectional attention and a
//! GELU MLP, and how a rank's part of each item (image, clip) is chosen under context and
//! sequence parallelism, and the trunk of a pipeline stage (its layers, then the final norm
//! and projector on the last stage).

use std::ops::Range;

use candle_core::Tensor;

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::layers::attention::{Attention, AttentionSpec, CpMode, CpPositions};
use crate::layers::linear::Build;
use crate::layers::mlp::GeluMlp;
use crate::layers::norm::LayerNorm;
use crate::params::{HasParams, Param};

/// Sizes of an encoder layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerShape {
    pub hidden: usize,
    pub heads: usize,
    pub ffn: usize,
    pub ln_eps: f64,
    /// Total layers (scales the output projections' initialization).
    pub layers: usize,
    /// Bias on the key projection.
    pub key_bias: bool,
    pub cp_mode: CpMode,
}

/// HF names inside one layer: the two norms, the attention block, the two MLP matrices.
pub(crate) struct LayerNames<'a> {
    pub ln1: &'a str,
    pub attn: &'a str,
    pub ln2: &'a str,
    pub fc1: &'a str,
    pub fc2: &'a str,
}

/// `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
#[derive(Debug)]
pub(crate) struct Layer {
    ln1: LayerNorm,
    attn: Attention,
    ln2: LayerNorm,
    mlp: GeluMlp,
}

impl Layer {
    /// Layer `prefix` with `names` under it.
    pub fn new(b: &Build, prefix: &str, names: &LayerNames<'_>, s: LayerShape) -> Result<Layer> {
        let std = 0.02;
        let out_std = std / (2.0 * s.layers as f64).sqrt();
        let spec = AttentionSpec {
            hidden: s.hidden,
            heads: s.heads,
            kv_heads: s.heads,
            causal: false,
            rope_theta: None,
            bias: true,
            key_bias: s.key_bias,
            cp_mode: s.cp_mode,
        };
        let n = |x: &str| format!("{prefix}.{x}");
        Ok(Layer {
            ln1: LayerNorm::new(b, &n(names.ln1), s.hidden, s.ln_eps)?,
            attn: Attention::new(b, &n(names.attn), "out_proj", spec, std, out_std)?,
            ln2: LayerNorm::new(b, &n(names.ln2), s.hidden, s.ln_eps)?,
            mlp: GeluMlp::new(
                b,
                &n(names.fc1),
                &n(names.fc2),
                (s.hidden, s.ffn, s.hidden),
                std,
                out_std,
            )?,
        })
    }

    /// The layer on `x [items, local_rows, hidden]`.
    pub fn forward(&self, x: &Tensor, positions: &CpPositions) -> Result<Tensor> {
        let x = self.attn.residual(x, &self.ln1, positions)?;
        self.mlp.residual(&x, &self.ln2)
    }
}

impl HasParams for Layer {
    fn params(&self) -> Vec<&Param> {
        let mut v = self.ln1.params();
        v.extend(self.attn.params());
        v.extend(self.ln2.params());
        v.extend(self.mlp.params());
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = self.ln1.params_mut();
        v.extend(self.attn.params_mut());
        v.extend(self.ln2.params_mut());
        v.extend(self.mlp.params_mut());
        v
    }
}

/// HF names of the final norm and the projector's two matrices.
pub(crate) struct HeadNames<'a> {
    pub norm: &'a str,
    pub proj1: &'a str,
    pub proj2: &'a str,
}

/// One pipeline stage's layers and, on the last stage, the final norm and the projector
/// into the LLM width.
#[derive(Debug)]
pub(crate) struct Trunk {
    layers: Vec<Layer>,
    head: Option<(LayerNorm, GeluMlp)>,
}

impl Trunk {
    /// Layers `layers` (named `{prefix}.{i}`), the head when `head` gives its names and the
    /// LLM width.
    pub fn new(
        b: &Build,
        prefix: &str,
        names: &LayerNames<'_>,
        shape: LayerShape,
        layers: Range<usize>,
        head: Option<(&HeadNames<'_>, usize)>,
    ) -> Result<Trunk> {
        let layers = layers
            .map(|i| Layer::new(b, &format!("{prefix}.{i}"), names, shape))
            .collect::<Result<_>>()?;
        let head = match head {
            Some((n, out)) => {
                let std = 0.02;
                let ln = LayerNorm::new(b, n.norm, shape.hidden, shape.ln_eps)?;
                let dims = (shape.hidden, out, out);
                Some((ln, GeluMlp::new(b, n.proj1, n.proj2, dims, std, std)?))
            }
            None => None,
        };
        Ok(Trunk { layers, head })
    }

    /// The layers over `x`, then the head where there is one.
    pub fn forward(&self, mut x: Tensor, positions: &CpPositions) -> Result<Tensor> {
        for l in &self.layers {
            x = l.forward(&x, positions)?;
        }
        match &self.head {
            Some((ln, projector)) => projector.forward(&ln.forward(&x)?),
            None => Ok(x),
        }
    }
}

impl HasParams for Trunk {
    fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = self.layers.iter().flat_map(|l| l.params()).collect();
        if let Some((ln, projector)) = &self.head {
            v.extend(ln.params());
            v.extend(projector.params());
        }
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v: Vec<&mut Param> = self.layers.iter_mut().flat_map(|l| l.params_mut()).collect();
        if let Some((ln, projector)) = &mut self.head {
            v.extend(ln.params_mut());
            v.extend(projector.params_mut());
        }
        v
    }
}

/// Row positions of every cp rank within an item of `rows` rows (contiguous equal parts)
/// and this rank's slot; the rows must split into cp x (tp under SP) equal parts.
pub(crate) fn cp_positions(ctx: &ParallelCtx, rows: usize, what: &str) -> Result<CpPositions> {
    let cp = ctx.cp.size();
    let parts = cp * if ctx.sp() { ctx.tp.size() } else { 1 };
    if !rows.is_multiple_of(parts) {
        return Err(NnError::Input(format!(
            "{rows} {what} do not split into cp x sp-tp = {parts} equal parts"
        )));
    }
    let per = rows / cp;
    Ok(CpPositions {
        ranks: (0..cp).map(|j| (j * per..(j + 1) * per).collect()).collect(),
        me: ctx.cp.rank,
    })
}

/// Row positions this rank holds within an item: its cp part, cut again over tp under SP.
pub(crate) fn local_positions(ctx: &ParallelCtx, rows: usize, what: &str) -> Result<Vec<usize>> {
    let own = cp_positions(ctx, rows, what)?.own().to_vec();
    if !ctx.sp() {
        return Ok(own);
    }
    let part = own.len() / ctx.tp.size();
    Ok(own[ctx.tp.rank * part..(ctx.tp.rank + 1) * part].to_vec())
}
