//! The validated model graph: modules with layouts, edges with placement mode, DP relation and
//! boundary strategy. [`ModelGraph::from_config`] is the single place a [`Config`] is checked;
//! every rejection is one line naming the field and the arithmetic (RELIABILITY.md row 7).

use std::collections::BTreeMap;

use crate::config::{
    Config, DataConfig, DataSource, ModuleConfig, ModuleKind, ModuleSizes, StrategyName,
    TrainConfig,
};
use crate::edge::{DpRelation, EdgeId, ModuleId, PlacementMode, Strategy};
use crate::error::{ConfigError, Result};
use crate::layout::{LayoutSpec, ModuleLayout, Span};

/// Architecture sizes of a module, by kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleSpec {
    /// ViT encoder + projector.
    Vit {
        /// Image side in pixels.
        image_size: usize,
        /// Patch side in pixels.
        patch_size: usize,
    },
    /// Whisper-style audio encoder + projector.
    Audio {
        /// Log-mel channels.
        n_mels: usize,
        /// Log-mel frames per clip.
        frames: usize,
    },
    /// Llama-style LLM.
    Llama {
        /// Vocabulary size.
        vocab: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Experts per MoE layer (0: dense).
        experts: usize,
        /// Experts per token.
        top_k: usize,
    },
}

/// Transformer sizes shared by every kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Model width.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub ffn: usize,
}

/// A module of the graph.
#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    /// Name from the config.
    pub name: String,
    /// Kind-specific sizes.
    pub spec: ModuleSpec,
    /// Shared transformer sizes.
    pub dims: Dims,
    /// Validated layout and placement.
    pub layout: ModuleLayout,
    /// Virtual pipeline stages per rank (1: plain 1F1B).
    pub vpp: usize,
    /// Offloaded to host memory during the LLM pipeline phase.
    pub offload: bool,
    /// Activations dropped after each forward and recomputed before its backward.
    pub recompute: bool,
    /// `false`: frozen (no gradients, no optimizer state).
    pub trainable: bool,
    /// Peak learning rate of this module (`None`: `train.lr`).
    pub lr: Option<f64>,
}

impl Module {
    /// The config kind.
    pub fn kind(&self) -> ModuleKind {
        match self.spec {
            ModuleSpec::Vit { .. } => ModuleKind::Vit,
            ModuleSpec::Audio { .. } => ModuleKind::Audio,
            ModuleSpec::Llama { .. } => ModuleKind::Llama,
        }
    }

    /// Boundary rows one input item (an image, an audio clip) produces; `None` for the LLM.
    pub fn rows_per_item(&self) -> Option<usize> {
        self.spec.rows_per_item()
    }
}

impl ModuleSpec {
    /// Boundary rows one input item produces (an encoder's sequence per item: patches of an
    /// image, `ceil(frames / 2)` of a clip); `None` for the LLM.
    pub fn rows_per_item(&self) -> Option<usize> {
        match *self {
            ModuleSpec::Vit { image_size, patch_size } => Some((image_size / patch_size).pow(2)),
            // The conv stem has stride 2 over frames.
            ModuleSpec::Audio { frames, .. } => Some(frames.div_ceil(2)),
            ModuleSpec::Llama { .. } => None,
        }
    }
}

/// A validated edge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Edge {
    /// Source module (an encoder).
    pub src: ModuleId,
    /// Destination module (the LLM).
    pub dst: ModuleId,
    /// Colocated or not.
    pub mode: PlacementMode,
    /// DP relation of the two layouts.
    pub relation: DpRelation,
    /// Routing strategy, resolved from `auto`.
    pub strategy: Strategy,
}

/// A config after validation: what every later stage reads.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelGraph {
    /// Run name.
    pub name: String,
    /// `[train]` as written.
    pub train: TrainConfig,
    /// `[data]` as written.
    pub data: DataConfig,
    /// Ranks `0..world` are all in some module's span.
    pub world: usize,
    /// Modules in name order.
    pub modules: Vec<Module>,
    /// Edges in config order.
    pub edges: Vec<Edge>,
}

