//! The TOML config as written by users (INTERFACES.md), parsed with unknown keys rejected.
//!
//! These structs are the raw, typed file. [`crate::graph::ModelGraph::from_config`] validates
//! them into layouts and a module graph; nothing downstream reads a `Config` directly.
//! Parsing is pure: the caller reads the file and passes its text.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::{ConfigError, Result};

/// A whole config file.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Run name; the default output directory is `runs/<name>`.
    pub name: String,
    /// Step, batch and optimizer settings.
    pub train: TrainConfig,
    /// Where samples come from.
    #[serde(default)]
    pub data: DataConfig,
    /// Modules by name.
    #[serde(default)]
    pub modules: BTreeMap<String, ModuleConfig>,
    /// Directed edges `from -> to` carrying boundary rows.
    #[serde(default)]
    pub edges: Vec<EdgeConfig>,
}

/// `[train]`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// Seed of initialization and data order.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Optimizer steps to run.
    #[serde(default = "default_steps")]
    pub steps: usize,
    /// Samples per step.
    pub global_batch: usize,
    /// Global microbatches per step, the same for every module.
    pub microbatches: usize,
    /// LLM sequence length per sample.
    pub seq_len: usize,
    /// Learning rate.
    #[serde(default = "default_lr")]
    pub lr: f64,
    /// Element type of parameters and activations.
    #[serde(default)]
    pub dtype: Dtype,
    /// Steps of linear learning-rate warmup.
    #[serde(default)]
    pub warmup: usize,
    /// Learning rate at the end of the cosine decay (default: a tenth of `lr`).
    #[serde(default)]
    pub min_lr: Option<f64>,
    /// AdamW's decoupled weight decay (on matrices).
    #[serde(default)]
    pub weight_decay: f64,
    /// Bound on the global gradient norm (0: no clipping).
    #[serde(default = "default_clip")]
    pub clip_grad: f64,
    /// What a step with a NaN or infinite gradient or boundary value does.
    #[serde(default)]
    pub on_nonfinite: OnNonFinite,
    /// Under `on_nonfinite = "skip"`, how many steps may be skipped before the run stops.
    #[serde(default = "default_max_skips")]
    pub max_skips: usize,
}

impl TrainConfig {
    /// A `[train]` of these sizes with every other field at its default.
    pub fn with_sizes(global_batch: usize, microbatches: usize, seq_len: usize) -> TrainConfig {
        TrainConfig {
            seed: default_seed(),
            steps: default_steps(),
            global_batch,
            microbatches,
            seq_len,
            lr: default_lr(),
            dtype: Dtype::default(),
            warmup: 0,
            min_lr: None,
            weight_decay: 0.0,
            clip_grad: default_clip(),
            on_nonfinite: OnNonFinite::default(),
            max_skips: default_max_skips(),
        }
    }
}

/// `[train] on_nonfinite`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    /// End the run with an error naming the module and parameter or the edge.
    #[default]
    Stop,
    /// Skip the update and go on (at most `max_skips` times).
    Skip,
}

fn default_clip() -> f64 {
    1.0
}
fn default_max_skips() -> usize {
    DEFAULT_MAX_SKIPS
}

/// `[train] max_skips` where the config does not give it.
pub const DEFAULT_MAX_SKIPS: usize = 10;

fn default_seed() -> u64 {
    1234
}
fn default_steps() -> usize {
    20
}
fn default_lr() -> f64 {
    1e-3
}

/// Element types: what the parameters are and how the products multiply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16 products on f32 parameters, where the backend supports it.
    Bf16,
    /// 64-bit float throughout: the precision `hetpar check --dtype f64` compares at.
    F64,
}

impl Dtype {
    /// Bytes of an activation element as the runtime moves it across a boundary: 4 under
    /// f32 and bf16, because `bf16` rounds only the operands of the linear layers' and the
    /// attention core's products (weights, activations and gradients stay f32; a bf16 row
    /// would be 2); 8 under f64.
    pub fn activation_bytes(self) -> usize {
        match self {
            Dtype::F32 | Dtype::Bf16 => 4,
            Dtype::F64 => 8,
        }
    }

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F64 => "f64",
        }
    }
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// Where samples come from.
    #[serde(default)]
    pub source: DataSource,
    /// `source = "llava"`: the LLaVA JSON file, or a directory written by `hetpar data
    /// synth` (its `train.json`, `heldout.json` and `tokenizer.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Directory that media paths in the JSON are relative to (default: the JSON's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_root: Option<String>,
    /// The `tokenizer.json` (default: the one next to the JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
    /// Held-out records in LLaVA JSON for held-out loss and answer accuracy (default:
    /// `heldout.json` next to the JSON, where there is one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heldout: Option<String>,
    /// A record that cannot be used: `"error"` stops naming it, `"skip"` leaves it out
    /// and counts it.
    #[serde(default)]
    pub on_bad: OnBad,
    /// `source = "synth"`: samples of the generated set (a tenth held out).
    #[serde(default = "thousand")]
    pub samples: usize,
    /// Synthetic source: each sample draws `0..=max_items` items per encoder edge (none
    /// with probability 1/4, else uniformly `1..=max_items`).
    #[serde(default = "one")]
    pub max_items: usize,
}

