//! What a module keeps in memory on one rank, and offload: a colocated encoder's
//! parameters, gradients and optimizer state packed into one compact host buffer while the
//! LLM pipeline runs (the tensors dropped), and unpacked for its backward and step.
//!
//! On this CPU build host and device memory are the same, so offload shrinks the working
//! set of tensors the executor holds; on a GPU build the same buffer is where device
//! memory goes. The parameters go only where the encoder's phase-1 forwards kept no
//! autograd graph (`recompute`): a kept graph references them, so releasing them would free
//! nothing, and candle cannot release a tensor's storage in place.
//!
//! Before a run: [`ActivationFloor`], a floor of the activations each forward keeps for its
//! backward, which [`activations_held`] sums over a step's schedule for the ranks that
//! share a machine's memory.

use candle_core::{DType, Device, Tensor, Var, WithDType};
use hetpar_layout::{BatchManifest, ModelGraph, ModuleSpec};
use hetpar_nn::kernels::attention::FlashAttention;
use hetpar_schedule::{Compute, Held, Keeps, Pass, PipelineGraph, Schedule, Work};

use crate::error::RuntimeError;
use crate::stages::llama::stage_layers;

type Result<T> = std::result::Result<T, RuntimeError>;

/// Bytes of one module on one rank, the largest value seen over a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    /// Everything the executor holds for the module (parameters, gradients, optimizer
    /// state, stashed activations and their gradients), the step's high-water mark.
    pub peak: u64,
    /// The same while the LLM computes (phase 2 of a colocated step): where offload shows.
    pub llm_phase: u64,
    /// Host buffer of an offloaded module, at its largest.
    pub host: u64,
}

impl Resident {
    /// The larger of each field.
    pub fn max(self, o: Resident) -> Resident {
        Resident {
            peak: self.peak.max(o.peak),
            llm_phase: self.llm_phase.max(o.llm_phase),
            host: self.host.max(o.host),
        }
    }
}

/// Bytes of `tensors`' elements.
pub fn bytes<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
    tensors.into_iter().map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum()
}

/// Tensors packed into one contiguous host buffer, in order, with their shapes.
#[derive(Debug)]
pub struct HostCopy {
    dtype: DType,
    shapes: Vec<Vec<usize>>,
    data: Vec<u8>,
}

impl HostCopy {
    /// Packs `tensors` (one dtype) into one buffer; the caller drops the tensors.
    pub fn pack(tensors: &[Tensor], dtype: DType) -> Result<HostCopy> {
        let mut data = Vec::with_capacity(bytes(tensors) as usize);
        let mut shapes = Vec::with_capacity(tensors.len());
        for t in tensors {
            if t.dtype() != dtype {
                return Err(RuntimeError::Model(format!(
                    "offload packs one dtype ({dtype:?}), got a {:?} tensor",
                    t.dtype()
                )));
            }
            shapes.push(t.dims().to_vec());
            let flat = t.flatten_all()?;
            match dtype {
                DType::F32 => {
                    data.extend(flat.to_vec1::<f32>()?.iter().flat_map(|x| x.to_ne_bytes()))
                }
                DType::F64 => {
                    data.extend(flat.to_vec1::<f64>()?.iter().flat_map(|x| x.to_ne_bytes()))
                }
                other => {
                    return Err(RuntimeError::Model(format!("offload of {other:?} tensors")));
                }
            }
        }
        Ok(HostCopy { dtype, shapes, data })
    }

