//! RELIABILITY.md row 7: every malformed config is rejected before any rank starts, with one
//! line naming the field and the arithmetic. Each case edits one thing of a valid config.

use hetpar_layout::{Config, ModelGraph, PlacementMode, Strategy};

const GOOD: &str = r#"
name = "t"
[train]
global_batch = 32
microbatches = 4
seq_len = 128

[modules.vision]
kind = "vit"
image_size = 32
patch_size = 8
hidden = 64
layers = 2
heads = 4
ffn = 128
[modules.vision.parallel]
ranks = [0, 8]

[modules.llm]
kind = "llama"
vocab = 512
hidden = 96
layers = 4
heads = 8
kv_heads = 4
ffn = 192
[modules.llm.parallel]
ranks = [0, 8]
tp = 4
cp = 2
sp = true

[modules.audio]
kind = "audio"
n_mels = 16
frames = 32
hidden = 64
layers = 2
heads = 4
ffn = 128
[modules.audio.parallel]
ranks = [8, 10]

[[edges]]
from = "vision"
to = "llm"

[[edges]]
from = "audio"
to = "llm"
"#;

fn validate(text: &str) -> Result<ModelGraph, String> {
    let cfg = Config::from_toml(text).map_err(|e| e.to_string())?;
    ModelGraph::from_config(&cfg).map_err(|e| e.to_string())
}

/// The error of `GOOD` with `from` replaced by `to` (exactly once).
fn error_after(from: &str, to: &str) -> String {
    assert_eq!(GOOD.matches(from).count(), 1, "edit target {from:?} must be unique");
    let msg = validate(&GOOD.replacen(from, to, 1)).expect_err("the edit breaks the config");
    assert!(!msg.contains('\n'), "one line: {msg}");
    msg
}

#[test]
fn the_base_config_is_valid() {
    let g = validate(GOOD).expect("valid");
    assert_eq!(g.world, 10);
    let vision = g.module_id("vision").expect("vision");
    let e = g.edges.iter().find(|e| e.src == vision).expect("edge");
    assert_eq!((e.mode, e.strategy), (PlacementMode::Colocated, Strategy::Exact));
    assert_eq!(g.modules[vision].layout.dp(), 8);
    let audio = g.edges.iter().find(|e| e.src != vision).expect("edge");
    assert_eq!(audio.mode, PlacementMode::NonColocated);
    assert_eq!(audio.strategy, Strategy::Leaders { stripes: 1 });
}

/// An audio module without `frames` (as INTERFACES.md's example writes it) takes
/// Whisper's 3000 frames, 1,500 rows a clip.
#[test]
fn an_audio_module_without_frames_takes_whispers() {
    let text = GOOD.replacen("frames = 32\n", "", 1).replacen("seq_len = 128", "seq_len = 2048", 1);
    let g = validate(&text).expect("valid");
    let audio = g.module_id("audio").expect("audio");
    assert_eq!(
        g.modules[audio].spec,
        hetpar_layout::ModuleSpec::Audio {
            n_mels: 16,
            frames: hetpar_layout::graph::DEFAULT_FRAMES
        }
    );
    assert_eq!(hetpar_layout::graph::DEFAULT_FRAMES, 3000);
}

#[test]
fn axes_that_do_not_fill_the_span() {
    assert_eq!(
        error_after("tp = 4\ncp = 2", "tp = 4\ncp = 3"),
        "modules.llm.parallel: tp(4) * cp(3) * pp(1) = 12 does not divide span [0, 8) of 8 ranks"
    );
}

#[test]
fn tp_that_does_not_divide_heads_or_kv_heads() {
    assert_eq!(
        error_after("heads = 8\nkv_heads = 4", "heads = 6\nkv_heads = 2"),
        "modules.llm.parallel: tp(4) does not divide heads(6)"
    );
    assert_eq!(
        error_after("kv_heads = 4", "kv_heads = 2"),
        "modules.llm.parallel: tp(4) does not divide kv_heads(2)"
    );
}

