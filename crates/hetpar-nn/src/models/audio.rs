//! A Whisper-style audio encoder (Radford et al. 2022) with a 2-layer MLP projector into the
//! LLM width. The encoder has HF Whisper's names under `audio_tower.` (as Qwen2-Audio
//! stores it): `conv1`, `conv2`, `layers.{i}.{self_attn_layer_norm,self_attn.{q,k,v,out}_proj,
//! final_layer_norm,fc1,fc2}`, `layer_norm`; the projector is `audio_projector.linear_{1,2}`.
//!
//! A clip's log-mel features `[mels, frames]` go through two convolutions of width 3 with
//! GELU (the second with stride 2, so a clip gives `ceil(frames / 2)` rows), fixed
//! sinusoidal positions (Whisper's table, not trained), pre-LN transformer layers with
//! bidirectional attention (no bias on the key projection, as in Whisper), a final
//! LayerNorm and the projector. Each clip is its own sequence. Under context parallelism a
//! rank holds a contiguous part of every clip's rows (`cp` equal parts, cut again over `tp`
//! under SP), the split the boundary plans assume for sequence-sharded encoder outputs. The
//! convolutions run on the whole clip on every rank (they need neighbouring frames and are
//! a small part of the work); each rank keeps its rows after them.
//!
//! Under pipeline parallelism a rank builds one stage ([`AudioEncoder::stage`]): a range of
//! the layers, the convolutions and positions on the first stage, the final norm and
//! projector on the last; the stages between take and give hidden states `[clips,
//! local_rows, hidden]`.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use crate::ctx::ParallelCtx;
use crate::error::{NnError, Result};
use crate::init::Init;
use crate::kernels::linear::{Matmul, linear_bias_as};
use crate::kernels::pointwise::gelu_as;
use crate::layers::attention::{CpMode, CpPositions};
use crate::layers::linear::Build;
use crate::models::encoder::{self, HeadNames, LayerNames, LayerShape, Trunk};
use crate::params::{HasParams, Param};

/// The prefix of the encoder's names (not of its projector's): Qwen2-Audio's.
pub const PREFIX: &str = "audio_tower";

/// Sizes and options of an audio encoder.
#[derive(Clone, Copy, Debug)]
pub struct AudioConfig {
    /// Mel bands of the input features.
    pub mels: usize,
    /// Feature frames per clip.
    pub frames: usize,
    /// Width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Heads.
    pub heads: usize,
    /// MLP width.
    pub ffn: usize,
    /// Output width: the LLM's hidden size.
    pub out_hidden: usize,
    /// LayerNorm epsilon.
    pub ln_eps: f64,
    /// Context-parallel attention mode.
    pub cp_mode: CpMode,
}

impl AudioConfig {
    /// Rows (encoder positions, and output rows) per clip: the stride-2 convolution halves
    /// the frames, rounding up.
    pub fn rows(&self) -> usize {
        self.frames.div_ceil(2)
    }
}

/// Whisper's sinusoidal position table `[length, channels]`: `sin` of each position times
/// `channels / 2` timescales spaced geometrically from 1 to 10,000, then `cos` of the same.
pub fn sinusoids(length: usize, channels: usize, dtype: DType) -> Result<Tensor> {
    if !channels.is_multiple_of(2) || channels < 4 {
        return Err(NnError::Input(format!(
            "sinusoidal positions need an even width of at least 4, not {channels}"
        )));
    }
    let half = channels / 2;
    let step = (10_000f64).ln() / (half - 1) as f64;
    let mut table = Vec::with_capacity(length * channels);
    for t in 0..length {
        let angle = |i: usize| t as f64 * (-step * i as f64).exp();
        table.extend((0..half).map(|i| angle(i).sin()));
        table.extend((0..half).map(|i| angle(i).cos()));
    }
    Ok(Tensor::from_vec(table, (length, channels), &Device::Cpu)?.to_dtype(dtype)?)
}

/// A convolution of width 3 over time with padding 1 (HF `Conv1d` weight `[out, in, 3]`),
/// as one matrix product over the frames each output reads.
#[derive(Debug)]
struct Conv {
    weight: Param,
    bias: Param,
    stride: usize,
    /// How its product multiplies (the model's linear layers' way).
    matmul: Matmul,
}

