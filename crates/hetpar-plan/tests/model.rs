//! The cost model against hand-computed values: parameter counts of published models, FLOPs
//! per token, activation memory per Korthikanti et al., the hardware table, workload errors.

use hetpar_plan::hardware::{builtin, parse};
use hetpar_plan::model::{Mlp, ModuleShape};
use hetpar_plan::{PlanError, Workload};

fn llm(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    ffn: usize,
    vocab: usize,
) -> ModuleShape {
    ModuleShape {
        name: "llm".into(),
        encoder: false,
        hidden,
        layers,
        heads,
        kv_heads: kv,
        ffn,
        mlp: Mlp::Swiglu,
        vocab,
        experts: 0,
        top_k: 0,
        out_hidden: 0,
    }
}

fn within(x: f64, published: f64, tol: f64) -> bool {
    (x - published).abs() / published <= tol
}

#[test]
fn llama3_70b_parameters_within_1_percent() {
    let m = llm(8192, 80, 64, 8, 28672, 128256);
    let p = m.params();
    assert!(within(p, 70.55e9, 0.01), "{p:.4e}");
}

#[test]
fn qwen25_14b_parameters_within_1_percent() {
    // Qwen2.5 has biases on q, k, v (5120 + 2 * 1024 per layer), a rounding error here.
    let m = llm(5120, 48, 40, 8, 13824, 152064);
    let p = m.params();
    assert!(within(p, 14.77e9, 0.01), "{p:.4e}");
}

#[test]
fn gpt_shapes_of_the_llm_only_table_match_their_names() {
    for (h, l, billions) in [(2048, 24, 1.7), (4096, 30, 7.1), (8192, 84, 70.0), (20480, 91, 462.0)]
    {
        let mut m = llm(h, l, h / 128, h / 128, 4 * h, 131072);
        m.mlp = Mlp::Gelu;
        let p = m.params();
        assert!(within(p, billions * 1e9, 0.03), "{h} x {l}: {p:.4e}");
    }
}

#[test]
fn flops_per_token_by_hand() {
    // A tiny GPT layer: h = 8, 2 heads (MHA), ffn 32 GELU, vocab 10, s = 4.
    let mut m = llm(8, 1, 2, 2, 32, 10);
    m.mlp = Mlp::Gelu;
    // Projections 6 * (8 * 24 + 8 * 8) = 1536; MLP 6 * 8 * 32 * 2 = 3072.
    assert_eq!(m.layer_gemm_flops(), 1536.0 + 3072.0);
    // Causal core attention 6 * q * s = 6 * 8 * 4.
    assert_eq!(m.layer_attention_flops(4), 192.0);
    // LM head 6 * h * V.
    assert_eq!(m.end_flops(), 480.0);
    assert_eq!(m.flops_per_token(4), 1536.0 + 3072.0 + 192.0 + 480.0);
    // The 6 * N rule for a large dense model: within 5% of 6 * params plus attention.
    let big = llm(8192, 80, 64, 8, 28672, 128256);
    let six_n = 6.0 * (big.params() - 128256.0 * 8192.0);
    let attn = 80.0 * big.layer_attention_flops(8192);
    assert!(within(big.flops_per_token(8192), six_n + attn, 0.05));
}

#[test]
fn encoders_count_bidirectional_attention() {
    let mut e = llm(8, 1, 2, 2, 32, 0);
    e.encoder = true;
    assert_eq!(e.layer_attention_flops(4), 384.0);
}

#[test]
fn activation_memory_matches_korthikanti_for_gpt_layers() {
    // GPT (MHA, GELU, ffn 4h): 34 bytes per token and hidden unit without the score term.
    let mut m = llm(4096, 1, 32, 32, 16384, 1);
    m.mlp = Mlp::Gelu;
    assert_eq!(m.layer_activation_bytes(), 34.0 * 4096.0);
}

#[test]
fn moe_layers_count_all_experts_but_activate_top_k() {
    // gpt-oss-120b: 36 layers, 2880 wide, 128 experts of 2880, top-4: about 117B in total,
    // about 5.1B active (published: 116.8B and 5.1B).
    let mut m = llm(2880, 36, 64, 8, 2880, 201088);
    m.experts = 128;
    m.top_k = 4;
    assert!(within(m.params(), 116.8e9, 0.02), "{:.4e}", m.params());
    let active = 36.0 * m.active_layer_params() + 2.0 * 201088.0 * 2880.0;
    assert!(within(active, 5.1e9, 0.1), "{active:.4e}");
}