impl ModelGraph {
    /// Validates `cfg`. Every check happens here, before any rank or communicator exists.
    pub fn from_config(cfg: &Config) -> Result<ModelGraph> {
        if cfg.modules.is_empty() {
            return Err(ConfigError::new(
                "modules",
                "no modules defined: add a [modules.NAME] table",
            ));
        }
        check_name("name", &cfg.name, ".")?;
        for name in cfg.modules.keys() {
            check_name(&format!("modules.{name:?}"), name, "")?;
        }
        let modules: Vec<Module> = cfg
            .modules
            .iter()
            .map(|(name, m)| build_module(name, m, &cfg.train))
            .collect::<Result<_>>()?;
        let world = check_spans(&modules)?;
        if modules.iter().all(|m| !m.trainable) {
            return Err(ConfigError::new(
                "modules",
                "every module has trainable = false: nothing would train",
            ));
        }
        let ids: BTreeMap<&str, ModuleId> =
            modules.iter().enumerate().map(|(i, m)| (m.name.as_str(), i)).collect();
        let edges = build_edges(cfg, &modules, &ids)?;
        check_batch(&cfg.train, &modules)?;
        check_data(&cfg.data)?;
        check_sequence(&cfg.train, &cfg.data, &modules, &edges)?;
        Ok(ModelGraph {
            name: cfg.name.clone(),
            train: cfg.train.clone(),
            data: cfg.data.clone(),
            world,
            modules,
            edges,
        })
    }

    /// The module called `name`.
    pub fn module_id(&self, name: &str) -> Option<ModuleId> {
        self.modules.iter().position(|m| m.name == name)
    }

    /// Edges ending at `dst`, in config order.
    pub fn edges_into(&self, dst: ModuleId) -> impl Iterator<Item = (EdgeId, &Edge)> {
        self.edges.iter().enumerate().filter(move |(_, e)| e.dst == dst)
    }

    /// Samples per global microbatch: `global_batch / microbatches`.
    pub fn microbatch_size(&self) -> usize {
        self.train.global_batch / self.train.microbatches
    }

    /// Modules in dependency order (every source before its destinations).
    pub fn topo_order(&self) -> Vec<ModuleId> {
        let pairs: Vec<(usize, usize)> = self.edges.iter().map(|e| (e.src, e.dst)).collect();
        topo_sort(self.modules.len(), &pairs).expect("validated graphs are acyclic")
    }
}

