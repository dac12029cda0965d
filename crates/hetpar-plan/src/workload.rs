//! Planner workloads (INTERFACES.md): the `[modules.*]` and `[[edges]]` of a config with real
//! sizes, `[workload]` (sequence, batch, how much of the sequence the encoders fill) and
//! `[cluster]` (GPUs and hardware). Parallel sections are optional; where one is written, the
//! search keeps the sizes it names.
//!
//! Parsing is pure: the caller reads the file and passes its text.

use std::collections::BTreeMap;

use hetpar_layout::config::{EdgeConfig, ModuleKind, ModuleSizes, parse_toml_with};
use hetpar_layout::graph::ModuleSpec;
use serde::Deserialize;

use crate::error::{PlanError, Result};
use crate::model::{Mlp, ModuleShape};

/// The file as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadFile {
    name: String,
    workload: WorkloadSection,
    cluster: ClusterSection,
    modules: BTreeMap<String, ModuleFile>,
    #[serde(default)]
    edges: Vec<EdgeConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WorkloadSection {
    seq_len: usize,
    global_batch: usize,
    #[serde(default)]
    vision_token_fraction: f64,
    #[serde(default)]
    tokens_per_image: Option<usize>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterSection {
    gpus: usize,
    #[serde(default)]
    gpus_per_node: Option<usize>,
    #[serde(default = "default_hardware")]
    hardware: String,
}

fn default_hardware() -> String {
    "h100".into()
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModuleFile {
    kind: ModuleKind,
    image_size: Option<usize>,
    patch_size: Option<usize>,
    n_mels: Option<usize>,
    frames: Option<usize>,
    vocab: Option<usize>,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: Option<usize>,
    ffn: usize,
    experts: Option<usize>,
    top_k: Option<usize>,
    /// Planner only: MLP flavour (default: swiglu for llama, gelu for encoders).
    mlp: Option<Mlp>,
    /// Planner only: share of the LLM sequence this encoder's rows fill (default: the
    /// workload's `vision_token_fraction` for vit modules).
    token_fraction: Option<f64>,
    parallel: Option<ParallelFile>,
}

impl ModuleFile {
    fn sizes(&self) -> ModuleSizes {
        ModuleSizes {
            kind: self.kind,
            image_size: self.image_size,
            patch_size: self.patch_size,
            n_mels: self.n_mels,
            frames: self.frames,
            vocab: self.vocab,
            hidden: self.hidden,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn: self.ffn,
            experts: self.experts,
            top_k: self.top_k,
        }
    }
}

/// The keys of `[modules.NAME.parallel]` in a workload that the planner takes
/// ([`ParallelFile`]; its `ranks` is read only to be refused with its own message).
const PARALLEL_KEYS: [&str; 7] = ["tp", "cp", "pp", "ep", "sp", "vpp", "offload"];

/// `[modules.NAME.parallel]` in a workload: every size optional.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ParallelFile {
    ranks: Option<[usize; 2]>,
    tp: Option<usize>,
    cp: Option<usize>,
    pp: Option<usize>,
    ep: Option<usize>,
    sp: Option<bool>,
    vpp: Option<usize>,
    offload: Option<bool>,
}

/// Sizes a workload pins for one module; the search keeps them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pinned {
    /// Tensor-parallel size.
    pub tp: Option<usize>,
    /// Context-parallel size.
    pub cp: Option<usize>,
    /// Pipeline-parallel size.
    pub pp: Option<usize>,
    /// Expert-parallel size.
    pub ep: Option<usize>,
    /// Virtual stages per rank.
    pub vpp: Option<usize>,
    /// Encoder offload.
    pub offload: Option<bool>,
}

/// An encoder of the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoder {
    /// Shape.
    pub shape: ModuleShape,
    /// The architecture fields as written (what `--emit-config` writes back).
    pub sizes: ModuleSizes,
    /// Encoder sequence per item (patches of an image, `ceil(frames / 2)` of a clip).
    pub seq: usize,
    /// LLM rows per item.
    pub rows_per_item: usize,
    /// Average items per sample (the token fraction of the LLM sequence over rows per item).
    pub items_per_sample: f64,
    /// Pinned sizes.
    pub pinned: Pinned,
}