    /// Bytes held.
    pub fn len(&self) -> u64 {
        self.data.len() as u64
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The tensors back, as packed; those from index `vars_from` on come back as variables
    /// (trainable parameters: `Var::from_tensor` takes them without a copy).
    pub fn unpack(self, vars_from: usize) -> Result<Vec<Tensor>> {
        let size = self.dtype.size_in_bytes();
        let mut at = 0;
        let mut out = Vec::with_capacity(self.shapes.len());
        for (i, shape) in self.shapes.iter().enumerate() {
            let var = i >= vars_from;
            let n: usize = shape.iter().product();
            let chunk = &self.data[at..at + n * size];
            at += n * size;
            let t = match self.dtype {
                DType::F32 => {
                    let v: Vec<f32> = chunk
                        .chunks_exact(4)
                        .map(|b| f32::from_ne_bytes(b.try_into().expect("4 bytes")))
                        .collect();
                    tensor(v, shape, var)?
                }
                _ => {
                    let v: Vec<f64> = chunk
                        .chunks_exact(8)
                        .map(|b| f64::from_ne_bytes(b.try_into().expect("8 bytes")))
                        .collect();
                    tensor(v, shape, var)?
                }
            };
            out.push(t);
        }
        Ok(out)
    }
}

/// A tensor of `v`, a variable (tracked by autograd) if `var`.
fn tensor<T: WithDType>(v: Vec<T>, shape: &[usize], var: bool) -> Result<Tensor> {
    Ok(if var {
        Var::from_vec(v, shape, &Device::Cpu)?.into_inner()
    } else {
        Tensor::from_vec(v, shape, &Device::Cpu)?
    })
}

/// A floor of the bytes each forward pass keeps for its backward, by rank and pass. Per row
/// and layer it counts what every path of the runtime keeps (the fused one-rank blocks keep
/// exactly this, composed operations more):
/// - the LLM: the attention's q, k, v and output, a dense SwiGLU MLP's gate, up and product
///   (an MoE layer's routed rows are not bounded on any one rank), the layer's input for
///   its norm; on the last virtual stage the vocabulary-parallel logits;
/// - an encoder: the attention's q, k, v and output, the GELU MLP's input and output, the
///   layer's input, and where an item's rows are few enough for the attention kernel to
///   keep its probabilities ([`FlashAttention::keeps_probabilities`]: at most 256), those
///   (`heads` times the item's rows, per row).
///
/// A recomputed module's pass (`recompute`) keeps only the hidden states it received and
/// passed on, and builds the rest again when its backward begins. The per-layer terms are
/// the tensors of Korthikanti et al., "Reducing Activation Recomputation in Large
/// Transformer Models" (2022), section 4.1, that a fused attention keeps (no score matrix
/// but a short encoder's) and that no path here drops.
///
/// Heads, MLPs and the vocabulary split over `tp`, rows over `cp` (and a layer's input over
/// `tp` under SP). The LLM's rows are its samples of a microbatch over `dp` times
/// `seq_len`; an encoder replica's are the rows of the items it owns in that microbatch of
/// the given manifest (none without one).
#[derive(Debug)]
pub struct ActivationFloor<'a> {
    graph: &'a ModelGraph,
    work: Option<Work>,
    elem: f64,
}