impl ModuleSizes {
    /// Checks a module's architecture: fields that belong to another kind are rejected,
    /// missing ones named, sizes positive and divisible as the layers need. Errors name
    /// `modules.NAME` and the values.
    pub fn validate(&self, name: &str) -> Result<(ModuleSpec, Dims)> {
        let m = self;
        let field = format!("modules.{name}");
        let err = |message: String| Err(ConfigError::new(field.clone(), message));
        let kind = m.kind.name();
        // Fields that belong to other kinds are rejected, missing ones named.
        let present: [(&str, bool, &[ModuleKind]); 8] = [
            ("image_size", m.image_size.is_some(), &[ModuleKind::Vit]),
            ("patch_size", m.patch_size.is_some(), &[ModuleKind::Vit]),
            ("n_mels", m.n_mels.is_some(), &[ModuleKind::Audio]),
            ("frames", m.frames.is_some(), &[ModuleKind::Audio]),
            ("vocab", m.vocab.is_some(), &[ModuleKind::Llama]),
            ("kv_heads", m.kv_heads.is_some(), &[ModuleKind::Llama]),
            ("experts", m.experts.is_some(), &[ModuleKind::Llama]),
            ("top_k", m.top_k.is_some(), &[ModuleKind::Llama]),
        ];
        for (key, is_set, kinds) in present {
            if is_set && !kinds.contains(&m.kind) {
                return err(format!("`{key}` does not apply to kind \"{kind}\""));
            }
        }
        let need = |key: &str, v: Option<usize>| -> Result<usize> {
            v.ok_or_else(|| {
                ConfigError::new(field.clone(), format!("kind \"{kind}\" needs `{key}`"))
            })
        };
        let dims = Dims { hidden: m.hidden, layers: m.layers, heads: m.heads, ffn: m.ffn };
        for (key, v) in
            [("hidden", m.hidden), ("layers", m.layers), ("heads", m.heads), ("ffn", m.ffn)]
        {
            if v == 0 {
                return err(format!("{key} must be at least 1, got 0"));
            }
        }
        let optional = [
            ("image_size", m.image_size),
            ("patch_size", m.patch_size),
            ("n_mels", m.n_mels),
            ("frames", m.frames),
            ("vocab", m.vocab),
            ("kv_heads", m.kv_heads),
            ("experts", m.experts),
            ("top_k", m.top_k),
        ];
        for (key, v) in [("hidden", Some(m.hidden)), ("layers", Some(m.layers))]
            .into_iter()
            .chain([("heads", Some(m.heads)), ("ffn", Some(m.ffn))])
            .chain(optional)
        {
            if let Some(v) = v {
                at_most(&field, key, v, MAX_SIZE)?;
            }
        }
        if !m.hidden.is_multiple_of(m.heads) {
            return err(format!("hidden({}) is not divisible by heads({})", m.hidden, m.heads));
        }
        let spec = match m.kind {
            ModuleKind::Vit => {
                let (image_size, patch_size) =
                    (need("image_size", m.image_size)?, need("patch_size", m.patch_size)?);
                if patch_size == 0 || image_size == 0 || image_size % patch_size != 0 {
                    return err(format!(
                        "image_size({image_size}) is not a positive multiple of patch_size({patch_size})"
                    ));
                }
                ModuleSpec::Vit { image_size, patch_size }
            }
            ModuleKind::Audio => {
                let n_mels = need("n_mels", m.n_mels)?;
                let frames = m.frames.unwrap_or(DEFAULT_FRAMES);
                if n_mels == 0 || frames < 2 || !frames.is_multiple_of(2) {
                    return err(format!(
                        "needs n_mels >= 1 and an even frames >= 2 (stride-2 stem), got n_mels({n_mels}) frames({frames})"
                    ));
                }
                ModuleSpec::Audio { n_mels, frames }
            }
            ModuleKind::Llama => {
                let vocab = need("vocab", m.vocab)?;
                let kv_heads = m.kv_heads.unwrap_or(m.heads);
                if vocab == 0 {
                    return err("vocab must be at least 1, got 0".to_string());
                }
                if kv_heads == 0 {
                    return err("kv_heads must be at least 1, got 0".to_string());
                }
                if !m.heads.is_multiple_of(kv_heads) {
                    return err(format!(
                        "heads({}) must be a multiple of kv_heads({kv_heads})",
                        m.heads
                    ));
                }
                let experts = m.experts.unwrap_or(0);
                let top_k = m.top_k.unwrap_or(if experts == 0 { 0 } else { 2.min(experts) });
                if experts > 0 && (top_k == 0 || top_k > experts) {
                    return err(format!("top_k({top_k}) must be in 1..=experts({experts})"));
                }
                ModuleSpec::Llama { vocab, kv_heads, experts, top_k }
            }
        };
        Ok((spec, dims))
    }
}

/// Log-mel frames per clip of an audio module that does not give `frames`: Whisper's 30
/// seconds at a 10 ms hop (1,500 rows after the stride-2 stem).
pub const DEFAULT_FRAMES: usize = 3000;

/// The largest size, count or length a config may give (2^24): far beyond any model or
/// batch, small enough that products of a few fit in 64 bits.
pub const MAX_SIZE: usize = 1 << 24;

/// The most ranks a config may span, and the largest parallel size (2^20).
pub const MAX_RANKS: usize = 1 << 20;

/// The most tokens a step may hold, `global_batch * seq_len` (2^32).
pub const MAX_STEP_TOKENS: usize = 1 << 32;

/// `field` (or its `key`, where given) at most `limit`: the bound every size read from a
/// config or planner workload file goes through.
pub fn at_most(field: &str, key: &str, v: usize, limit: usize) -> Result<()> {
    if v > limit {
        let what = if key.is_empty() { v.to_string() } else { format!("{key}({v})") };
        return Err(ConfigError::new(
            field,
            format!("{what} is more than {limit}, the largest hetpar takes"),
        ));
    }
    Ok(())
}

/// Longest run or module name.
pub const MAX_NAME: usize = 64;

/// A run or module name names files and directories (`runs/<name>`, a checkpoint's
/// `<module>.stage<s>.safetensors`) and sits in dotted `--set` keys: ASCII letters, digits,
/// `_` and `-`, plus the characters in `more`, starting with a letter or digit.
pub fn check_name(field: &str, name: &str, more: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || more.contains(c);
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if name.len() <= MAX_NAME && first_ok && name.chars().all(allowed) {
        return Ok(());
    }
    let also = more.chars().map(|c| format!(", `{c}`")).collect::<String>();
    Err(ConfigError::new(
        field,
        format!(
            "{name:?} is not a name: use 1 to {MAX_NAME} ASCII letters, digits, `_`, `-`{also}, \
             starting with a letter or digit (it names files and --set keys)"
        ),
    ))
}