impl Conv {
    fn new(b: &Build, name: &str, (input, output): (usize, usize), stride: usize) -> Result<Conv> {
        Ok(Conv {
            weight: b.replicated(
                format!("{name}.weight"),
                &[output, input, 3],
                Init::Normal(0.02),
            )?,
            bias: b.replicated(format!("{name}.bias"), &[output], Init::Const(0.0))?,
            stride,
            matmul: b.matmul,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        conv3(self.matmul, x, self.weight.tensor(), self.bias.tensor(), self.stride)
    }
}

/// A width-3 convolution with padding 1 on time-major `x [n, frames, in]` with weight
/// `[out, in, 3]` and bias `[out]`: `[n, ceil(frames / stride), out]`, multiplying as `how`
/// says.
fn conv3(how: Matmul, x: &Tensor, w: &Tensor, bias: &Tensor, stride: usize) -> Result<Tensor> {
    let (n, frames, input) = x.dims3()?;
    let out_frames = frames.div_ceil(stride);
    let padded = x.pad_with_zeros(1, 1, 1)?.contiguous()?;
    // Output frame t reads padded frames t*stride + k, k = 0, 1, 2.
    let idx: Vec<u32> =
        (0..out_frames).flat_map(|t| (0..3).map(move |k| (t * stride + k) as u32)).collect();
    let idx = Tensor::from_vec(idx, out_frames * 3, &Device::Cpu)?;
    let cols = padded.index_select(&idx, 1)?.reshape((n, out_frames, 3 * input))?;
    // Weight [out, in, 3] -> [out, 3, in] to match the columns' (k, channel) order.
    let out = w.dims()[0];
    let w = w.permute((0, 2, 1))?.contiguous()?.reshape((out, 3 * input))?;
    Ok(linear_bias_as(how, &cols, &w, bias)?)
}

/// The convolution stem and fixed positions (the first pipeline stage's).
#[derive(Debug)]
struct Stem {
    conv1: Conv,
    conv2: Conv,
    positions: Tensor,
}

/// The audio encoder and projector (or one pipeline stage of them) on one rank.
#[derive(Debug)]
pub struct AudioEncoder {
    ctx: Arc<ParallelCtx>,
    cfg: AudioConfig,
    stem: Option<Stem>,
    trunk: Trunk,
}

impl AudioEncoder {
    /// The model; every rank of the module builds its shard.
    pub fn new(b: &Build, cfg: AudioConfig) -> Result<AudioEncoder> {
        Self::stage(b, cfg, 0..cfg.layers, true, true)
    }

    /// Layers `layers`, the stem if `first`, the final norm and projector if `last`.
    pub fn stage(
        b: &Build,
        cfg: AudioConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
    ) -> Result<AudioEncoder> {
        let shape = LayerShape {
            hidden: cfg.hidden,
            heads: cfg.heads,
            ffn: cfg.ffn,
            ln_eps: cfg.ln_eps,
            layers: cfg.layers,
            key_bias: false,
            cp_mode: cfg.cp_mode,
        };
        let names = LayerNames {
            ln1: "self_attn_layer_norm",
            attn: "self_attn",
            ln2: "final_layer_norm",
            fc1: "fc1",
            fc2: "fc2",
        };
        let t = PREFIX;
        let norm = format!("{t}.layer_norm");
        let head = HeadNames {
            norm: &norm,
            proj1: "audio_projector.linear_1",
            proj2: "audio_projector.linear_2",
        };
        let head = last.then_some((&head, cfg.out_hidden));
        let trunk = Trunk::new(b, &format!("{t}.layers"), &names, shape, layers, head)?;
        let stem = if first {
            Some(Stem {
                conv1: Conv::new(b, &format!("{t}.conv1"), (cfg.mels, cfg.hidden), 1)?,
                conv2: Conv::new(b, &format!("{t}.conv2"), (cfg.hidden, cfg.hidden), 2)?,
                positions: sinusoids(cfg.rows(), cfg.hidden, b.dtype)?,
            })
        } else {
            None
        };
        Ok(AudioEncoder { ctx: b.ctx.clone(), cfg, stem, trunk })
    }

    /// The configuration.
    pub fn config(&self) -> &AudioConfig {
        &self.cfg
    }

    /// Row positions of every cp rank (contiguous equal parts) and this rank's slot.
    pub fn cp_positions(&self) -> Result<CpPositions> {
        encoder::cp_positions(&self.ctx, self.cfg.rows(), "rows per clip")
    }

    /// Row positions this rank holds (its cp part, cut again over tp under SP).
    pub fn local_positions(&self) -> Result<Vec<usize>> {
        encoder::local_positions(&self.ctx, self.cfg.rows(), "rows per clip")
    }

    /// This stage's forward: `features` `[clips, mels, frames]` (log-mel) on the first
    /// stage, hidden states `[clips, local_rows, hidden]` on the others; projected rows
    /// `[clips, local_rows, out_hidden]` (this rank's rows of every clip, in order) out of
    /// the last, hidden states out of the others.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let x = match &self.stem {
            Some(stem) => self.stem(stem, input)?,
            None => input.clone(),
        };
        self.trunk.forward(x, &self.cp_positions()?)
    }