#[test]
fn ep_must_divide_experts() {
    let text = GOOD.replacen("kv_heads = 4", "kv_heads = 4\nexperts = 6\ntop_k = 2", 1).replacen(
        "sp = true",
        "sp = true\nep = 4\netp = 1",
        1,
    );
    assert_eq!(
        validate(&text).expect_err("6 % 4"),
        "modules.llm.parallel: ep(4) does not divide experts(6)"
    );
    // A dense module is told it has no experts, not about the expert view's arithmetic.
    assert_eq!(
        error_after("sp = true", "sp = true\nep = 2"),
        "modules.llm.parallel: ep(2) needs a MoE module (experts > 0)"
    );
    assert_eq!(
        error_after("sp = true", "sp = true\netp = 2"),
        "modules.llm.parallel: etp(2) needs a MoE module (experts > 0)"
    );
    assert_eq!(
        error_after("kv_heads = 4", "kv_heads = 3"),
        "modules.llm: heads(8) must be a multiple of kv_heads(3)"
    );
    assert_eq!(
        error_after("vocab = 512", "vocab = 0"),
        "modules.llm: vocab must be at least 1, got 0"
    );
}

#[test]
fn spans_that_overlap_partly() {
    assert_eq!(
        error_after("ranks = [8, 10]", "ranks = [6, 10]"),
        "modules.llm.parallel.ranks: [0, 8) partly overlaps modules.audio.parallel.ranks [6, 10): spans must be equal (colocated) or disjoint (non-colocated)"
    );
}

#[test]
fn unknown_keys_anywhere() {
    assert_eq!(
        error_after("tp = 4", "tpp = 4"),
        "line 29, in [modules.llm.parallel]: unknown field `tpp`, expected one of `ranks`, `tp`, `cp`, `pp`, `ep`, `etp`, `sp`, `vpp`, `offload`, `recompute` (did you mean `tp`?)"
    );
    let warmup = error_after("seq_len = 128", "seq_len = 128\nwarmpu = 3");
    assert!(warmup.starts_with("line 7, in [train]: unknown field `warmpu`"), "{warmup}");
    assert!(warmup.ends_with("(did you mean `warmup`?)"), "{warmup}");
    let name = error_after("name = \"t\"", "name = \"t\"\nnmae = 1");
    assert!(name.starts_with("line 3: unknown field `nmae`"), "{name}");
    assert!(name.ends_with("(did you mean `name`?)"), "{name}");
    // A word unlike every key gets no guess.
    let other = error_after("name = \"t\"", "name = \"t\"\nbanana = 1");
    assert!(!other.contains("did you mean"), "{other}");
    // A layout key in the module's own table, and dp, which is derived, say so.
    let moved = error_after("kind = \"audio\"", "kind = \"audio\"\nrecompute = true");
    assert!(moved.ends_with("(`recompute` belongs in [modules.audio.parallel])"), "{moved}");
    let dp = error_after("tp = 4", "tp = 4\ndp = 2");
    assert!(dp.ends_with("(dp is not set: it is the span's ranks divided by tp*cp*pp)"), "{dp}");
}

#[test]
fn optimizer_settings_out_of_range() {
    for (to, want) in [
        ("lr = 0.0", "train.lr: must be a positive finite number, got 0"),
        (
            "lr = 1e300",
            "train.lr: must be at most 3.4028235e38, f32's largest value (one update by more makes every f32 weight infinite), got 1e300",
        ),
        ("min_lr = 0.5", "train.min_lr: must be between 0 and lr(0.001), got 0.5"),
        ("weight_decay = -0.1", "train.weight_decay: must be a finite number, 0 or more, got -0.1"),
        ("clip_grad = -1.0", "train.clip_grad: must be a finite number, 0 (off) or more, got -1"),
        ("weight_decay = inf", "train.weight_decay: must be a finite number, 0 or more, got inf"),
        ("clip_grad = inf", "train.clip_grad: must be a finite number, 0 (off) or more, got inf"),
        ("lr = inf", "train.lr: must be a positive finite number, got inf"),
    ] {
        let edit = format!("seq_len = 128\n{to}");
        let msg = error_after("seq_len = 128", &edit);
        assert_eq!(msg, want, "{to}");
    }
    let g = validate(&GOOD.replacen(
        "seq_len = 128",
        "seq_len = 128\non_nonfinite = \"skip\"\nmax_skips = 2",
        1,
    ))
    .expect("valid");
    assert_eq!((g.train.on_nonfinite, g.train.max_skips), (hetpar_layout::OnNonFinite::Skip, 2));
    // A warmup past the last step (a short run of a longer config, as its saved config
    // says) is a schedule that never leaves its warmup, not a mistake.
    let g =
        validate(&GOOD.replacen("seq_len = 128", "seq_len = 128\nwarmup = 21", 1)).expect("valid");
    assert_eq!((g.train.warmup, g.train.steps), (21, 20));
}