fn build_module(name: &str, m: &ModuleConfig, train: &TrainConfig) -> Result<Module> {
    let field = format!("modules.{name}");
    let kind = m.kind.name();
    let (spec, dims) = m.sizes().validate(name)?;
    let pfield = format!("{field}.parallel");
    let q = &m.parallel;
    at_most(&format!("{pfield}.ranks"), "end", q.ranks[1], MAX_RANKS)?;
    for (key, v) in [("tp", q.tp), ("cp", q.cp), ("pp", q.pp), ("ep", q.ep), ("vpp", q.vpp)]
        .into_iter()
        .chain(q.etp.map(|e| ("etp", e)))
    {
        at_most(&pfield, key, v, MAX_RANKS)?;
    }
    if let Some(lr) = m.lr
        && !(lr.is_finite() && lr > 0.0)
    {
        return Err(ConfigError::new(
            format!("{field}.lr"),
            format!(
                "must be a positive finite number (trainable = false freezes a module), got {lr}"
            ),
        ));
    }
    if let Some(lr) = m.lr {
        fits_f32(&format!("{field}.lr"), lr)?;
    }
    let p = &m.parallel;
    let span = Span::new(p.ranks[0], p.ranks[1]);
    let experts = match spec {
        ModuleSpec::Llama { experts, .. } => experts,
        _ => 0,
    };
    // Experts are whole on their ep rank (no expert tensor parallelism yet), so a MoE
    // module's expert view is etp 1 unless the config says otherwise (and then it is refused).
    let etp = if experts > 0 { Some(p.etp.unwrap_or(1)) } else { p.etp };
    let perr = |message: String| Err(ConfigError::new(pfield.clone(), message));
    // Before the grid's arithmetic, whose message would name the expert view's sizes.
    if p.ep > 1 && experts == 0 {
        return perr(format!("ep({}) needs a MoE module (experts > 0)", p.ep));
    }
    if let Some(etp) = p.etp.filter(|&e| e > 1 && experts == 0) {
        return perr(format!("etp({etp}) needs a MoE module (experts > 0)"));
    }
    let layout_spec = LayoutSpec { tp: p.tp, cp: p.cp, pp: p.pp, ep: p.ep, etp, sp: p.sp };
    let layout = ModuleLayout::new(name, span, layout_spec)?;
    let tp = layout.tp();
    let mut divides = vec![("heads", m.heads), ("ffn", m.ffn)];
    if let ModuleSpec::Llama { vocab, kv_heads, .. } = spec {
        divides.extend([("kv_heads", kv_heads), ("vocab", vocab)]);
    }
    for (key, v) in divides {
        if v % tp != 0 {
            return perr(format!("tp({tp}) does not divide {key}({v})"));
        }
    }
    if layout.pp() > m.layers {
        return perr(format!("pp({}) is more than layers({})", layout.pp(), m.layers));
    }
    let vpp = p.vpp;
    if vpp == 0 {
        return perr("vpp must be at least 1, got 0".to_string());
    }
    if vpp > 1 {
        if m.kind != ModuleKind::Llama || layout.pp() == 1 {
            return perr(format!(
                "vpp({vpp}) (interleaved 1F1B) needs the llama module with pp > 1, got kind \"{kind}\" with pp({})",
                layout.pp()
            ));
        }
        if layout.pp() * vpp > m.layers {
            return perr(format!(
                "pp({}) * vpp({vpp}) = {} virtual stages is more than layers({})",
                layout.pp(),
                layout.pp() * vpp,
                m.layers
            ));
        }
        if !train.microbatches.is_multiple_of(layout.pp()) {
            return perr(format!(
                "interleaved 1F1B needs train.microbatches({}) divisible by pp({})",
                train.microbatches,
                layout.pp()
            ));
        }
    }
    if p.offload && m.kind == ModuleKind::Llama {
        return perr(
            "offload applies to encoders (during the LLM phase), not to the llama module"
                .to_string(),
        );
    }
    if experts > 0 && experts % layout.ep() != 0 {
        return perr(format!("ep({}) does not divide experts({experts})", layout.ep()));
    }
    if experts > 0 && layout.etp() > 1 {
        return perr(format!(
            "etp({}): expert tensor parallelism is not supported yet; experts stay whole on their ep rank (etp = 1)",
            layout.etp()
        ));
    }
    if let Some(rows) = spec.rows_per_item() {
        let parts = layout.cp() * if layout.sp() { tp } else { 1 };
        if !rows.is_multiple_of(parts) {
            return perr(format!(
                "{rows} rows per item do not split into cp({}) x sequence-parallel tp({}) = {parts} equal parts",
                layout.cp(),
                if layout.sp() { tp } else { 1 }
            ));
        }
    }
    if m.kind == ModuleKind::Llama {
        let (cp, seq) = (layout.cp(), train.seq_len);
        if cp > 1 && seq % (2 * cp) != 0 {
            return perr(format!(
                "train.seq_len({seq}) is not divisible by 2*cp = {} load-balanced chunks",
                2 * cp
            ));
        }
        if layout.sp() && (seq / cp) % tp != 0 {
            return perr(format!(
                "sequence parallelism needs seq_len({seq}) / cp({cp}) = {} divisible by tp({tp})",
                seq / cp
            ));
        }
    }
    Ok(Module {
        name: name.to_string(),
        spec,
        dims,
        layout,
        vpp,
        offload: p.offload,
        recompute: p.recompute,
        trainable: m.trainable.unwrap_or(true),
        lr: m.lr,
    })
}