fn thousand() -> usize {
    DataConfig::SYNTH_SAMPLES
}

/// Written as read, but for the keys only another source reads, left out at their defaults
/// (validation refuses them otherwise): a resolved `source = "synthetic"` config does not
/// show a synth set's size, nor a `synth` one the synthetic source's items per sample.
impl Serialize for DataConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Written<'a> {
            source: DataSource,
            #[serde(skip_serializing_if = "Option::is_none")]
            path: &'a Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            image_root: &'a Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            tokenizer: &'a Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            heldout: &'a Option<String>,
            on_bad: OnBad,
            #[serde(skip_serializing_if = "Option::is_none")]
            samples: Option<usize>,
            #[serde(skip_serializing_if = "Option::is_none")]
            max_items: Option<usize>,
        }
        // Every field named, so one added to the struct is added here too.
        let DataConfig { source, path, image_root, tokenizer, heldout, on_bad, samples, max_items } =
            self;
        Written {
            source: *source,
            path,
            image_root,
            tokenizer,
            heldout,
            on_bad: *on_bad,
            samples: (*source == DataSource::Synth || *samples != DataConfig::SYNTH_SAMPLES)
                .then_some(*samples),
            max_items: (*source == DataSource::Synthetic || *max_items != 1).then_some(*max_items),
        }
        .serialize(s)
    }
}

impl DataConfig {
    /// `data.samples` when not given: the synth set's size.
    pub const SYNTH_SAMPLES: usize = 1000;
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: DataSource::default(),
            path: None,
            image_root: None,
            tokenizer: None,
            heldout: None,
            on_bad: OnBad::default(),
            samples: thousand(),
            max_items: 1,
        }
    }
}

/// `data.on_bad`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBad {
    /// Stop with an error naming the record.
    #[default]
    Error,
    /// Leave the record out and count it.
    Skip,
}

/// Data sources.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataSource {
    /// Generated in-process from the seed (token chains and item patterns; no files).
    #[default]
    Synthetic,
    /// LLaVA-format conversations with images and audio clips (`data.path`).
    Llava,
    /// The `hetpar data synth` dataset (`data.samples`, seeded by `train.seed`), written
    /// once into a cache directory and then read as `llava`.
    Synth,
}

impl DataSource {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            DataSource::Synthetic => "synthetic",
            DataSource::Llava => "llava",
            DataSource::Synth => "synth",
        }
    }

    /// Whether samples come from files (through `hetpar-data`).
    pub fn is_files(self) -> bool {
        self != DataSource::Synthetic
    }
}

/// Module kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModuleKind {
    /// ViT encoder with a 2-layer MLP projector into the LLM width.
    Vit,
    /// Whisper-style audio encoder with a projector.
    Audio,
    /// Llama-style decoder LLM (MoE when `experts > 0`).
    Llama,
}

impl ModuleKind {
    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            ModuleKind::Vit => "vit",
            ModuleKind::Audio => "audio",
            ModuleKind::Llama => "llama",
        }
    }

    /// Encoders produce boundary rows; the LLM consumes them.
    pub fn is_encoder(self) -> bool {
        matches!(self, ModuleKind::Vit | ModuleKind::Audio)
    }
}

/// `[modules.NAME]`. Which size fields apply depends on `kind`; validation rejects a field
/// that does not apply and names one that is missing.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModuleConfig {
    /// What the module is.
    pub kind: ModuleKind,
    /// vit: image side in pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_size: Option<usize>,
    /// vit: patch side in pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub patch_size: Option<usize>,
    /// audio: log-mel channels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_mels: Option<usize>,
    /// audio: log-mel frames per clip (the conv stem halves them); default
    /// [`crate::graph::DEFAULT_FRAMES`], Whisper's 3000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frames: Option<usize>,
    /// llama: vocabulary size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// Model width.
    pub hidden: usize,
    /// Transformer layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// llama: key/value heads (grouped-query attention); defaults to `heads`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// MLP width.
    pub ffn: usize,
    /// llama: experts per MoE layer; 0 means dense.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<usize>,
    /// llama: experts each token is routed to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<usize>,
    /// `false` freezes the module: no gradients of its parameters, no optimizer state, and
    /// no backward into it unless a trainable module feeds it. Default `true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable: Option<bool>,
    /// This module's peak learning rate (default: `train.lr`); its floor scales with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Layout and placement.
    pub parallel: ParallelConfig,
}