#[test]
fn hardware_table_is_data_and_h100_matches_the_datasheet() {
    let h = builtin("h100").expect("h100");
    assert_eq!(h.peak_tflops, 989.0);
    assert_eq!(h.memory_gib, 80.0);
    assert_eq!(h.gpus_per_node, 8);
    let h200 = builtin("h200").expect("h200");
    assert_eq!(h200.memory_gib, 141.0);
    assert!(builtin("a100").is_ok());
    let err = builtin("tpu").expect_err("unknown");
    assert!(err.0.contains("h100"), "{err}");
    // Ring collectives: a 2-member all-gather of 478 GB inside a node takes half a second.
    assert!((h.ring_time(478e9, 2, 2) - 0.5).abs() < 1e-3);
    // Across nodes the same transfer is ten times slower.
    assert!(h.ring_time(478e9, 2, 16) > 5.0);
    let bad = parse("[x]\npeak_tflops = 1.0\n").expect_err("missing fields");
    assert!(bad.0.contains("line 1, in [x]") && bad.0.contains("missing field"), "{bad}");
}

fn workload_err(text: &str) -> String {
    Workload::from_toml(text).map(|_| ()).expect_err("invalid").0
}

const BASE: &str = r#"
name = "w"
[workload]
seq_len = 1024
global_batch = 8
vision_token_fraction = 0.5
[cluster]
gpus = 8
[modules.vision]
kind = "vit"
image_size = 224
patch_size = 14
hidden = 64
layers = 2
heads = 4
ffn = 128
[modules.llm]
kind = "llama"
vocab = 100
hidden = 64
layers = 2
heads = 4
ffn = 128
[[edges]]
from = "vision"
to = "llm"
"#;

#[test]
fn workloads_parse_and_bad_ones_say_what_to_fix() {
    let w = Workload::from_toml(BASE).expect("valid");
    assert_eq!(w.encoders.len(), 1);
    assert_eq!(w.encoders[0].seq, 256);
    // Half of 1024 LLM positions in items of 256 rows: two images per sample.
    assert_eq!(w.encoders[0].items_per_sample, 2.0);
    assert!(
        workload_err(&BASE.replace("gpus = 8", "gpus = 8\nnodes = 1")).contains("unknown field")
    );
    // A size the planner may pin, written in the module's own table, is pointed to its
    // parallel table; a key that table does not take here (a config's `recompute`) is not.
    let pinned = workload_err(&BASE.replace("kind = \"vit\"", "kind = \"vit\"\ntp = 2"));
    assert!(pinned.ends_with("(`tp` belongs in [modules.vision.parallel])"), "{pinned}");
    let other = workload_err(&BASE.replace("kind = \"vit\"", "kind = \"vit\"\nrecompute = true"));
    assert!(!other.contains("belongs in"), "{other}");
    assert!(
        workload_err(&BASE.replace("patch_size = 14", "patch_size = 15")).contains(
            "modules.vision: image_size(224) is not a positive multiple of patch_size(15)"
        )
    );
    // The module checks are a config's: a field of another kind is refused.
    assert!(
        workload_err(&BASE.replace("patch_size = 14", "patch_size = 14\nvocab = 10"))
            .contains("modules.vision: `vocab` does not apply to kind \"vit\"")
    );
    assert!(
        workload_err(&BASE.replace("[[edges]]\nfrom = \"vision\"\nto = \"llm\"\n", ""))
            .contains("needs exactly one edge")
    );
    assert!(
        workload_err(&BASE.replace("vision_token_fraction = 0.5", "vision_token_fraction = 1.5"))
            .contains("not in [0, 1)")
    );
    // No share for a vit encoder is refused under the field that gave it.
    let e = workload_err(&BASE.replace("vision_token_fraction = 0.5", "vision_token_fraction = 0"));
    assert!(
        e.starts_with("workload.vision_token_fraction: 0 is not in (0, 1): encoder vision needs"),
        "{e}"
    );
    let pinned = BASE.replace(
        "ffn = 128\n[[edges]]",
        "ffn = 128\n[modules.llm.parallel]\nranks = [0, 8]\n[[edges]]",
    );
    assert!(workload_err(&pinned).contains("the planner chooses placements"));
    let e: PlanError = Workload::from_toml("name = 1").expect_err("bad");
    assert!(e.0.contains("line 1"), "{e}");
    // Sizes are bounded before any search uses them, from the file and from `--gpus`.
    let huge = 1u64 << 40;
    for (from, to, want) in [
        ("gpus = 8", format!("gpus = {huge}"), "cluster.gpus: 1099511627776 is more than 1048576"),
        (
            "gpus = 8",
            "gpus = 8
gpus_per_node = 0"
                .into(),
            "cluster.gpus_per_node: must be at least 1",
        ),
        (
            "global_batch = 8",
            format!("global_batch = {huge}"),
            "workload.global_batch: 1099511627776 is more than 16777216",
        ),
        (
            "seq_len = 1024",
            format!("seq_len = {huge}"),
            "workload.seq_len: 1099511627776 is more than 16777216",
        ),
    ] {
        let e = workload_err(&BASE.replace(from, &to));
        assert!(e.starts_with(want), "{to}: {e}");
    }
    let w = Workload::from_toml(BASE).expect("valid");
    assert_eq!(w.clone().with_gpus(16384).expect("16384 GPUs").gpus, 16384);
    for n in [0, 1 << 21] {
        let e = w.clone().with_gpus(n).expect_err("out of range").0;
        assert_eq!(e, format!("{n} GPUs: use 1 to 1048576"));
    }
}