/// Spans must be equal or disjoint and cover `0..world` with no gap; returns `world`.
fn check_spans(modules: &[Module]) -> Result<usize> {
    for (i, a) in modules.iter().enumerate() {
        for b in &modules[i + 1..] {
            let (sa, sb) = (a.layout.span(), b.layout.span());
            if sa != sb && sa.overlaps(&sb) {
                return Err(ConfigError::new(
                    format!("modules.{}.parallel.ranks", b.name),
                    format!(
                        "{sb} partly overlaps modules.{}.parallel.ranks {sa}: spans must be equal (colocated) or disjoint (non-colocated)",
                        a.name
                    ),
                ));
            }
        }
    }
    let world = modules.iter().map(|m| m.layout.span().end).max().unwrap_or(0);
    let mut spans: Vec<Span> = modules.iter().map(|m| m.layout.span()).collect();
    spans.sort();
    let mut covered = 0;
    for s in spans {
        if s.start > covered {
            return Err(ConfigError::new(
                "modules",
                format!(
                    "ranks {} belong to no module: every rank in [0, {world}) must be in some module's span",
                    Span::new(covered, s.start)
                ),
            ));
        }
        covered = covered.max(s.end);
    }
    Ok(world)
}

fn build_edges(
    cfg: &Config,
    modules: &[Module],
    ids: &BTreeMap<&str, ModuleId>,
) -> Result<Vec<Edge>> {
    let names = || modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", ");
    let mut pairs = Vec::new();
    for (i, e) in cfg.edges.iter().enumerate() {
        let lookup = |key: &str, name: &str| {
            ids.get(name).copied().ok_or_else(|| {
                ConfigError::new(
                    format!("edges[{i}].{key}"),
                    format!("\"{name}\" names no module; modules are {}", names()),
                )
            })
        };
        let (src, dst) = (lookup("from", &e.from)?, lookup("to", &e.to)?);
        if src == dst {
            return Err(ConfigError::new(
                format!("edges[{i}]"),
                format!("{} -> {} is a self-loop", e.from, e.to),
            ));
        }
        if pairs.contains(&(src, dst)) {
            return Err(ConfigError::new(
                format!("edges[{i}]"),
                format!("{} -> {} is listed twice", e.from, e.to),
            ));
        }
        pairs.push((src, dst));
    }
    if let Err(cycle) = topo_sort(modules.len(), &pairs) {
        let path: Vec<&str> = cycle.iter().map(|&m| modules[m].name.as_str()).collect();
        return Err(ConfigError::new("edges", format!("form a cycle: {}", path.join(" -> "))));
    }
    let llms: Vec<&str> =
        modules.iter().filter(|m| m.kind() == ModuleKind::Llama).map(|m| m.name.as_str()).collect();
    if llms.len() != 1 {
        return Err(ConfigError::new(
            "modules",
            format!(
                "need exactly one module of kind \"llama\" (the LLM the encoders feed), found {}{}",
                llms.len(),
                if llms.is_empty() { String::new() } else { format!(": {}", llms.join(", ")) }
            ),
        ));
    }
    let mut edges = Vec::new();
    for (i, (e, &(src, dst))) in cfg.edges.iter().zip(&pairs).enumerate() {
        let field = format!("edges[{i}]");
        let (s, d) = (&modules[src], &modules[dst]);
        if !s.kind().is_encoder() || d.kind() != ModuleKind::Llama {
            return Err(ConfigError::new(
                field,
                format!(
                    "{} ({}) -> {} ({}): an edge must go from an encoder (vit, audio) to the llama module",
                    s.name,
                    s.kind().name(),
                    d.name,
                    d.kind().name()
                ),
            ));
        }
        let (ss, ds) = (s.layout.span(), d.layout.span());
        let mode = if ss == ds { PlacementMode::Colocated } else { PlacementMode::NonColocated };
        let strategy = resolve_strategy(&field, e.strategy, e.stripes, mode, &s.layout, &d.layout)?;
        let relation = DpRelation::of(s.layout.dp(), d.layout.dp());
        edges.push(Edge { src, dst, mode, relation, strategy });
    }
    for (id, m) in modules.iter().enumerate() {
        // Offload frees the encoder's memory while the LLM pipeline runs on its ranks: an
        // encoder beside other encoders only has no LLM phase there to free it for.
        let with_llm = modules
            .iter()
            .any(|o| o.kind() == ModuleKind::Llama && o.layout.span() == m.layout.span());
        if m.offload && !with_llm {
            return Err(ConfigError::new(
                format!("modules.{}.parallel.offload", m.name),
                format!(
                    "offload frees memory for a colocated LLM, but {} shares no ranks with the llama module",
                    m.layout.span()
                ),
            ));
        }
        if m.kind().is_encoder() && !edges.iter().any(|e| e.src == id) {
            return Err(ConfigError::new(
                format!("modules.{}", m.name),
                format!(
                    "encoder feeds no module: add [[edges]] from = \"{}\" to = \"{}\"",
                    m.name, llms[0]
                ),
            ));
        }
    }
    Ok(edges)
}

