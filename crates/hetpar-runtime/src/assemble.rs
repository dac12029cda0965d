//! A rank's stages from a validated model graph: one per module the rank belongs to, built
//! in module order on every rank (so groups are created in one order).

use std::sync::Arc;

use candle_core::DType;
use hetpar_comm::{CommExt, Communicator};
use hetpar_layout::{Dtype, ModelGraph, ModuleSpec};
use hetpar_nn::kernels::linear::Matmul;
use hetpar_nn::layers::attention::CpMode;
use hetpar_nn::models::audio::{AudioConfig, AudioEncoder};
use hetpar_nn::models::llama::LlamaConfig;
use hetpar_nn::models::vit::{Vit, VitConfig};
use hetpar_nn::{Build, ParallelCtx};

use crate::data::{BatchSource, FileData};
use crate::error::RuntimeError;
use crate::stage::Stage;
use crate::stages::encoder::{EncoderModel, EncoderStage, ItemSource};
use crate::stages::llama::{LlamaStage, TextSource, stage_layers};
use crate::synthetic::Synthetic;

/// Where a rank gets its data.
#[derive(Clone)]
pub struct Sources {
    /// Each batch's manifest.
    pub batches: Arc<dyn BatchSource>,
    /// The LLM's text.
    pub text: Arc<dyn TextSource>,
    /// The encoders' inputs.
    pub items: Arc<dyn ItemSource>,
}

impl Sources {
    /// The in-process synthetic data of `graph` (`data.source = "synthetic"`).
    pub fn synthetic(graph: &ModelGraph) -> Sources {
        let data = Arc::new(Synthetic::new(graph));
        Sources { batches: data.clone(), text: data.clone(), items: data }
    }

    /// Rank `rank`'s data from files: `train` and, for held-out batches, `heldout`.
    pub fn files(
        graph: &ModelGraph,
        rank: usize,
        train: Arc<hetpar_data::Dataset>,
        heldout: Option<Arc<hetpar_data::Dataset>>,
    ) -> Sources {
        let data = Arc::new(FileData::new(graph, rank, train, heldout));
        Sources { batches: data.clone(), text: data.clone(), items: data }
    }
}

impl std::fmt::Debug for Sources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sources")
    }
}

/// The MoE load-balancing coefficient (Switch Transformer and Mixtral use 0.01-0.02).
pub const MOE_AUX_COEF: f64 = 0.01;

/// The stages of this rank (`world.global_rank()`) in `graph`, parameters in `dtype`. Under
/// `train.dtype = "bf16"` the parameters are f32 (`dtype` must say so) and the linear
/// layers and the attention core multiply in bf16 with f32 sums ([`Matmul::Bf16`]); under
/// `"f64"` they are f64. Under `"f32"` they are `dtype`'s (f64 where a caller compares at
/// f64 on an f32 config).
pub fn build_stages(
    world: &dyn Communicator,
    graph: &ModelGraph,
    dtype: DType,
    sources: &Sources,
) -> Result<Vec<Box<dyn Stage>>, RuntimeError> {
    let rank = world.global_rank();
    let llm = graph
        .modules
        .iter()
        .find(|m| matches!(m.spec, ModuleSpec::Llama { .. }))
        .ok_or_else(|| RuntimeError::Model("the graph has no llama module".into()))?;
    let matmul = match graph.train.dtype {
        Dtype::Bf16 if dtype != DType::F32 => {
            return Err(RuntimeError::Model(format!(
                "train.dtype bf16 keeps f32 parameters and multiplies in bf16; got {dtype:?} parameters"
            )));
        }
        Dtype::F64 if dtype != DType::F64 => {
            return Err(RuntimeError::Model(format!(
                "train.dtype f64 needs f64 parameters; got {dtype:?} parameters"
            )));
        }
        Dtype::Bf16 => Matmul::Bf16,
        Dtype::F32 | Dtype::F64 => Matmul::Native,
    };
    let mut out: Vec<Box<dyn Stage>> = Vec::new();
    for (id, m) in graph.modules.iter().enumerate() {
        if !m.layout.span().contains(rank) {
            continue;
        }
        let ctx = ParallelCtx::new(world, &m.layout)?;
        let b = Build::new(ctx.clone(), graph.train.seed, dtype).with_matmul(matmul);
        let d = m.dims;
        // An encoder's pipeline stage on this rank: its layers, whether it embeds, whether
        // it projects.
        let (pp, stage) = (m.layout.pp(), ctx.coords.pp_idx);
        let layers = stage_layers(d.layers, pp, stage);
        let (first, last) = (stage == 0, stage + 1 == pp);
        // An encoder's stage, fed by its one outgoing edge.
        let encoder = |model: EncoderModel| -> Result<Box<dyn Stage>, RuntimeError> {
            let mut out = graph.edges.iter().enumerate().filter(|(_, e)| e.src == id);
            let edge = match (out.next(), out.next()) {
                (Some((e, _)), None) => e,
                _ => {
                    return Err(RuntimeError::Model(format!(
                        "module {}: an encoder feeds exactly one edge here",
                        m.name
                    )));
                }
            };
            let (w, items) = (llm.dims.hidden, sources.items.clone());
            Ok(Box::new(EncoderStage::new(id, edge, ctx.clone(), dtype, w, model, items)?))
        };
        let stage: Box<dyn Stage> = match m.spec {
            ModuleSpec::Llama { vocab, kv_heads, experts, top_k } => {
                let cfg = LlamaConfig {
                    vocab,
                    hidden: d.hidden,
                    layers: d.layers,
                    heads: d.heads,
                    kv_heads,
                    ffn: d.ffn,
                    experts,
                    top_k,
                    rms_eps: 1e-5,
                    rope_theta: 10_000.0,
                    aux_coef: MOE_AUX_COEF,
                    cp_mode: CpMode::AllGather,
                };
                let (mbs, seq) = (graph.train.microbatches, graph.train.seq_len);
                Box::new(LlamaStage::new(&b, id, cfg, m.vpp, mbs, seq, sources.text.clone())?)
            }
            ModuleSpec::Vit { image_size, patch_size } => {
                let cfg = VitConfig {
                    image_size,
                    patch_size,
                    hidden: d.hidden,
                    layers: d.layers,
                    heads: d.heads,
                    ffn: d.ffn,
                    out_hidden: llm.dims.hidden,
                    ln_eps: 1e-6,
                    cp_mode: CpMode::AllGather,
                };
                encoder(EncoderModel::Vit(Vit::stage(&b, cfg, layers, first, last)?))?
            }
            ModuleSpec::Audio { n_mels, frames } => {
                let cfg = AudioConfig {
                    mels: n_mels,
                    frames,
                    hidden: d.hidden,
                    layers: d.layers,
                    heads: d.heads,
                    ffn: d.ffn,
                    out_hidden: llm.dims.hidden,
                    ln_eps: 1e-5,
                    cp_mode: CpMode::AllGather,
                };
                let model = AudioEncoder::stage(&b, cfg, layers, first, last)?;
                encoder(EncoderModel::Audio(model))?
            }
        };
        out.push(stage);
    }
    Ok(out)
}