impl ModuleConfig {
    /// The architecture fields, without the layout.
    pub fn sizes(&self) -> ModuleSizes {
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

/// The architecture fields of `[modules.NAME]` as written (everything but `parallel`).
/// Planner workloads write the same fields; both are checked by `ModuleSizes::validate`
/// (in `graph`), so the planner accepts exactly the modules a config accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(missing_docs)] // The fields are those of `ModuleConfig`, documented there.
pub struct ModuleSizes {
    pub kind: ModuleKind,
    pub image_size: Option<usize>,
    pub patch_size: Option<usize>,
    pub n_mels: Option<usize>,
    pub frames: Option<usize>,
    pub vocab: Option<usize>,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: Option<usize>,
    pub ffn: usize,
    pub experts: Option<usize>,
    pub top_k: Option<usize>,
}

impl ModuleSizes {
    /// The module with `parallel` as its layout.
    pub fn with_parallel(self, parallel: ParallelConfig) -> ModuleConfig {
        ModuleConfig {
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
            trainable: None,
            lr: None,
            parallel,
        }
    }
}

/// `[modules.NAME.parallel]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelConfig {
    /// Placement span `[start, end)`.
    #[serde(deserialize_with = "span")]
    pub ranks: [usize; 2],
    /// Tensor-parallel size.
    #[serde(default = "one")]
    pub tp: usize,
    /// Context-parallel size.
    #[serde(default = "one")]
    pub cp: usize,
    /// Pipeline-parallel size.
    #[serde(default = "one")]
    pub pp: usize,
    /// Expert-parallel size.
    #[serde(default = "one")]
    pub ep: usize,
    /// Expert tensor-parallel size (default: tp).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etp: Option<usize>,
    /// Sequence parallelism inside TP.
    #[serde(default)]
    pub sp: bool,
    /// Virtual pipeline stages per rank (interleaved 1F1B); llama only.
    #[serde(default = "one")]
    pub vpp: usize,
    /// Move gradients and optimizer state to one host buffer while the LLM pipeline runs
    /// (three-phase schedule); encoders sharing ranks with the LLM only. The parameters
    /// stay: the encoder's phase-1 graph holds them.
    #[serde(default)]
    pub offload: bool,
    /// Drop the activations of each forward pass and compute them again before its
    /// backward (memory for time; the numbers are the same): an encoder's, or each of the
    /// LLM's pipeline stages (every layer of the stage).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompute: bool,
}

fn one() -> usize {
    1
}

/// `[[edges]]`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeConfig {
    /// Source module (an encoder).
    pub from: String,
    /// Destination module (the LLM).
    pub to: String,
    /// Boundary routing strategy.
    #[serde(default)]
    pub strategy: StrategyName,
    /// Leader pairs per replica pair for `leaders` (striping over several links).
    #[serde(default = "one")]
    pub stripes: usize,
}

/// Boundary strategies as written in configs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StrategyName {
    /// `exact` when colocated, `leaders` when not.
    #[default]
    Auto,
    /// Move exactly the rows each rank lacks (all-to-all-v or direct point-to-point).
    Exact,
    /// Colocated gather-and-select (all-gather inside groups, keep the needed intervals).
    Gather,
    /// Non-colocated boundary leaders plus local distribution.
    Leaders,
}

impl Config {
    /// Parses a config from TOML text. Errors are one line: the line number, the enclosing
    /// table and the parser's reason.
    pub fn from_toml(text: &str) -> Result<Config> {
        parse_toml_with(text, &PARALLEL_KEYS)
    }

    /// Serializes back to TOML (used by `plan --emit-config`).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a Config always serializes")
    }
}

/// A placement span: exactly two ranks (TOML's deserializer would drop a third).
fn span<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<[usize; 2], D::Error> {
    let v = Vec::<usize>::deserialize(d)?;
    <[usize; 2]>::try_from(v.as_slice()).map_err(|_| {
        serde::de::Error::custom(format!(
            "ranks must be [start, end), two numbers; got {} of them",
            v.len()
        ))
    })
}