fn resolve_strategy(
    field: &str,
    name: StrategyName,
    stripes: usize,
    mode: PlacementMode,
    src: &ModuleLayout,
    dst: &ModuleLayout,
) -> Result<Strategy> {
    let err = |message: String| Err(ConfigError::new(field, message));
    let colocated = mode == PlacementMode::Colocated;
    let leaders =
        matches!(name, StrategyName::Leaders) || (matches!(name, StrategyName::Auto) && !colocated);
    if stripes != 1 && !leaders {
        return err(format!("stripes({stripes}) only applies to strategy \"leaders\""));
    }
    match name {
        StrategyName::Gather if !colocated => {
            return err(format!(
                "strategy \"gather\" needs colocated modules, but spans {} and {} are disjoint",
                src.span(),
                dst.span()
            ));
        }
        StrategyName::Leaders if colocated => {
            return err(format!(
                "strategy \"leaders\" needs disjoint spans, but both modules use {}",
                src.span()
            ));
        }
        _ => {}
    }
    if leaders {
        let max = src.stage_width().min(dst.stage_width());
        if stripes == 0 || stripes > max {
            return err(format!(
                "stripes({stripes}) must be in 1..={max}: min(source tp*cp = {}, destination tp*cp = {})",
                src.stage_width(),
                dst.stage_width()
            ));
        }
        return Ok(Strategy::Leaders { stripes });
    }
    Ok(match name {
        StrategyName::Gather => Strategy::Gather,
        _ => Strategy::Exact,
    })
}