#[test]
fn module_learning_rates_and_frozen_modules() {
    let msg = error_after("kind = \"vit\"", "kind = \"vit\"\nlr = -1e-3");
    assert_eq!(
        msg,
        "modules.vision.lr: must be a positive finite number (trainable = false freezes a module), got -0.001"
    );
    let g = validate(&GOOD.replacen(
        "kind = \"vit\"",
        "kind = \"vit\"\nlr = 1e-4\ntrainable = false",
        1,
    ))
    .expect("valid");
    let v = &g.modules[g.module_id("vision").expect("vision")];
    assert_eq!((v.lr, v.trainable), (Some(1e-4), false));
    let all = GOOD
        .replace("kind = \"vit\"", "kind = \"vit\"\ntrainable = false")
        .replace("kind = \"llama\"", "kind = \"llama\"\ntrainable = false")
        .replace("kind = \"audio\"", "kind = \"audio\"\ntrainable = false");
    assert_eq!(
        validate(&all).expect_err("all frozen"),
        "modules: every module has trainable = false: nothing would train"
    );
}

#[test]
fn missing_modules() {
    assert_eq!(
        error_after("from = \"audio\"", "from = \"sound\""),
        "edges[1].from: \"sound\" names no module; modules are audio, llm, vision"
    );
    let msg = validate("name = \"t\"\n[train]\nglobal_batch = 1\nmicrobatches = 1\nseq_len = 8\n")
        .expect_err("no modules");
    assert_eq!(msg, "modules: no modules defined: add a [modules.NAME] table");
    let no_llm = GOOD.replacen("kind = \"llama\"", "kind = \"vit\"", 1);
    assert!(
        validate(&no_llm)
            .expect_err("no llama")
            .starts_with("modules.llm: `vocab` does not apply to kind \"vit\"")
    );
    assert_eq!(
        error_after("patch_size = 8\n", ""),
        "modules.vision: kind \"vit\" needs `patch_size`"
    );
}

#[test]
fn names_that_would_name_files_outside_the_run() {
    for bad in ["../../evil", "", "a b/c", ".hidden", "x.y"] {
        let text = GOOD
            .replacen("[modules.audio]", &format!("[modules.{bad:?}]"), 1)
            .replacen("[modules.audio.parallel]", &format!("[modules.{bad:?}.parallel]"), 1)
            .replacen("from = \"audio\"", &format!("from = {bad:?}"), 1);
        let msg = validate(&text).expect_err(bad);
        assert!(msg.starts_with(&format!("modules.{bad:?}: {bad:?} is not a name")), "{msg}");
    }
    assert!(error_after("name = \"t\"", "name = \"../t\"").starts_with(
        "name: \"../t\" is not a name: use 1 to 64 ASCII letters, digits, `_`, `-`, `.`,"
    ));
    assert!(validate(&GOOD.replacen("name = \"t\"", "name = \"llava-1.5_b\"", 1)).is_ok());
    assert_eq!(
        error_after("ranks = [8, 10]", "ranks = [8, 10, 12]"),
        "line 42, in [modules.audio.parallel]: ranks must be [start, end), two numbers; got 3 of them"
    );
}

#[test]
fn encoders_split_items_so_any_encoder_dp_is_accepted() {
    // vision is tp 1 dp 8 and audio dp 2 next to one sample per microbatch.
    let g = validate(&GOOD.replace("global_batch = 32", "global_batch = 4")).expect("valid");
    assert_eq!(g.microbatch_size(), 1);
    assert_eq!(g.modules[g.module_id("vision").expect("vision")].layout.dp(), 8);
}

/// A sample must hold its items and two text tokens (the first predicts nothing): at one
/// token a sample full of items had no target, and a step of such samples read loss 0.
/// At the tightest length every synthetic sample keeps two text tokens.
#[test]
fn seq_len_must_leave_two_text_tokens() {
    let plain = GOOD.replacen("tp = 4\ncp = 2\nsp = true", "tp = 1", 1);
    let with = |seq: usize| plain.replacen("seq_len = 128", &format!("seq_len = {seq}"), 1);
    assert_eq!(
        validate(&with(33)).expect_err("one text token"),
        "train.seq_len: seq_len(33) cannot hold one item per encoder (16 vision + 16 audio rows) plus two text tokens (a sample's first token predicts nothing)"
    );
    let g = validate(&with(34)).expect("two text tokens");
    for step in 0..200 {
        for x in hetpar_layout::BatchManifest::synthetic(&g, step).samples() {
            let rows: usize = x.items.iter().map(|i| i.rows).sum();
            assert!(x.len >= rows + 2, "step {step}: {} tokens, {rows} of them items", x.len);
        }
    }
}