impl Encoder {
    /// Encoder tokens per sample.
    pub fn tokens_per_sample(&self) -> f64 {
        self.items_per_sample * self.seq as f64
    }

    /// LLM rows per sample.
    pub fn rows_per_sample(&self) -> f64 {
        self.items_per_sample * self.rows_per_item as f64
    }
}

/// A validated workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// Name.
    pub name: String,
    /// LLM sequence per sample.
    pub seq_len: usize,
    /// Samples per step.
    pub global_batch: usize,
    /// GPUs in the cluster.
    pub gpus: usize,
    /// GPUs per node, if the workload overrides the hardware's.
    pub gpus_per_node: Option<usize>,
    /// Hardware name (`h100`, `h200`, `a100`, `local`).
    pub hardware: String,
    /// The LLM's config name.
    pub llm_name: String,
    /// The LLM.
    pub llm: ModuleShape,
    /// Its architecture fields as written.
    pub llm_sizes: ModuleSizes,
    /// Its pinned sizes.
    pub llm_pinned: Pinned,
    /// Encoders in name order.
    pub encoders: Vec<Encoder>,
}

/// Which FLOPs a TFLOPS/GPU figure counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlopCount {
    /// Every product, the weights' and core attention's, causal attention as half the score
    /// matrix: Megatron's count and the planner's TFLOPS/GPU.
    All,
    /// The products with weights only (6 FLOPs per weight and token: projections, MLP, LM
    /// head, projector), no core attention: the "6N" count some reports use.
    Weights,
}

impl Workload {
    /// `self` on `gpus` GPUs (`hetpar plan --gpus`), checked as the file's `cluster.gpus` is.
    pub fn with_gpus(mut self, gpus: usize) -> Result<Workload> {
        let most = hetpar_layout::graph::MAX_RANKS;
        if gpus == 0 || gpus > most {
            return Err(PlanError(format!("{gpus} GPUs: use 1 to {most}")));
        }
        self.gpus = gpus;
        Ok(self)
    }

    /// Parses and validates a workload file. Errors name the field and say what to write.
    pub fn from_toml(text: &str) -> Result<Workload> {
        let file: WorkloadFile = parse_toml_with(text, &PARALLEL_KEYS).map_err(PlanError::from)?;
        file.validate()
    }

    /// Model FLOPs of one step (the TFLOPS/GPU numerator): every module's training FLOPs per
    /// token times its tokens, causal attention counted as half the score matrix.
    pub fn step_flops(&self) -> f64 {
        self.step_flops_counting(FlopCount::All)
    }

    /// The FLOPs of one step that `count` counts.
    pub fn step_flops_counting(&self, count: FlopCount) -> f64 {
        let b = self.global_batch as f64;
        let attention = |flops: f64| if count == FlopCount::All { flops } else { 0.0 };
        let l = &self.llm;
        let per_token = l.layers as f64
            * (l.layer_gemm_flops() + attention(l.layer_attention_flops(self.seq_len)))
            + l.end_flops();
        let llm = per_token * self.seq_len as f64 * b;
        let enc: f64 = self
            .encoders
            .iter()
            .map(|e| {
                let layers = e.shape.layers as f64
                    * (e.shape.layer_gemm_flops()
                        + attention(e.shape.layer_attention_flops(e.seq)))
                    * e.tokens_per_sample();
                (layers + e.shape.end_flops() * e.rows_per_sample()) * b
            })
            .sum();
        llm + enc
    }

    /// LLM tokens per step.
    pub fn step_tokens(&self) -> f64 {
        (self.seq_len * self.global_batch) as f64
    }
}