#[test]
fn hardware_files_with_sizes_no_cost_can_divide_by_are_refused() {
    let table = |gpus: &str, inter: &str| {
        format!(
            "[x]\ndescription = \"x\"\npeak_tflops = 1.0\nmemory_gib = 1.0\nhbm_gbps = 1.0\ngpus_per_node = {gpus}\nintra_node_gbps = 1.0\ninter_node_gbps = {inter}\nlatency_us = 1.0\n"
        )
    };
    assert!(parse(&table("8", "1.0")).is_ok());
    let e = parse(&table("0", "1.0")).expect_err("no GPUs per node").0;
    assert!(e.starts_with("hardware x: gpus_per_node must be at least 1"), "{e}");
    let e = parse(&table("8", "0.0")).expect_err("no network").0;
    assert_eq!(e, "hardware x: inter_node_gbps must be positive, got 0");
    // The efficiency factors, each in the range its meaning allows.
    let with = |factor: &str| format!("{}[x.efficiency]\n{factor}\n", table("8", "1.0"));
    assert!(parse(&with("gemm = 1.0\ncp_overlap = 0.0\ncp_attention = 1.0")).is_ok());
    for (factor, want) in [
        ("gemm = 0.0", "gemm is a fraction of peak: more than 0 and at most 1, got 0"),
        ("gemm = -0.5", "gemm is a fraction of peak: more than 0 and at most 1, got -0.5"),
        ("attention = nan", "attention is a fraction of peak: more than 0 and at most 1, got NaN"),
        (
            "all_to_all = 1.5",
            "all_to_all is a fraction of the bus bandwidth: more than 0 and at most 1, got 1.5",
        ),
        (
            "cp_attention = -1.0",
            "cp_attention is a slowdown of the attention (its rate divided by it): 1 or more, got -1",
        ),
        (
            "cp_attention = 0.5",
            "cp_attention is a slowdown of the attention (its rate divided by it): 1 or more, got 0.5",
        ),
        ("cp_overlap = 5.0", "cp_overlap is a share: from 0 to 1, got 5"),
        ("dp_overlap = -0.1", "dp_overlap is a share: from 0 to 1, got -0.1"),
        ("cp_step = inf", "cp_step must be a finite number, 0 or more, got inf"),
        ("overhead_gib = -1.0", "overhead_gib must be a finite number, 0 or more, got -1"),
    ] {
        let e = parse(&with(factor)).expect_err(factor).0;
        assert_eq!(e, format!("hardware x: efficiency.{want}"), "{factor}");
    }
}