    fn stem(&self, stem: &Stem, features: &Tensor) -> Result<Tensor> {
        let (_, mels, frames) = features.dims3()?;
        if mels != self.cfg.mels || frames != self.cfg.frames {
            return Err(NnError::Input(format!(
                "audio features are {mels} mels x {frames} frames, the encoder takes {} x {}",
                self.cfg.mels, self.cfg.frames
            )));
        }
        let dtype = stem.conv1.weight.tensor().dtype();
        let x = features.to_dtype(dtype)?.transpose(1, 2)?.contiguous()?;
        let x = gelu_as(stem.conv1.matmul, &stem.conv1.forward(&x)?)?;
        let x = gelu_as(stem.conv2.matmul, &stem.conv2.forward(&x)?)?;
        let local = self.local_positions()?;
        let idx = Tensor::from_vec(
            local.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            local.len(),
            &Device::Cpu,
        )?;
        let pos = stem.positions.index_select(&idx, 0)?.unsqueeze(0)?;
        Ok(x.index_select(&idx, 1)?.broadcast_add(&pos)?)
    }
}

impl HasParams for AudioEncoder {
    fn params(&self) -> Vec<&Param> {
        let mut v = Vec::new();
        if let Some(s) = &self.stem {
            v.extend([&s.conv1.weight, &s.conv1.bias, &s.conv2.weight, &s.conv2.bias]);
        }
        v.extend(self.trunk.params());
        v
    }

    fn params_mut(&mut self) -> Vec<&mut Param> {
        let mut v = Vec::new();
        if let Some(s) = &mut self.stem {
            let (c1, c2) = (&mut s.conv1, &mut s.conv2);
            v.extend([&mut c1.weight, &mut c1.bias, &mut c2.weight, &mut c2.bias]);
        }
        v.extend(self.trunk.params_mut());
        v
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_convolutions_match_candles_conv1d() {
        let (n, c, out) = (2, 5, 6);
        let g = |shape: &[usize], seed: u64| {
            let len: usize = shape.iter().product();
            let v: Vec<f64> = (0..len)
                .map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f64 / 500.0 - 1.0)
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
        };
        for frames in [1, 2, 7, 10] {
            for stride in [1, 2] {
                let x = g(&[n, c, frames], 1);
                let (w, b) = (g(&[out, c, 3], 2), g(&[out], 3));
                let want = x
                    .conv1d(&w, 1, stride, 1, 1)
                    .unwrap()
                    .broadcast_add(&b.reshape((1, out, 1)).unwrap())
                    .unwrap();
                let got = conv3(Matmul::Native, &x.transpose(1, 2).unwrap(), &w, &b, stride)
                    .unwrap()
                    .transpose(1, 2)
                    .unwrap();
                assert_eq!(got.dims(), want.dims(), "frames {frames} stride {stride}");
                let d = (got - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(d < 1e-12, "frames {frames} stride {stride}: {d}");
            }
        }
    }

    #[test]
    fn sinusoids_follow_whisper() {
        let t = sinusoids(5, 8, DType::F64).unwrap();
        let v: Vec<Vec<f64>> = t.to_vec2().unwrap();
        // Position 0: sin 0, cos 1; the slowest timescale is 10,000.
        assert_eq!(v[0], [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        assert!((v[3][3] - (3.0f64 / 10_000.0).sin()).abs() < 1e-15);
        assert!((v[3][0] - 3.0f64.sin()).abs() < 1e-15);
        assert!((v[4][5] - (4.0f64 * 10_000f64.powf(-1.0 / 3.0)).cos()).abs() < 1e-14);
        assert!(sinusoids(2, 5, DType::F32).is_err());
    }
}