impl<'a> ActivationFloor<'a> {
    /// The floor of `graph` in elements of `elem` bytes, encoders counted from `manifest`
    /// (the first step a run takes).
    pub fn new(
        graph: &'a ModelGraph,
        manifest: Option<&BatchManifest>,
        elem: usize,
    ) -> ActivationFloor<'a> {
        let work = manifest.map(|m| Work::from_manifest(&PipelineGraph::from_model(graph), m));
        ActivationFloor { graph, work, elem: elem as f64 }
    }

    /// Rows of `rank` in module `m` for microbatch `mb` (0 off the module).
    pub fn rows(&self, m: usize, rank: usize, mb: usize) -> usize {
        let module = &self.graph.modules[m];
        let l = &module.layout;
        let Some(at) = l.coords(rank) else { return 0 };
        match module.spec.rows_per_item() {
            None => self.graph.microbatch_size() / l.dp() * self.graph.train.seq_len / l.cp(),
            Some(per_item) => {
                let items = self.work.as_ref().and_then(|w| w.items(m, at.dp_idx, mb));
                items.unwrap_or(0) * per_item / l.cp()
            }
        }
    }

    /// Layers of virtual stage `vstage` of module `m`.
    pub fn layers(&self, m: usize, vstage: usize) -> usize {
        let module = &self.graph.modules[m];
        let n = module.layout.pp() * module.vpp.max(1);
        stage_layers(module.dims.layers, n, vstage).len()
    }

    /// The bytes forward `c` on `rank` builds for its backward: what it keeps unless the
    /// module is recomputed, and what its recomputation builds again when the backward
    /// begins.
    pub fn graph_bytes(&self, rank: usize, c: &Compute) -> f64 {
        let module = &self.graph.modules[c.module];
        let l = &module.layout;
        let (h, tp) = (module.dims.hidden as f64, l.tp() as f64);
        let input = if l.sp() { h / tp } else { h };
        let ffn = module.dims.ffn as f64;
        let (per_layer, last) = match module.spec {
            ModuleSpec::Llama { vocab, kv_heads, experts, .. } => {
                let kv = kv_heads as f64 * h / module.dims.heads.max(1) as f64;
                let mlp = if experts == 0 { 3.0 * ffn } else { 0.0 };
                let logits = if self.last(c) { vocab as f64 / tp } else { 0.0 };
                ((2.0 * h + 2.0 * kv + mlp) / tp + input, logits)
            }
            _ => {
                // The attention probabilities the kernel keeps for its backward: an
                // encoder's queries (an item's rows over cp) attend, unmasked and without a
                // log-sum-exp (all-gather CP, as the runtime builds encoders), to all of
                // their item's rows.
                let probs = match module.spec.rows_per_item() {
                    Some(s)
                        if FlashAttention::keeps_probabilities(
                            false,
                            false,
                            s.div_ceil(l.cp()),
                            s,
                        ) =>
                    {
                        (module.dims.heads * s) as f64
                    }
                    _ => 0.0,
                };
                ((4.0 * h + 2.0 * ffn + probs) / tp + input, 0.0)
            }
        };
        let layers = self.layers(c.module, c.vstage) as f64;
        (per_layer * layers + last) * self.rows(c.module, rank, c.mb) as f64 * self.elem
    }

    /// The bytes a recomputed forward `c` on `rank` keeps until its backward: the hidden
    /// states it received from the stage before and the ones it passed on (an encoder's
    /// last stage passes its rows on at the LLM's width; the LLM's last, a loss), split
    /// over tp under SP as the pipeline carries them.
    pub fn edge_bytes(&self, rank: usize, c: &Compute) -> f64 {
        let module = &self.graph.modules[c.module];
        let output = match (self.last(c), &module.spec) {
            (false, _) => module.dims.hidden as f64,
            (true, ModuleSpec::Llama { .. }) => 0.0,
            (true, _) => self
                .graph
                .edges
                .iter()
                .find(|e| e.src == c.module)
                .map_or(0.0, |e| self.graph.modules[e.dst].dims.hidden as f64),
        };
        (self.received(c) + self.carried(c, output))
            * self.rows(c.module, rank, c.mb) as f64
            * self.elem
    }

    /// The width of the hidden states pass `c` received from the stage before (0 on the
    /// first), as the pipeline carries them.
    fn received(&self, c: &Compute) -> f64 {
        let h = self.graph.modules[c.module].dims.hidden as f64;
        if c.vstage > 0 { self.carried(c, h) } else { 0.0 }
    }

    /// `width` as module `c.module`'s pipeline carries it: split over tp under SP.
    fn carried(&self, c: &Compute, width: f64) -> f64 {
        let l = &self.graph.modules[c.module].layout;
        if l.sp() { width / l.tp() as f64 } else { width }
    }

    /// Whether `c` is of its module's last virtual stage.
    fn last(&self, c: &Compute) -> bool {
        let module = &self.graph.modules[c.module];
        c.vstage + 1 == module.layout.pp() * module.vpp.max(1)
    }
}

impl Keeps for ActivationFloor<'_> {
    fn kept(&self, rank: usize, c: &Compute) -> f64 {
        if self.graph.modules[c.module].recompute {
            self.edge_bytes(rank, c)
        } else {
            self.graph_bytes(rank, c)
        }
    }

    /// A recomputed pass's graph when its backward begins, but for the received hidden
    /// states its first layer keeps, which `kept` holds already.
    fn during(&self, rank: usize, c: &Compute) -> f64 {
        if !(self.graph.modules[c.module].recompute && c.pass == Pass::Backward) {
            return 0.0;
        }
        let forward = Compute { pass: Pass::Forward, ..*c };
        let received = self.received(c) * self.rows(c.module, rank, c.mb) as f64 * self.elem;
        self.graph_bytes(rank, &forward) - received
    }

    /// Its stage's tensor- and context-parallel ranks (each layer reduces over tp and rings
    /// keys and values over cp); none for a replica without rows in the microbatch, or an
    /// encoder without a manifest: those may skip their collectives.
    fn lockstep(&self, rank: usize, c: &Compute) -> Vec<usize> {
        let l = &self.graph.modules[c.module].layout;
        match l.coords(rank) {
            Some(at) if self.rows(c.module, rank, c.mb) > 0 => l.stage_ranks(at.dp_idx, at.pp_idx),
            _ => Vec::new(),
        }
    }
}