/// Parses any TOML file format of hetpar (configs, planner workloads) with unknown keys
/// rejected by the target type. Errors are one line: the line number, the enclosing table
/// and the parser's reason, with a "did you mean" for an unknown key close to a known one.
pub fn parse_toml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T> {
    parse_toml_with(text, &[])
}

/// [`parse_toml`] for a format with `[modules.NAME.parallel]` tables whose keys are
/// `parallel_keys`: one of them written in `[modules.NAME]` is pointed to its table, and
/// `dp` in the table is said to be derived.
pub fn parse_toml_with<T: serde::de::DeserializeOwned>(
    text: &str,
    parallel_keys: &[&str],
) -> Result<T> {
    toml::from_str(text).map_err(|e| {
        let offset = e.span().map(|s| s.start).unwrap_or(0).min(text.len());
        let line = text[..offset].matches('\n').count() + 1;
        let table = enclosing_table(text, offset);
        let message = in_words(&e.message().trim().replace('\n', " "));
        // A table the file should not have is reported as an unknown field of the top level
        // (whose fields are the file's tables, `modules` among them) at the table's header
        // (`in [bogus]: unknown field `bogus``): said as a table. `[train.train]` is an
        // unknown key of `[train]`, whose fields are others.
        let unknown_table = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split_once('`'))
            .filter(|(name, tail)| {
                tail.contains("`modules`")
                    && table.is_some_and(|t| {
                        let t = t.trim_start_matches('[');
                        t.strip_prefix(*name).is_some_and(|r| r.starts_with([']', '.']))
                    })
            })
            .map(|(name, tail)| format!("unknown table `[{name}]`{tail}"));
        let field = match (table, &unknown_table) {
            (Some(table), None) => format!("line {line}, in {table}"),
            _ => format!("line {line}"),
        };
        // The suggestion reads the message as serde wrote it: where the key belongs in
        // another table, that table; else a known key close to it.
        let known = table
            .and_then(|t| elsewhere(t, &message, parallel_keys))
            .or_else(|| did_you_mean(&message).map(|k| format!("did you mean `{k}`?")));
        let message = unknown_table.unwrap_or(message);
        let message = match known {
            Some(known) => format!("{message} ({known})"),
            None => message,
        };
        ConfigError::new(field, message)
    })
}

/// serde's Rust type names in a message in words: "expected usize" -> "expected a whole
/// number", "expected struct TrainConfig" -> "expected a table".
fn in_words(message: &str) -> String {
    let whole = "a whole number";
    let words = [
        ("expected usize", whole),
        ("expected u64", whole),
        ("expected u32", whole),
        ("expected u8", whole),
        ("expected i64", "an integer"),
        ("expected f64", "a number"),
        ("expected f32", "a number"),
    ];
    let mut out = message.to_string();
    for (rust, said) in words {
        if let Some(i) = out.find(rust)
            && !out[i + rust.len()..].starts_with(|c: char| c.is_alphanumeric())
        {
            out.replace_range(i..i + rust.len(), &format!("expected {said}"));
        }
    }
    let tag = "expected struct ";
    if let Some(i) = out.find(tag) {
        let name = i + tag.len();
        let end = out[name..].find(|c: char| !c.is_alphanumeric()).map_or(out.len(), |e| name + e);
        out.replace_range(i..end, "expected a table");
    }
    out
}

/// For serde's "unknown field `x`, expected one of `a`, `b`" (or "expected `a` or `b`"), the
/// known name closest to `x`, when it is close (a typo, not another word).
fn did_you_mean(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (unknown, expected) = rest.split_once('`')?;
    let known: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    // Jaro-Winkler weighs a shared prefix: `tpp` is closer to `tp` than to `pp`.
    known
        .iter()
        .map(|k| (strsim::jaro_winkler(unknown, k), *k))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k.to_string())
}

/// The keys of a module's `[modules.NAME.parallel]` table in a config ([`ParallelConfig`]).
pub const PARALLEL_KEYS: [&str; 10] =
    ["ranks", "tp", "cp", "pp", "ep", "etp", "sp", "vpp", "offload", "recompute"];