impl WorkloadFile {
    fn validate(self) -> Result<Workload> {
        let err = |field: &str, m: String| Err(PlanError(format!("{field}: {m}")));
        let w = &self.workload;
        if w.seq_len == 0 || w.global_batch == 0 {
            return err("workload", "seq_len and global_batch must be at least 1".into());
        }
        use hetpar_layout::graph::{MAX_NAME, MAX_RANKS, MAX_SIZE, at_most, check_name};
        // Names go into the config `--emit-config` writes, the run's name with its
        // placement after it (`-non-colocated` the longest): checked here, before the search.
        check_name("name", &self.name, ".")?;
        let room = MAX_NAME - "-non-colocated".len();
        if self.name.len() > room {
            return err(
                "name",
                format!(
                    "{} characters, more than {room} (an emitted config's name adds its placement)",
                    self.name.len()
                ),
            );
        }
        for name in self.modules.keys() {
            check_name(&format!("modules.{name:?}"), name, "")?;
        }
        for (field, v, limit) in [
            ("workload.seq_len", w.seq_len, MAX_SIZE),
            ("workload.global_batch", w.global_batch, MAX_SIZE),
            ("cluster.gpus", self.cluster.gpus, MAX_RANKS),
            ("cluster.gpus_per_node", self.cluster.gpus_per_node.unwrap_or(1), MAX_RANKS),
        ] {
            at_most(field, "", v, limit)?;
        }
        let tokens = w.seq_len * w.global_batch;
        if tokens > hetpar_layout::graph::MAX_STEP_TOKENS {
            return err(
                "workload.global_batch",
                format!(
                    "global_batch({}) x seq_len({}) = {tokens} tokens a step is more than {}, \
                     the most hetpar takes",
                    w.global_batch,
                    w.seq_len,
                    hetpar_layout::graph::MAX_STEP_TOKENS
                ),
            );
        }
        if self.cluster.gpus_per_node == Some(0) {
            return err("cluster.gpus_per_node", "must be at least 1, got 0".into());
        }
        if !(0.0..1.0).contains(&w.vision_token_fraction) {
            return err(
                "workload.vision_token_fraction",
                format!("{} is not in [0, 1)", w.vision_token_fraction),
            );
        }
        if self.cluster.gpus == 0 {
            return err("cluster.gpus", "must be at least 1".into());
        }
        let llms: Vec<&String> = self
            .modules
            .iter()
            .filter(|(_, m)| m.kind == ModuleKind::Llama)
            .map(|(n, _)| n)
            .collect();
        if llms.len() != 1 {
            return err(
                "modules",
                format!("a workload needs exactly one llama module, found {}", llms.len()),
            );
        }
        let llm_name = llms[0].clone();
        let llm_file = &self.modules[&llm_name];
        if let Some(f) = llm_file.token_fraction {
            return err(
                &format!("modules.{llm_name}.token_fraction"),
                format!(
                    "{f}: an encoder's share of the LLM's sequence, which the llama module has none of (vision_token_fraction and the encoders' token_fraction give the shares)"
                ),
            );
        }
        let llm = shape(&llm_name, llm_file, 0)?.0;
        let mut encoders = Vec::new();
        let mut fraction_sum = 0.0;
        for (name, m) in &self.modules {
            if *name == llm_name {
                continue;
            }
            let field = format!("modules.{name}");
            let into: Vec<&EdgeConfig> = self.edges.iter().filter(|e| e.from == *name).collect();
            if into.len() != 1 || into[0].to != llm_name {
                return err(
                    "edges",
                    format!(
                        "encoder {name} needs exactly one edge, to {llm_name}: add [[edges]] from = \"{name}\", to = \"{llm_name}\""
                    ),
                );
            }
            let (mut shape, spec) = shape(name, m, llm.hidden)?;
            let seq = spec.rows_per_item().expect("an encoder");
            // Named where the share comes from: the module's own, else the workload's.
            let (fraction, from) = match (m.token_fraction, m.kind) {
                (Some(f), _) => (f, format!("{field}.token_fraction")),
                (None, ModuleKind::Vit) => {
                    (w.vision_token_fraction, "workload.vision_token_fraction".to_string())
                }
                (None, _) => {
                    return err(&field, "audio encoders need token_fraction (share of the LLM sequence their rows fill)".into());
                }
            };
            if !(0.0..1.0).contains(&fraction) || fraction == 0.0 {
                return err(
                    &from,
                    format!(
                        "{fraction} is not in (0, 1): encoder {name} needs a share of the LLM's sequence"
                    ),
                );
            }
            fraction_sum += fraction;
            let rows_per_item = match m.kind {
                ModuleKind::Vit => w.tokens_per_image.unwrap_or(seq),
                _ => seq,
            };
            if rows_per_item == 0 || rows_per_item >= w.seq_len {
                // Named where the rows come from: the workload's tokens per image, else the
                // encoder's own input (its image and patch sizes, or its clip's frames).
                let (at, from) = match (m.kind, w.tokens_per_image) {
                    (ModuleKind::Vit, Some(_)) => ("workload.tokens_per_image".to_string(), ""),
                    (ModuleKind::Vit, None) => (field.clone(), " (from image_size / patch_size)"),
                    _ => (field.clone(), " (a clip's frames after the stride-2 stem)"),
                };
                return err(
                    &at,
                    format!(
                        "an item's rows{from} must be at least 1 and fewer than seq_len({}), \
                         got {rows_per_item}",
                        w.seq_len
                    ),
                );
            }
            let items_per_sample = fraction * w.seq_len as f64 / rows_per_item as f64;
            shape.out_hidden = llm.hidden;
            encoders.push(Encoder {
                shape,
                sizes: m.sizes(),
                seq,
                rows_per_item,
                items_per_sample,
                pinned: pinned(name, m)?,
            });
        }
        if fraction_sum >= 1.0 {
            return err(
                "modules",
                format!("encoder token fractions sum to {fraction_sum}, leaving no text"),
            );
        }
        if let Some(e) =
            self.edges.iter().find(|e| !self.modules.contains_key(&e.from) || e.to != llm_name)
        {
            return err(
                "edges",
                format!("edge {} -> {} does not join an encoder to {llm_name}", e.from, e.to),
            );
        }
        Ok(Workload {
            name: self.name,
            seq_len: w.seq_len,
            global_batch: w.global_batch,
            gpus: self.cluster.gpus,
            gpus_per_node: self.cluster.gpus_per_node,
            hardware: self.cluster.hardware,
            llm_pinned: pinned(&llm_name, llm_file)?,
            llm_sizes: llm_file.sizes(),
            llm_name,
            llm,
            encoders,
        })
    }
}