fn check_batch(train: &TrainConfig, modules: &[Module]) -> Result<()> {
    let (b, m) = (train.global_batch, train.microbatches);
    at_most("train.global_batch", "", b, MAX_SIZE)?;
    at_most("train.seq_len", "", train.seq_len, MAX_SIZE)?;
    if b * train.seq_len > MAX_STEP_TOKENS {
        return Err(ConfigError::new(
            "train.global_batch",
            format!(
                "global_batch({b}) x seq_len({}) = {} tokens a step is more than {MAX_STEP_TOKENS}, the most hetpar takes",
                train.seq_len,
                b * train.seq_len
            ),
        ));
    }
    if b == 0 || m == 0 || b % m != 0 {
        return Err(ConfigError::new(
            "train.global_batch",
            format!("global_batch({b}) must be a positive multiple of microbatches({m})"),
        ));
    }
    let mb = b / m;
    // The LLM splits the samples of a microbatch over its replicas; encoders split items
    // (SEMANTICS.md section 3), so any encoder dp works with any microbatch.
    for module in modules.iter().filter(|m| m.kind() == ModuleKind::Llama) {
        let dp = module.layout.dp();
        if mb % dp != 0 {
            return Err(ConfigError::new(
                "train.global_batch",
                format!(
                    "global_batch({b}) / microbatches({m}) = {mb} samples per microbatch is not divisible by modules.{} dp({dp})",
                    module.name
                ),
            ));
        }
    }
    if train.seq_len == 0 {
        return Err(ConfigError::new("train.seq_len", "must be at least 1, got 0"));
    }
    check_optimizer(train)
}

/// A learning rate f32 weights can take a step of: an update by one past f32's largest
/// value makes every weight infinite, and the next step's activations NaN.
fn fits_f32(field: &str, lr: f64) -> Result<()> {
    if lr > f64::from(f32::MAX) {
        return Err(ConfigError::new(
            field,
            format!(
                "must be at most {:e}, f32's largest value (one update by more makes every f32 weight infinite), got {lr:e}",
                f32::MAX
            ),
        ));
    }
    Ok(())
}

fn check_optimizer(t: &TrainConfig) -> Result<()> {
    let bad = |field: &str, m: String| Err(ConfigError::new(format!("train.{field}"), m));
    if !(t.lr.is_finite() && t.lr > 0.0) {
        return bad("lr", format!("must be a positive finite number, got {}", t.lr));
    }
    fits_f32("train.lr", t.lr)?;
    if let Some(min) = t.min_lr
        && !(min.is_finite() && (0.0..=t.lr).contains(&min))
    {
        return bad("min_lr", format!("must be between 0 and lr({}), got {min}", t.lr));
    }
    if !(t.weight_decay.is_finite() && t.weight_decay >= 0.0) {
        return bad(
            "weight_decay",
            format!("must be a finite number, 0 or more, got {}", t.weight_decay),
        );
    }
    if !(t.clip_grad.is_finite() && t.clip_grad >= 0.0) {
        return bad(
            "clip_grad",
            format!("must be a finite number, 0 (off) or more, got {}", t.clip_grad),
        );
    }
    for (key, v) in [("steps", t.steps), ("warmup", t.warmup), ("max_skips", t.max_skips)] {
        at_most(&format!("train.{key}"), "", v, MAX_SIZE)?;
    }
    // A warmup longer than the run is allowed: `hetpar train --steps 3` on a config with
    // a warmup of 10 is a smoke test, and its saved config names 3 steps; the rate then
    // rises for all of them (`hetpar train` says so).
    Ok(())
}