#[test]
fn max_items_must_fit_and_apply() {
    let with = |data: &str| {
        GOOD.replace("\n[modules.vision]", &format!("\n[data]\n{data}\n[modules.vision]"))
    };
    assert_eq!(validate(&with("max_items = 3")).expect("fits").data.max_items, 3);
    assert_eq!(
        validate(&with("max_items = 0")).expect_err("zero"),
        "data.max_items: must be at least 1 (each sample draws 0..=max_items items per encoder), got 0"
    );
    assert_eq!(
        validate(&with("max_items = 4")).expect_err("too long"),
        "train.seq_len: seq_len(128) cannot hold data.max_items(4) items per encoder (4 x (16 vision + 16 audio rows) = 128) plus two text tokens (a sample's first token predicts nothing)"
    );
    assert_eq!(
        validate(&with("source = \"llava\"\npath = \"d\"\nmax_items = 2"))
            .expect_err("not synthetic"),
        "data.max_items: applies to source = \"synthetic\" only; source \"llava\" takes its items from the data"
    );
    assert_eq!(
        validate(&with("source = \"llava\"")).expect_err("no path"),
        "data.path: source = \"llava\" needs path = a LLaVA JSON file or a `hetpar data synth` directory"
    );
    assert_eq!(
        validate(&with("source = \"synth\"\nsamples = 1")).expect_err("too few"),
        "data.samples: the synth set needs at least 2 samples (one held out), got 1"
    );
    assert_eq!(
        validate(&with("source = \"synth\"\non_bad = \"skip\"")).expect("ok").data.samples,
        1000
    );
    assert_eq!(
        validate(&with("source = \"llava\"\npath = \"d\"\nheldout = \"\"")).expect_err("empty"),
        "data.heldout: is empty: name a file or directory, or leave it out"
    );
    // The synth set's size applies to synth only, and the files' keys to llava only:
    // elsewhere they would be silently ignored.
    assert_eq!(
        validate(&with("samples = 50")).expect_err("synthetic draws each step"),
        "data.samples: applies to source = \"synth\" only (the size of the set it generates); source \"synthetic\" draws train.global_batch new samples each step"
    );
    assert_eq!(
        validate(&with("source = \"llava\"\npath = \"d\"\nsamples = 50")).expect_err("files"),
        "data.samples: applies to source = \"synth\" only (the size of the set it generates); source \"llava\" trains on the records its file holds"
    );
    assert_eq!(
        validate(&with("source = \"synth\"\nsamples = 50")).expect("synth").data.samples,
        50
    );
    assert_eq!(
        validate(&with("source = \"synth\"\npath = \"d\"")).expect_err("synth has no path"),
        "data.path: applies to source = \"llava\" only; source \"synth\" generates its own set into the cache (to train on files, set source = \"llava\"; `hetpar data synth --out DIR` writes the synthetic set where you choose)"
    );
    assert_eq!(
        validate(&with("image_root = \"d\"")).expect_err("synthetic has no files"),
        "data.image_root: applies to source = \"llava\" only; source \"synthetic\" draws its samples in memory (to train on files, set source = \"llava\")"
    );
}

#[test]
fn a_cycle_in_the_graph() {
    let text = format!("{GOOD}\n[[edges]]\nfrom = \"llm\"\nto = \"vision\"\n");
    assert_eq!(validate(&text).expect_err("cycle"), "edges: form a cycle: vision -> llm -> vision");
}

#[test]
fn batch_not_divisible_by_microbatches_times_llm_dp() {
    // The LLM splits samples: tp 2 cp 2 on 8 ranks is dp 2, which 3 samples do not split.
    let text = GOOD
        .replace("tp = 4\ncp = 2", "tp = 2\ncp = 2")
        .replace("global_batch = 32", "global_batch = 12");
    assert_eq!(
        validate(&text).expect_err("3 samples over dp 2"),
        "train.global_batch: global_batch(12) / microbatches(4) = 3 samples per microbatch is not divisible by modules.llm dp(2)"
    );
    assert_eq!(
        error_after("global_batch = 32", "global_batch = 30"),
        "train.global_batch: global_batch(30) must be a positive multiple of microbatches(4)"
    );
}