/// The planner's shape of a module, after the checks a config's module gets.
fn shape(name: &str, m: &ModuleFile, out_hidden: usize) -> Result<(ModuleShape, ModuleSpec)> {
    let (spec, dims) = m.sizes().validate(name).map_err(PlanError::from)?;
    let (vocab, kv_heads, experts, top_k) = match spec {
        ModuleSpec::Llama { vocab, kv_heads, experts, top_k } => (vocab, kv_heads, experts, top_k),
        _ => (0, dims.heads, 0, 0),
    };
    let encoder = m.kind.is_encoder();
    let shape = ModuleShape {
        name: name.to_string(),
        encoder,
        hidden: dims.hidden,
        layers: dims.layers,
        heads: dims.heads,
        kv_heads,
        ffn: dims.ffn,
        mlp: m.mlp.unwrap_or(if encoder { Mlp::Gelu } else { Mlp::Swiglu }),
        vocab,
        experts,
        top_k,
        out_hidden,
    };
    Ok((shape, spec))
}

fn pinned(name: &str, m: &ModuleFile) -> Result<Pinned> {
    let Some(p) = &m.parallel else { return Ok(Pinned::default()) };
    if p.ranks.is_some() {
        return Err(PlanError(format!(
            "modules.{name}.parallel.ranks: the planner chooses placements; remove ranks (tp, cp, pp, ep, vpp and offload may be pinned)"
        )));
    }
    if p.sp == Some(false) {
        return Err(PlanError(format!(
            "modules.{name}.parallel.sp: the planner always uses sequence parallelism with tp > 1"
        )));
    }
    for (key, v) in [("tp", p.tp), ("cp", p.cp), ("pp", p.pp), ("ep", p.ep), ("vpp", p.vpp)] {
        if v == Some(0) {
            return Err(PlanError(format!("modules.{name}.parallel.{key} must be at least 1")));
        }
    }
    Ok(Pinned { tp: p.tp, cp: p.cp, pp: p.pp, ep: p.ep, vpp: p.vpp, offload: p.offload })
}

#[cfg(test)]
mod tests {
    use super::{PARALLEL_KEYS, ParallelFile};

    /// The keys the wrong-table hint names are the workload's parallel table's, as serde
    /// lists them (`ranks` aside, which is refused).
    #[test]
    fn the_hints_parallel_keys_are_the_tables() {
        let listed = hetpar_layout::config::table_keys::<ParallelFile>();
        assert_eq!(
            (listed[0].as_str(), &listed[1..]),
            ("ranks", &PARALLEL_KEYS.map(String::from)[..])
        );
    }
}