fn check_data(data: &DataConfig) -> Result<()> {
    at_most("data.max_items", "", data.max_items, MAX_SIZE)?;
    at_most("data.samples", "", data.samples, MAX_SIZE)?;
    if data.max_items == 0 {
        return Err(ConfigError::new(
            "data.max_items",
            "must be at least 1 (each sample draws 0..=max_items items per encoder), got 0",
        ));
    }
    let paths = [
        ("data.path", &data.path),
        ("data.image_root", &data.image_root),
        ("data.tokenizer", &data.tokenizer),
        ("data.heldout", &data.heldout),
    ];
    if let Some((key, _)) = paths.iter().find(|(_, v)| v.as_deref().is_some_and(str::is_empty)) {
        return Err(ConfigError::new(*key, "is empty: name a file or directory, or leave it out"));
    }
    if data.source == DataSource::Llava && data.path.is_none() {
        return Err(ConfigError::new(
            "data.path",
            "source = \"llava\" needs path = a LLaVA JSON file or a `hetpar data synth` directory",
        ));
    }
    if data.source != DataSource::Llava
        && let Some((key, _)) = paths.iter().find(|(_, v)| v.is_some())
    {
        let own = match data.source {
            DataSource::Synth => {
                "generates its own set into the cache (to train on files, set source = \"llava\"; `hetpar data synth --out DIR` writes the synthetic set where you choose)"
            }
            _ => "draws its samples in memory (to train on files, set source = \"llava\")",
        };
        return Err(ConfigError::new(
            *key,
            format!("applies to source = \"llava\" only; source \"{}\" {own}", data.source.name()),
        ));
    }
    if data.source == DataSource::Synth && data.samples < 2 {
        return Err(ConfigError::new(
            "data.samples",
            format!("the synth set needs at least 2 samples (one held out), got {}", data.samples),
        ));
    }
    // Like the files' keys, a size only the synth source reads would be silently ignored.
    if data.samples != DataConfig::SYNTH_SAMPLES && data.source != DataSource::Synth {
        return Err(ConfigError::new(
            "data.samples",
            format!(
                "applies to source = \"synth\" only (the size of the set it generates); source \"{}\" {}",
                data.source.name(),
                match data.source {
                    DataSource::Llava => "trains on the records its file holds",
                    _ => "draws train.global_batch new samples each step",
                }
            ),
        ));
    }
    if data.max_items != 1 && data.source != DataSource::Synthetic {
        return Err(ConfigError::new(
            "data.max_items",
            format!(
                "applies to source = \"synthetic\" only; source \"{}\" takes its items from the data",
                data.source.name()
            ),
        ));
    }
    Ok(())
}

/// One sample must fit `max_items` items of every encoder feeding the LLM plus two text
/// tokens: the first (a BOS) predicts nothing before it, so with one alone a sample full of
/// items has no target, its steps' loss reads 0 and the encoders get no gradient.
fn check_sequence(
    train: &TrainConfig,
    data: &DataConfig,
    modules: &[Module],
    edges: &[Edge],
) -> Result<()> {
    let parts: Vec<String> = edges
        .iter()
        .map(|e| {
            let s = &modules[e.src];
            format!("{} {}", s.rows_per_item().unwrap_or(0), s.name)
        })
        .collect();
    let rows: usize = edges.iter().filter_map(|e| modules[e.src].rows_per_item()).sum();
    let k = data.max_items;
    // Bounded sizes can still make `k * rows` pass 64 bits (an image of 2^24 patches a side).
    let need = k.saturating_mul(rows);
    if need.saturating_add(2) > train.seq_len {
        let items = if k == 1 {
            format!("one item per encoder ({} rows)", parts.join(" + "))
        } else {
            format!(
                "data.max_items({k}) items per encoder ({k} x ({} rows) = {})",
                parts.join(" + "),
                need
            )
        };
        return Err(ConfigError::new(
            "train.seq_len",
            format!(
                "seq_len({}) cannot hold {items} plus two text tokens (a sample's first token predicts nothing)",
                train.seq_len
            ),
        ));
    }
    Ok(())
}

/// Kahn's algorithm. On a cycle, returns one cycle as a closed path of node ids.
pub fn topo_sort(n: usize, edges: &[(usize, usize)]) -> Result<Vec<usize>, Vec<usize>> {
    let mut indeg = vec![0; n];
    for &(_, d) in edges {
        indeg[d] += 1;
    }
    let mut ready: Vec<usize> = (0..n).filter(|&v| indeg[v] == 0).rev().collect();
    let mut order = Vec::with_capacity(n);
    while let Some(v) = ready.pop() {
        order.push(v);
        for &(s, d) in edges {
            if s == v {
                indeg[d] -= 1;
                if indeg[d] == 0 {
                    ready.push(d);
                }
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every node left has a predecessor that is also left: walk predecessors until one repeats.
    let left: Vec<bool> = (0..n).map(|v| indeg[v] > 0).collect();
    let mut v = (0..n).find(|&v| left[v]).expect("a cycle leaves a node");
    let mut path = vec![v];
    loop {
        v = edges.iter().find(|&&(s, d)| d == v && left[s]).map(|&(s, _)| s).expect("predecessor");
        if let Some(i) = path.iter().position(|&p| p == v) {
            let mut cycle: Vec<usize> = path[i..].to_vec();
            cycle.reverse();
            cycle.push(cycle[0]);
            return Err(cycle);
        }
        path.push(v);
    }
}