#[test]
fn sequence_arithmetic() {
    assert_eq!(
        error_after("seq_len = 128", "seq_len = 102"),
        "modules.llm.parallel: train.seq_len(102) is not divisible by 2*cp = 4 load-balanced chunks"
    );
    assert_eq!(
        error_after("seq_len = 128", "seq_len = 20"),
        "modules.llm.parallel: sequence parallelism needs seq_len(20) / cp(2) = 10 divisible by tp(4)"
    );
    assert_eq!(
        error_after("seq_len = 128", "seq_len = 16"),
        "train.seq_len: seq_len(16) cannot hold one item per encoder (16 vision + 16 audio rows) plus two text tokens (a sample's first token predicts nothing)"
    );
}

#[test]
fn placement_and_strategy_mismatches() {
    assert_eq!(
        error_after(
            "from = \"audio\"\nto = \"llm\"",
            "from = \"audio\"\nto = \"llm\"\nstrategy = \"gather\""
        ),
        "edges[1]: strategy \"gather\" needs colocated modules, but spans [8, 10) and [0, 8) are disjoint"
    );
    assert_eq!(
        error_after(
            "from = \"audio\"\nto = \"llm\"",
            "from = \"audio\"\nto = \"llm\"\nstripes = 4"
        ),
        "edges[1]: stripes(4) must be in 1..=1: min(source tp*cp = 1, destination tp*cp = 8)"
    );
    assert_eq!(
        error_after(
            "from = \"vision\"\nto = \"llm\"",
            "from = \"vision\"\nto = \"llm\"\nstrategy = \"leaders\""
        ),
        "edges[0]: strategy \"leaders\" needs disjoint spans, but both modules use [0, 8)"
    );
    assert_eq!(
        error_after("ranks = [8, 10]", "ranks = [9, 11]"),
        "modules: ranks [8, 9) belong to no module: every rank in [0, 11) must be in some module's span"
    );
    let text = GOOD.replacen("[[edges]]\nfrom = \"audio\"\nto = \"llm\"\n", "", 1);
    assert_eq!(
        validate(&text).expect_err("dangling encoder"),
        "modules.audio: encoder feeds no module: add [[edges]] from = \"audio\" to = \"llm\""
    );
}

#[test]
fn pipeline_options() {
    assert_eq!(
        error_after("sp = true", "sp = true\nvpp = 2"),
        "modules.llm.parallel: vpp(2) (interleaved 1F1B) needs the llama module with pp > 1, got kind \"llama\" with pp(1)"
    );
    assert_eq!(
        error_after("ranks = [8, 10]", "ranks = [8, 10]\noffload = true"),
        "modules.audio.parallel.offload: offload frees memory for a colocated LLM, but [8, 10) shares no ranks with the llama module"
    );
    // Beside another encoder only: no LLM phase on those ranks to free memory for.
    let text = GOOD
        .replacen(
            "[modules.vision.parallel]\nranks = [0, 8]",
            "[modules.vision.parallel]\nranks = [8, 10]",
            1,
        )
        .replacen("ranks = [8, 10]\n", "ranks = [8, 10]\noffload = true\n", 2);
    assert_eq!(
        validate(&text).expect_err("offload beside an encoder"),
        "modules.audio.parallel.offload: offload frees memory for a colocated LLM, but [8, 10) shares no ranks with the llama module"
    );
    let text = GOOD.replacen(
        "ranks = [0, 8]\ntp = 4\ncp = 2",
        "ranks = [0, 8]\ntp = 2\ncp = 2\npp = 2\nvpp = 2",
        1,
    );
    let text = text.replacen("microbatches = 4", "microbatches = 3", 1).replacen(
        "global_batch = 32",
        "global_batch = 24",
        1,
    );
    assert_eq!(
        validate(&text).expect_err("3 % 2"),
        "modules.llm.parallel: interleaved 1F1B needs train.microbatches(3) divisible by pp(2)"
    );
}