/// The keys a table type `T` takes, as serde lists them when it refuses an unknown one: for
/// tests that hold a list of keys to the type.
pub fn table_keys<T: serde::de::DeserializeOwned + std::fmt::Debug>() -> Vec<String> {
    let err = toml::from_str::<T>("__unknown = 1").expect_err("an unknown key").to_string();
    let Some(list) = err.split("expected one of ").nth(1) else { return Vec::new() };
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// For serde's "unknown field `x`" in `table`, where `x` belongs instead: one of
/// `parallel_keys` written in `[modules.NAME]`, or `dp`, which no table sets (in a format
/// with parallel tables).
fn elsewhere(table: &str, message: &str, parallel_keys: &[&str]) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (unknown, _) = rest.split_once('`')?;
    let module = table.strip_prefix("[modules.")?.strip_suffix(']')?;
    match module.strip_suffix(".parallel") {
        Some(_) if unknown == "dp" && !parallel_keys.is_empty() => {
            Some("dp is not set: it is the span's ranks divided by tp*cp*pp".to_string())
        }
        None if !module.contains('.') && parallel_keys.contains(&unknown) => {
            Some(format!("`{unknown}` belongs in [modules.{module}.parallel]"))
        }
        _ => None,
    }
}

/// The last `[table]` or `[[array]]` header at or before byte `offset`.
fn enclosing_table(text: &str, offset: usize) -> Option<&str> {
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    text[..end]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.split('#').next().unwrap_or(l).trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout keys the wrong-table hint names are the parallel table's, as serde
    /// lists them.
    #[test]
    fn the_hints_parallel_keys_are_the_tables() {
        assert_eq!(table_keys::<ParallelConfig>(), PARALLEL_KEYS);
    }

    const MINIMAL: &str = r#"
name = "t"
[train]
global_batch = 8
microbatches = 2
seq_len = 64
[modules.llm]
kind = "llama"
vocab = 64
hidden = 32
layers = 2
heads = 4
ffn = 64
[modules.llm.parallel]
ranks = [0, 2]
tp = 2
"#;

    #[test]
    fn defaults_fill_optional_fields() {
        let c = Config::from_toml(MINIMAL).expect("parses");
        assert_eq!(c.train.seed, 1234);
        assert_eq!(c.train.dtype, Dtype::F32);
        let f64 = Config::from_toml(&MINIMAL.replacen("[train]", "[train]\ndtype = \"f64\"", 1))
            .expect("parses");
        assert_eq!((f64.train.dtype, f64.train.dtype.activation_bytes()), (Dtype::F64, 8));
        assert_eq!(c.data.source, DataSource::Synthetic);
        assert_eq!(c.data, DataConfig::default());
        assert_eq!(c.data.max_items, 1);
        let p = &c.modules["llm"].parallel;
        assert_eq!((p.tp, p.cp, p.pp, p.ep, p.etp, p.sp), (2, 1, 1, 1, None, false));
        assert!(c.edges.is_empty());
    }

    #[test]
    fn unknown_key_is_one_line_with_line_and_table() {
        let text = MINIMAL.replace("tp = 2", "tpp = 2");
        let e = Config::from_toml(&text).expect_err("unknown key");
        let msg = e.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(
            msg.starts_with("line 16, in [modules.llm.parallel]: unknown field `tpp`"),
            "{msg}"
        );
        // A table the config has no place for is named as a table, at its header; a key
        // named like its table, inside it, is still a key.
        for (text, want) in [
            (
                format!("{MINIMAL}[workload]\nseq_len = 8\n"),
                "line 17: unknown table `[workload]`, expected one of `name`",
            ),
            (
                format!("{MINIMAL}[cluster.nodes]\ngpus = 8\n"),
                "line 17: unknown table `[cluster]`, expected",
            ),
            (
                MINIMAL.replace("global_batch = 8", "train = 1"),
                "line 4, in [train]: unknown field `train`",
            ),
            (
                format!("{MINIMAL}[train.train]\na = 1\n"),
                "line 17, in [train.train]: unknown field `train`",
            ),
            (format!("{MINIMAL}[trian]\na = 1\n"), "line 17: unknown table `[trian]`"),
        ] {
            let e = Config::from_toml(&text).expect_err(want).to_string();
            assert!(e.starts_with(want), "{e}");
        }
    }

    #[test]
    fn unknown_kind_names_the_choices() {
        let text = MINIMAL.replace("\"llama\"", "\"gpt\"");
        let msg = Config::from_toml(&text).expect_err("bad kind").to_string();
        assert!(msg.starts_with("line 8, in [modules.llm]: unknown variant `gpt`"), "{msg}");
    }

    #[test]
    fn round_trips_through_toml() {
        let c = Config::from_toml(MINIMAL).expect("parses");
        assert_eq!(Config::from_toml(&c.to_toml()).expect("re-parses"), c);
    }
}