/// The most activation bytes `ranks` hold at once in every execution of `schedule`
/// (`hetpar_schedule::held` over the floor's [`Keeps`]).
pub fn activations_held(schedule: &Schedule, floor: &ActivationFloor<'_>, ranks: &[usize]) -> Held {
    hetpar_schedule::held(schedule, ranks, floor)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use candle_core::{DType, Device, Tensor};

    use hetpar_layout::{BatchManifest, Config, ModelGraph};
    use hetpar_schedule::{Compute, Keeps, Options, Pass, PipelineGraph, Schedule};

    use super::{ActivationFloor, FlashAttention, HostCopy, activations_held, bytes};

    /// The in-memory example with each `(from, to)` of `edits` replaced in its text.
    fn in_memory(edits: &[(&str, &str)]) -> ModelGraph {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/in-memory.toml");
        let mut text = std::fs::read_to_string(path).unwrap();
        for (from, to) in edits {
            assert!(text.contains(from), "{from}");
            text = text.replace(from, to);
        }
        ModelGraph::from_config(&Config::from_toml(&text).unwrap()).unwrap()
    }

    fn forward(module: usize, vstage: usize, mb: usize) -> Compute {
        Compute { pass: Pass::Forward, module, vstage, mb }
    }

    /// The in-memory example by hand. Its LLM (tp 2 with SP on ranks 0-1, pp 1, 4 samples
    /// of 64 tokens a microbatch; hidden 96, 6 heads, 2 KV heads, SwiGLU 192, vocabulary
    /// 256) keeps per token and layer q and the attention's output (96 each), k and v (32
    /// each) and the MLP's 3 x 192, split over tp, and the layer input 96 / 2 under SP; the
    /// logits 256 / 2. The vision encoder (tp 1, dp 2 on ranks 0-1: hidden 64, 4 heads, ffn
    /// 128, 16 rows an image, 2 layers) keeps q, k, v, the attention's output, its
    /// probabilities (4 heads x 16 keys), the MLP's input and output and the layer input:
    /// `4 * 64 + 4 * 16 + 2 * 128 + 64` a row and layer.
    #[test]
    fn the_activation_floor_counts_what_every_path_keeps_by_hand() {
        let graph = in_memory(&[]);
        let id = |name: &str| graph.modules.iter().position(|m| m.name == name).unwrap();
        let (llm, vision, audio) = (id("llm"), id("vision"), id("audio"));
        let manifest = BatchManifest::synthetic(&graph, 0);
        let f = ActivationFloor::new(&graph, Some(&manifest), 4);
        let per_token = (2.0 * 96.0 + 2.0 * 32.0 + 3.0 * 192.0) / 2.0 + 48.0;
        let want = (per_token * 4.0 + 128.0) * 256.0 * 4.0;
        assert_eq!(f.rows(llm, 0, 0), 256);
        assert_eq!(f.kept(0, &forward(llm, 0, 0)), want);
        assert_eq!(f.kept(1, &forward(llm, 0, 1)), want);
        // Rank 3 holds no LLM stage.
        assert_eq!(f.kept(3, &forward(llm, 0, 0)), 0.0);
        // Each vision replica's images of the manifest's microbatch: per row and layer q, k,
        // v and the attention's output (64 each), the probabilities (4 heads x 16 keys), the
        // MLP's input and output (128 each) and the layer input.
        let edge = graph.edges.iter().position(|e| e.src == vision).unwrap();
        let images = |mb: usize, d: usize| manifest.replica_items(edge, 2, d, mb).len();
        assert!((0..2).any(|mb| images(mb, 0) + images(mb, 1) > 0), "the manifest has images");
        let per_row = 4.0 * 64.0 + 4.0 * 16.0 + 2.0 * 128.0 + 64.0;
        let vision_bytes = |mb: usize, d: usize| per_row * 2.0 * (images(mb, d) * 16) as f64 * 4.0;
        for (rank, d) in [(0, 0), (1, 1)] {
            for mb in 0..2 {
                assert_eq!(f.rows(vision, rank, mb), images(mb, d) * 16);
                assert_eq!(f.kept(rank, &forward(vision, 0, mb)), vision_bytes(mb, d));
            }
        }
        // Without a manifest the encoders count nothing.
        let none = ActivationFloor::new(&graph, None, 4);
        assert_eq!(none.kept(0, &forward(vision, 0, 0)), 0.0);
        assert_eq!(none.kept(0, &forward(llm, 0, 0)), want);
        // Recomputed, a pass keeps only what it passed on (the encoder's rows at the LLM's
        // width 96; the one-stage LLM a loss), and builds its graph again when its backward
        // begins.
        let mut recomputed = graph.clone();
        recomputed.modules[vision].recompute = true;
        recomputed.modules[llm].recompute = true;
        let f2 = ActivationFloor::new(&recomputed, Some(&manifest), 4);
        let back = |c: Compute| Compute { pass: Pass::Backward, ..c };
        for mb in 0..2 {
            let rows = (images(mb, 0) * 16) as f64;
            assert_eq!(f2.kept(0, &forward(vision, 0, mb)), rows * 96.0 * 4.0);
            assert_eq!(f2.during(0, &back(forward(vision, 0, mb))), vision_bytes(mb, 0));
            assert_eq!(f2.during(0, &forward(vision, 0, mb)), 0.0);
            assert_eq!(f2.kept(0, &forward(llm, 0, mb)), 0.0);
            assert_eq!(f2.during(0, &back(forward(llm, 0, mb))), want);
        }
        assert_eq!(f.during(0, &back(forward(llm, 0, 0))), 0.0);

        // Over the step's schedule (three-phase: the vision forwards of both microbatches
        // first, kept through the LLM's one-at-a-time 1F1B), rank 0 alone holds both of
        // its replica's microbatches of images and one of the LLM's.
        let schedule =
            Schedule::build(&PipelineGraph::from_model(&graph), Options::default()).unwrap();
        let held = activations_held(&schedule, &f, &[0]);
        assert_eq!(held.total, vision_bytes(0, 0) + vision_bytes(1, 0) + want);
        // With its tp peer (rank 1, vision replica 1), which runs each LLM pass with it: just
        // before the first of the two completes the LLM's backward, both are inside it,
        // holding their images and the LLM's microbatch.
        let pair = activations_held(&schedule, &f, &[0, 1]);
        let one = |d: usize| vision_bytes(0, d) + vision_bytes(1, d) + want;
        assert_eq!(pair.total, one(0) + one(1));
        // The audio island (rank 2) and rank 0 share only boundary transforms, which fix no
        // order (who sends rows to whom depends on the manifest): together they hold at
        // least what the larger alone does.
        let audio_alone = activations_held(&schedule, &f, &[2]);
        assert!(audio_alone.total > 0.0 && f.rows(audio, 2, 0) + f.rows(audio, 2, 1) > 0);
        let both = activations_held(&schedule, &f, &[0, 2]);
        assert_eq!(both.total, held.total.max(audio_alone.total));
    }

    /// Under cp each rank's queries are half an image's rows, and its attention still keeps
    /// their probabilities over all 16 keys: `4 * 16` a row and layer, as at cp 1.
    #[test]
    fn an_encoder_under_cp_keeps_its_probabilities_over_every_key() {
        let graph = in_memory(&[(
            "ranks = [0, 2]           # the LLM's ranks: colocated, tp 1 and dp 2\ntp = 1",
            "ranks = [0, 2]\ntp = 1\ncp = 2",
        )]);
        let vision = graph.modules.iter().position(|m| m.name == "vision").unwrap();
        let manifest = BatchManifest::synthetic(&graph, 0);
        let f = ActivationFloor::new(&graph, Some(&manifest), 4);
        let edge = graph.edges.iter().position(|e| e.src == vision).unwrap();
        let per_row = 4.0 * 64.0 + 4.0 * 16.0 + 2.0 * 128.0 + 64.0;
        for mb in 0..2 {
            let images = manifest.replica_items(edge, 1, 0, mb).len();
            for rank in [0, 1] {
                assert_eq!(f.rows(vision, rank, mb), images * 8, "half of each image's rows");
                let want = per_row * 2.0 * (images * 8) as f64 * 4.0;
                assert_eq!(f.kept(rank, &forward(vision, 0, mb)), want);
            }
        }
        // Past 256 keys, or causal, or with a log-sum-exp output, nothing is kept.
        assert!(FlashAttention::keeps_probabilities(false, false, 128, 256));
        assert!(!FlashAttention::keeps_probabilities(false, false, 129, 257));
        assert!(!FlashAttention::keeps_probabilities(true, false, 16, 16));
        assert!(!FlashAttention::keeps_probabilities(false, true, 16, 16));
    }

    /// Two LLM stages of two layers each with four microbatches: stage 0 alone holds two
    /// microbatches at its peak (1F1B's warm-up forward and one more), without the logits;
    /// recomputed, their edges and one rebuilt graph.
    #[test]
    fn a_first_pipeline_stage_holds_its_warmup_forwards() {
        let graph = in_memory(&[
            ("microbatches = 2", "microbatches = 4"),
            ("ranks = [0, 2]           # the LLM's", "ranks = [0, 4]           # the LLM's"),
            ("ranks = [2, 3]", "ranks = [4, 5]"),
            ("ranks = [0, 2]\ntp = 2", "ranks = [0, 4]\ntp = 2\npp = 2"),
        ]);
        let llm = graph.modules.iter().position(|m| m.name == "llm").unwrap();
        let f = ActivationFloor::new(&graph, None, 4);
        let per_token = (2.0 * 96.0 + 2.0 * 32.0 + 3.0 * 192.0) / 2.0 + 48.0;
        assert_eq!(f.kept(0, &forward(llm, 0, 0)), per_token * 2.0 * 128.0 * 4.0);
        assert_eq!(f.kept(2, &forward(llm, 1, 0)), (per_token * 2.0 + 128.0) * 128.0 * 4.0);
        let schedule =
            Schedule::build(&PipelineGraph::from_model(&graph), Options::default()).unwrap();
        assert_eq!(
            activations_held(&schedule, &f, &[0]).total,
            2.0 * per_token * 2.0 * 128.0 * 4.0
        );
        // Recomputed, a pass keeps the hidden states it received and passed on, 96 wide
        // and split over tp under SP as the pipeline carries them, and its backward
        // rebuilds the rest of its graph. Stage 0 then holds, at its peak, two passes'
        // outputs and one rebuilt graph.
        let mut recomputed = graph.clone();
        recomputed.modules[llm].recompute = true;
        let f = ActivationFloor::new(&recomputed, None, 4);
        let edge = 48.0 * 128.0 * 4.0;
        let back = |c: Compute| Compute { pass: Pass::Backward, ..c };
        assert_eq!(f.kept(0, &forward(llm, 0, 0)), edge);
        assert_eq!(f.kept(2, &forward(llm, 1, 0)), edge);
        assert_eq!(f.during(0, &back(forward(llm, 0, 0))), per_token * 2.0 * 128.0 * 4.0);
        let last = (per_token * 2.0 + 128.0) * 128.0 * 4.0;
        assert_eq!(f.during(2, &back(forward(llm, 1, 0))), last - edge);
        assert_eq!(
            activations_held(&schedule, &f, &[0]).total,
            2.0 * edge + per_token * 2.0 * 128.0 * 4.0
        );
    }

    #[test]
    fn a_host_copy_gives_back_the_same_bits() {
        for dtype in [DType::F32, DType::F64] {
            let a = Tensor::randn(0.0, 1.0, (3, 5), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let b = Tensor::randn(0.0, 1.0, 7, &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let c = HostCopy::pack(&[a.clone(), b.clone()], dtype).unwrap();
            assert_eq!(c.len(), bytes([&a, &b]));
            let back = c.unpack(1).unwrap();
            assert!(!back[0].is_variable() && back[1].is_variable());
            for (x, y) in [a, b].iter().zip(&back) {
                assert_eq!(x.dims(), y.dims());
                let d = (x - y).unwrap().abs().unwrap().sum_all().unwrap();
                assert_eq!(d.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), 0.0);
            }
        }
    }
}