#[test]
fn expert_and_encoder_sharding_limits() {
    let moe = GOOD.replacen("kv_heads = 4", "kv_heads = 4\nexperts = 8\ntop_k = 2", 1);
    let g = validate(&moe).expect("MoE with the default etp");
    let llm = g.module_id("llm").expect("llm");
    assert_eq!(g.modules[llm].layout.etp(), 1);
    let text = moe.replacen("sp = true", "sp = true\netp = 2", 1);
    assert_eq!(
        validate(&text).expect_err("etp 2"),
        "modules.llm.parallel: etp(2): expert tensor parallelism is not supported yet; experts stay whole on their ep rank (etp = 1)"
    );
    let text = GOOD.replacen("image_size = 32", "image_size = 24", 1).replacen(
        "ranks = [0, 8]\n\n[modules.llm]",
        "ranks = [0, 8]\ncp = 2\n\n[modules.llm]",
        1,
    );
    assert_eq!(
        validate(&text).expect_err("9 patches over cp 2"),
        "modules.vision.parallel: 9 rows per item do not split into cp(2) x sequence-parallel tp(1) = 2 equal parts"
    );
}

#[test]
fn sizes_past_the_largest_hetpar_takes() {
    // RELIABILITY.md's security line: every size read from a file is bounded before any
    // product or allocation uses it (a batch of 2^40 samples once made `hetpar layout` ask
    // for 32 TB).
    let huge = 1u64 << 40;
    for (from, to, want) in [
        (
            "global_batch = 32",
            format!("global_batch = {huge}"),
            "train.global_batch: 1099511627776 is more than 16777216, the largest hetpar takes",
        ),
        (
            "seq_len = 128",
            format!("seq_len = {huge}"),
            "train.seq_len: 1099511627776 is more than 16777216",
        ),
        (
            "vocab = 512",
            format!("vocab = {huge}"),
            "modules.llm: vocab(1099511627776) is more than 16777216",
        ),
        (
            "ffn = 192",
            format!("ffn = {huge}"),
            "modules.llm: ffn(1099511627776) is more than 16777216",
        ),
        (
            "ranks = [8, 10]",
            format!("ranks = [8, {huge}]"),
            "modules.audio.parallel.ranks: end(1099511627776) is more than 1048576",
        ),
    ] {
        let msg = error_after(from, &to);
        assert!(msg.starts_with(want), "{to}: {msg}");
    }
    let tp = error_after("tp = 4\ncp = 2", &format!("tp = {huge}\ncp = 2"));
    assert!(tp.starts_with("modules.llm.parallel: tp(1099511627776) is more than 1048576"), "{tp}");
    // Each within bounds, together too many tokens a step.
    let big = GOOD.replacen("global_batch = 32", "global_batch = 16777216", 1).replacen(
        "seq_len = 128",
        "seq_len = 16384",
        1,
    );
    let msg = validate(&big).expect_err("2^38 tokens a step");
    assert_eq!(
        msg,
        "train.global_batch: global_batch(16777216) x seq_len(16384) = 274877906944 tokens a step is more than 4294967296, the most hetpar takes"
    );
    // Bounded sizes whose product passes 64 bits (2^16 items of 2^48 patches) are refused,
    // not wrapped around.
    let wide = GOOD
        .replacen("image_size = 32\npatch_size = 8", "image_size = 16777216\npatch_size = 1", 1)
        .replacen("name = \"t\"", "name = \"t\"\n[data]\nmax_items = 65536", 1);
    let msg = validate(&wide).expect_err("too many rows");
    assert!(
        msg.starts_with("train.seq_len: seq_len(128) cannot hold data.max_items(65536)"),
        "{msg}"
    );
}

/// A value of the wrong type is named in words, not by the Rust type it was read into.
#[test]
fn wrong_types_are_named_in_words() {
    let msg = error_after("seq_len = 128", "seq_len = \"long\"");
    assert!(msg.ends_with("invalid type: string \"long\", expected a whole number"), "{msg}");
    let msg = error_after("seq_len = 128", "seq_len = 128\nlr = \"fast\"");
    assert!(msg.ends_with("invalid type: string \"fast\", expected a number"), "{msg}");
    let msg = validate(&GOOD.replacen("[train]\n", "train = 5\n[training]\n", 1))
        .expect_err("train is a table");
    assert!(!msg.contains("struct") && !msg.contains("usize"), "{msg}");
}
