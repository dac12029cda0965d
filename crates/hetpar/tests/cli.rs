//! The `hetpar` binary end to end: every example config, JSON fields, one-line errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use expect_test::expect_file;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The cache every command of this test process shares (the synthetic sets it generates):
/// one directory under cargo's scratch space for tests, emptied on first use, so that a
/// set left by an earlier run cannot stand in for a first generation, and runs leave one
/// cache behind, not one each.
fn cache() -> PathBuf {
    static FRESH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    FRESH
        .get_or_init(|| {
            let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hetpar-cli-cache");
            let _ = std::fs::remove_dir_all(&d);
            d
        })
        .clone()
}

/// The small model on in-memory data: quick to train where a test needs many steps.
const IN_MEMORY: &str = "examples/in-memory.toml";

/// `hetpar ARGS` in the repository's root, with the tests' data cache.
fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hetpar"));
    c.args(args).env("HETPAR_CACHE", cache()).current_dir(root());
    c
}

fn hetpar(args: &[&str]) -> Output {
    command(args).output().expect("hetpar runs")
}

/// [`hetpar`], killed and the test failed where it has not finished within `secs`: for
/// inputs that once made it hang.
fn hetpar_within(secs: u64, args: &[&str]) -> Output {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child =
        command(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("hetpar runs");
    // Both pipes read as the child writes, so a long output cannot block it.
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            pipe.expect("piped").read_to_end(&mut bytes).expect("read");
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + Duration::from_secs(secs);
    let status = loop {
        if let Some(status) = child.try_wait().expect("waits") {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().expect("killed");
            child.wait().expect("ended");
            let err = stderr.join().expect("stderr");
            let err = String::from_utf8_lossy(&err);
            panic!("hetpar {args:?} still running after {secs} s: {err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (stdout.join().expect("stdout"), stderr.join().expect("stderr"));
    Output { status, stdout, stderr }
}

/// Output that closes early (`hetpar plan ... | head -1`) ends the process quietly, as a
/// command-line tool's, rather than with a panic and its backtrace.
#[test]
fn a_closed_output_ends_the_process_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let mut child = command(&["plan", "examples/workloads/mm-1b-7b-8k.toml", "--top", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hetpar runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("ends");
    let err = String::from_utf8_lossy(&out.stderr);
    // Ended by SIGPIPE (13 on Linux).
    assert_eq!(out.status.signal(), Some(13), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let made = Command::new("mkfifo").arg(path).status().expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", path.display());
}

fn examples() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root().join("examples"))
        .expect("examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| format!("examples/{}", p.file_name().expect("name").to_string_lossy()))
        .collect();
    v.sort();
    assert!(v.len() >= 4, "examples: {v:?}");
    v
}

fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).expect("utf-8")
}

#[test]
fn layout_text_of_the_colocated_fan_in() {
    let text = stdout(&hetpar(&["layout", "examples/colocated-fanin.toml", "--programs"]));
    expect_file!["snapshots/layout-colocated-fanin.txt"].assert_eq(&text);
}

/// `--programs --rank` prints the chosen ranks' programs, each the same lines as in every
/// rank's listing (there from the whole plans under `gather`, here from each rank's share),
/// names a chosen rank outside an edge's modules, and refuses one outside the world.
#[test]
fn layout_programs_of_chosen_ranks_are_their_lines_of_every_ranks() {
    for (cfg, ranks) in [
        ("examples/colocated-fanin.toml", "5,0"),
        ("examples/two-encoders-islands.toml", "0,4,7"),
        ("examples/dp3-into-dp2.toml", "1,3"),
    ] {
        let every = stdout(&hetpar(&["layout", cfg, "--programs", "--step", "1"]));
        let chosen =
            stdout(&hetpar(&["layout", cfg, "--programs", "--step", "1", "--rank", ranks]));
        let wanted: Vec<String> = ranks.split(',').map(|r| format!("{r:>4}: ")).collect();
        let of_chosen = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| !l.starts_with("    ") || wanted.iter().any(|w| l[4..].starts_with(w)))
                .filter(|l| !l.contains(" in neither "))
                .map(str::to_string)
                .collect()
        };
        assert_eq!(of_chosen(&chosen), of_chosen(&every), "{cfg}");
        assert!(chosen.lines().filter(|l| l.starts_with("    ")).count() > 0, "{cfg}");
    }
    let text = stdout(&hetpar(&[
        "layout",
        "examples/two-encoders-islands.toml",
        "--programs",
        "--rank",
        "0,4,5",
    ]));
    assert!(text.contains("\n  ranks 4-5 are in neither vision nor llm\n"), "{text}");
    assert!(text.contains("\n  rank 0 is in neither audio nor llm\n"), "{text}");
    let out = hetpar(&["layout", "examples/dp3-into-dp2.toml", "--programs", "--rank", "7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1)
            && err.contains("--rank 7: outside the config's world of 7 ranks"),
        "{err}"
    );
}

/// Under `dtype = "bf16"` boundary rows stay f32 (only the linear products round), so the
/// layout report sizes them as under f32, not at 2 bytes an element.
#[test]
fn layout_sizes_boundary_rows_in_f32_under_bf16() {
    let dir_tmp = temp("layout-bf16");
    let dir = dir_tmp.path();
    let demo_path = root().join("examples/demo.toml");
    let demo = std::fs::read_to_string(&demo_path).expect("demo");
    assert!(demo.contains("lr = 1e-3"), "the demo's [train] changed");
    let path = dir.join("bf16.toml");
    std::fs::write(&path, demo.replacen("lr = 1e-3", "lr = 1e-3\ndtype = \"bf16\"", 1))
        .expect("write");
    let edges = |cfg: &str| -> Vec<Value> {
        let json: Value =
            serde_json::from_str(&stdout(&hetpar(&["layout", cfg, "--json"]))).expect("JSON");
        json["edges"].as_array().expect("edges").clone()
    };
    let (bf16, f32) =
        (edges(path.to_str().expect("utf-8")), edges(demo_path.to_str().expect("utf-8")));
    assert_eq!(bf16.len(), f32.len());
    for (b, f) in bf16.iter().zip(&f32) {
        assert_eq!(b["row_bytes"], f["row_bytes"], "{b}");
        assert_eq!(b["bytes_fwd"], f["bytes_fwd"], "{b}");
    }
    // Every edge of the demo enters its LLM, 96 wide: 384 bytes a row.
    assert!(bf16.iter().all(|e| e["row_bytes"] == 384), "{bf16:?}");
}

#[test]
fn layout_json_has_the_interface_fields_and_exact_meets_the_bound() {
    for example in examples() {
        let json: Value = serde_json::from_str(&stdout(&hetpar(&["layout", &example, "--json"])))
            .expect("one JSON object");
        for m in json["modules"].as_array().expect("modules") {
            for key in ["name", "ranks", "tp", "cp", "dp", "pp", "ep"] {
                assert!(m.get(key).is_some(), "{example}: module lacks {key}");
            }
        }
        let edges = json["edges"].as_array().expect("edges");
        assert!(!edges.is_empty(), "{example}: no edges");
        for e in edges {
            for key in [
                "src",
                "dst",
                "mode",
                "relation",
                "strategy",
                "bytes_fwd",
                "bytes_bwd",
                "bytes_fwd_min",
                "bytes_bwd_min",
            ] {
                assert!(e.get(key).is_some(), "{example}: edge lacks {key}");
            }
            // The strategy is its config spelling, whatever the stripes (scripts match it).
            for s in std::iter::once(e).chain(e["strategies"].as_array().expect("strategies")) {
                let name = s["strategy"].as_str().expect("a strategy name");
                assert!(["exact", "gather", "leaders"].contains(&name), "{example}: {name}");
                let stripes = s["stripes"].as_u64().expect("stripes");
                assert!(stripes == 1 || (name == "leaders" && stripes > 1), "{example}: {s}");
            }
            let exact = e["strategies"]
                .as_array()
                .expect("strategies")
                .iter()
                .find(|s| s["strategy"] == "exact")
                .expect("exact applies everywhere");
            assert_eq!(exact["bytes_fwd"], e["bytes_fwd_min"], "{example}: exact forward");
            assert_eq!(exact["bytes_bwd"], e["bytes_bwd_min"], "{example}: exact backward");
            assert!(e["bytes_fwd"].as_u64() >= e["bytes_fwd_min"].as_u64());
            assert!(e["bytes_fwd_min"].as_u64() > Some(0), "{example}: nothing to move?");
        }
        if example == "examples/two-encoders-islands.toml" {
            // Its vision edge spreads each replica pair over two leader pairs.
            assert!(edges.iter().any(|e| e["strategy"] == "leaders" && e["stripes"] == 2));
        }
    }
}

#[test]
fn text_output_for_every_example() {
    for example in examples() {
        let text = stdout(&hetpar(&["layout", &example]));
        assert!(text.contains("lower bound"), "{example}:\n{text}");
        assert!(text.contains("stage 0"), "{example}:\n{text}");
        assert!(text.contains("items per "), "{example}:\n{text}");
        let text = stdout(&hetpar(&["schedule", &example]));
        assert!(text.contains("\nvalid: every message matched"), "{example}:\n{text}");
    }
}

#[test]
fn an_encoder_at_tp1_next_to_one_sample_per_microbatch_plans_and_schedules() {
    // EXAMPLES.md case 6 in microbatch 0: 12 images of one sample over 8 replicas.
    let example = "examples/encoder-tp1-one-sample.toml";
    let text = stdout(&hetpar(&["layout", example]));
    assert!(
        text.contains("mb 0, 12 items (samples 0 0 0 0 0 0 0 0 0 0 0 0): dp0 0, dp1 1-2, dp2 3, dp3 4-5, dp4 6, dp5 7-8, dp6 9, dp7 10-11"),
        "{text}"
    );
    assert!(
        text.contains(
            "mb 2, 3 items (samples 2 2 2): dp0 -, dp1 -, dp2 0, dp3 -, dp4 -, dp5 1, dp6 -, dp7 2"
        ),
        "{text}"
    );
    let text = stdout(&hetpar(&["schedule", example]));
    assert!(text.contains("\nstep 0: items drawn by the synthetic source\n"), "{text}");
    assert!(text.contains("vision: replicas with no item in step 0 pass empty (idle) but take part in every transform and reduction: mb 1 on ranks 0-2,4-6;"), "{text}");
}

#[test]
fn bad_input_is_one_line_and_a_nonzero_exit() {
    let dir_tmp = temp("bad-input");
    let dir = dir_tmp.path();
    let good =
        std::fs::read_to_string(root().join("examples/colocated-cp-sp.toml")).expect("example");
    let cases = [
        (
            "cp = 2",
            "cp = 3",
            "modules.llm.parallel: tp(2) * cp(3) * pp(1) = 6 does not divide span [0, 8) of 8 ranks",
        ),
        ("global_batch = 16", "global_batch = 14", "is not divisible by modules.llm dp(2)"),
        ("sp = true", "sp = true\nspp = 1", "unknown field `spp`"),
    ];
    for (i, (from, to, want)) in cases.iter().enumerate() {
        let path = dir.join(format!("bad{i}.toml"));
        std::fs::write(&path, good.replacen(from, to, 1)).expect("write");
        let out = hetpar(&["layout", path.to_str().expect("utf-8 path")]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8(out.stderr).expect("utf-8");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.starts_with("error: ") && err.contains(want), "{err}");
        assert!(err.contains(&format!("bad{i}.toml")), "names the file: {err}");
    }
    let out = hetpar(&["layout", "no/such/file.toml"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.starts_with("error: cannot read config no/such/file.toml: "), "{err}");
    assert_eq!(err.lines().count(), 1);
    // A planner workload is named as one, with the command that makes a config of it.
    let workload = "examples/workloads/mm-1b-7b-8k.toml";
    for cmd in ["layout", "train"] {
        let out = hetpar(&[cmd, workload]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8(out.stderr).expect("utf-8");
        assert!(
            err.starts_with(&format!("error: {workload}: a planner workload ([workload])"))
                && err.contains(&format!("`hetpar plan {workload} --emit-config FILE`")),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1);
    }
}

/// A command line the parser refuses is one line too (INTERFACES.md), exit status 2, pointing
/// at the help of the command it got to.
#[test]
fn bad_command_lines_are_one_line() {
    for (args, want) in [
        (
            &["train", "--bogus"][..],
            "error: unexpected argument '--bogus' found (see hetpar train --help)",
        ),
        (
            &["bench", "train", "--nope"],
            "error: unexpected argument '--nope' found (see hetpar bench train --help)",
        ),
        (&["frob"], "error: unrecognized subcommand 'frob' (see hetpar --help)"),
        // With clap's "did you mean".
        (
            &["trian"],
            "error: unrecognized subcommand 'trian'; tip: a similar subcommand exists: 'train' (see hetpar --help)",
        ),
        (
            &["train", "--stpes", "3"],
            "error: unexpected argument '--stpes' found; tip: a similar argument exists: '--steps' (see hetpar train --help)",
        ),
        (
            &["layout"],
            "error: the following required arguments were not provided: <CONFIG> (see hetpar layout --help)",
        ),
        (
            &["plan", "w.toml", "--top", "abc"],
            "error: invalid value 'abc' for '--top <TOP>': invalid digit found in string (see hetpar plan --help)",
        ),
        (
            &["layout", "examples/demo.toml", "--json", "--programs"],
            "error: the argument '--json' cannot be used with '--programs' (see hetpar layout --help)",
        ),
    ] {
        let out = hetpar(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8(out.stderr).expect("utf-8");
        assert_eq!(err.trim_end(), want, "{args:?}");
    }
    let help = hetpar(&["bench", "--help"]);
    assert!(help.status.success());
    assert!(stdout(&help).contains("Examples:"), "bench --help has examples");
}

#[test]
fn help_shows_an_example() {
    let help = stdout(&hetpar(&["layout", "--help"]));
    assert!(help.contains("Examples:\n  hetpar layout examples/colocated-fanin.toml"), "{help}");
}

#[test]
fn schedule_text_of_the_two_encoder_islands() {
    let text = stdout(&hetpar(&["schedule", "examples/two-encoders-islands.toml"]));
    expect_file!["snapshots/schedule-two-encoders-islands.txt"].assert_eq(&text);
}

#[test]
fn schedule_for_every_example_with_an_svg() {
    let dir_tmp = temp("svg");
    let dir = dir_tmp.path();
    for example in examples() {
        // In a directory that is not there yet: made for it.
        let svg = dir.join(example.replace(['/', '.'], "-")).join("s.svg");
        let text = stdout(&hetpar(&["schedule", &example, "--svg", svg.to_str().expect("utf-8")]));
        assert!(text.contains("\nvalid: "), "{example}:\n{text}");
        let picture = std::fs::read_to_string(&svg).expect("svg written");
        assert!(
            picture.starts_with("<svg ") && picture.trim_end().ends_with("</svg>"),
            "{example}"
        );
    }
}

#[test]
fn bench_nn_times_the_linear_products_by_rows_in_the_format_compare_py_reads() {
    let text = stdout(&hetpar(&["bench", "nn", "--only", "linear", "--iters", "1"]));
    let line =
        text.lines().find(|l| l.starts_with("linear forward")).unwrap_or_else(|| panic!("{text}"));
    let (head, rates) = line.split_once(" GFLOP/s by rows: ").unwrap_or_else(|| panic!("{line}"));
    assert_eq!(head, "linear forward x @ w^T (w 704 x 512) f32,");
    assert_eq!(positive_by_label(rates, ": "), ["32", "64", "128", "256", "512"]);
    // The backward's two products, `dx/dw` at each row count.
    let line =
        text.lines().find(|l| l.starts_with("linear backward")).unwrap_or_else(|| panic!("{text}"));
    let (head, rates) =
        line.split_once(" GFLOP/s by rows (dx/dw): ").unwrap_or_else(|| panic!("{line}"));
    assert_eq!(head, "linear backward dx = dy w, dw = dy^T x (w 704 x 512) f32,");
    let rows: Vec<&str> = rates
        .split(", ")
        .map(|item| {
            let (rows, pair) = item.split_once(": ").unwrap_or_else(|| panic!("{item}"));
            let (dx, dw) = pair.split_once('/').unwrap_or_else(|| panic!("{item}"));
            for v in [dx, dw] {
                assert!(v.parse::<f64>().is_ok_and(|v| v > 0.0), "{item} in {line}");
            }
            rows
        })
        .collect();
    assert_eq!(rows, ["32", "64", "128", "256", "512"]);
    // The kernels it ran on, as the library picks them on this CPU.
    let kernels = format!(
        "kernels on this CPU: gemm's {} products, the fused kernels' loops on the {} path",
        hetpar_nn::kernels::gemm::path(),
        hetpar_nn::kernels::simd::path()
    );
    assert!(text.lines().any(|l| l == kernels), "{kernels}\n{text}");
    // Only the line asked for: no table header without table rows, no optimizer line.
    assert!(!text.contains("what (forward+backward)") && !text.contains("adamw"), "{text}");
}

/// The labels of a bench line's list `label<sep>value, ...`, each value asserted a positive
/// number.
fn positive_by_label<'a>(list: &'a str, sep: &str) -> Vec<&'a str> {
    list.split(", ")
        .map(|item| {
            let (label, value) = item.split_once(sep).unwrap_or_else(|| panic!("{item}"));
            assert!(value.parse::<f64>().is_ok_and(|v| v > 0.0), "{item} in {list}");
            label
        })
        .collect()
}

#[test]
fn bench_nn_times_the_attention_core_by_shape_in_the_format_compare_py_reads() {
    let text = stdout(&hetpar(&["bench", "nn", "--only", "attention", "--iters", "1"]));
    let line =
        text.lines().find(|l| l.starts_with("attention core")).unwrap_or_else(|| panic!("{text}"));
    let (head, times) = line.split_once(", ms by shape: ").unwrap_or_else(|| panic!("{line}"));
    assert_eq!(head, "attention core forward+backward f32");
    assert_eq!(positive_by_label(times, " "), ["4x196:6/6:64", "1x512:8/2:64c", "2x256:8/2:64c"]);
    assert!(!text.contains("what (forward+backward)") && !text.contains("adamw"), "{text}");
}

#[test]
fn bench_comm_runs_a_small_case() {
    let text =
        stdout(&hetpar(&["bench", "comm", "--ranks", "2", "--sizes-mib", "1", "--iters", "1"]));
    assert!(text.starts_with("memcpy, one thread, 256 MiB: "), "{text}");
    let copies = text.lines().nth(1).unwrap_or_default();
    let rates = copies
        .strip_prefix("copies of 1 MiB, GB/s per thread, one / two at once: memcpy ")
        .unwrap_or_else(|| panic!("{text}"));
    let numbers: Vec<f64> = rates.split([' ', '/', ',']).filter_map(|w| w.parse().ok()).collect();
    assert!(numbers.len() == 4 && numbers.iter().all(|&r| r > 0.0 && r.is_finite()), "{copies}");
    for op in ["all-reduce", "all-gather", "all-to-all-v", "send-recv"] {
        assert!(
            text.lines().any(|l| l.starts_with("local") && l.contains(op) && l.contains(" 2 ")),
            "{op}:\n{text}"
        );
    }
    // Sizes past the machine's memory and fewer than two ranks are refused before anything
    // runs.
    for (args, want) in [
        (["--ranks", "2", "--sizes-mib", "100000000"], "--sizes-mib 100000000 on 2 rank(s)"),
        (["--ranks", "0", "--sizes-mib", "1"], "--ranks must be at least 2"),
        (["--ranks", "1", "--sizes-mib", "1"], "--ranks must be at least 2 (got [1])"),
    ] {
        let out = hetpar(&[&["bench", "comm"][..], &args].concat());
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.code() == Some(1) && err.contains(want) && out.stdout.is_empty(),
            "{err}"
        );
    }
    let out = hetpar(&["bench", "comm", "--backend", "tcp"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: --backend \"tcp\": use local or mpi"
    );
    // NCCL is built, but training does not run on it yet: said so.
    let out = hetpar(&["train", "--backend", "nccl"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("the NCCL backend is built (feature nccl) and run by its GPU conformance check, not yet by training; use local or mpi"), "{err}");
}

/// `hetpar plan` text with the search's wall time masked.
fn plan_text(args: &[&str]) -> String {
    let text = stdout(&hetpar(args));
    text.lines()
        .map(|l| match l.find(" schedules in ") {
            Some(i) => format!("{} schedules in <time>", &l[..i]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

#[test]
fn plan_text_of_a_published_workload() {
    let text = plan_text(&["plan", "examples/workloads/mm-3b-14b-8k.toml", "--top", "2"]);
    expect_file!["snapshots/plan-mm-3b-14b-8k.txt"].assert_eq(&text);
}

/// An awkward GPU count is compared with the whole nodes below it: 33 GPUs plan slower than
/// 32 with one idle, which the explanation says; a round count with half of it. Islands that leave the LLM whole nodes are
/// searched: 31 GPUs plan an encoder island of 7 next to an LLM on 24 (they had no valid
/// layout).
#[test]
fn an_awkward_gpu_count_is_compared_with_fewer() {
    let wl = "examples/workloads/mm-1b-7b-8k.toml";
    let text = stdout(&hetpar(&["plan", wl, "--gpus", "33"]));
    assert!(text.contains("\non 32 of the 33 GPUs (1 idle) the best layout, "), "{text}");
    assert!(text.contains("on all of them: --gpus 32 plans it\n"), "{text}");
    let text = stdout(&hetpar(&["plan", wl, "--gpus", "31"]));
    assert!(text.contains("vision: tp1 cp1 dp7 pp1 on ranks 0..7 | llm: "), "{text}");
    assert!(text.contains(" on ranks 7..31 | "), "{text}");
    // A round count is compared with half of it, which is slower here.
    let text = stdout(&hetpar(&["plan", wl, "--gpus", "32"]));
    assert!(!text.contains(" idle) "), "{text}");
    // Past what a global batch of 4 can use: 1,024 of 2,048 GPUs take a shorter step
    // (512 do not).
    let wl = "examples/workloads/mm-1b-7b-64k.toml";
    let text = stdout(&hetpar(&["plan", wl, "--gpus", "2048"]));
    assert!(text.contains("\non 1024 of the 2048 GPUs (1024 idle) the best layout, "), "{text}");
    assert!(text.contains("on all of them: --gpus 1024 plans it\n"), "{text}");
}

/// A workload's `[cluster] gpus_per_node` replaces its hardware's node size: on nodes of
/// one GPU every collective crosses the network, and every kind of layout plans slower.
#[test]
fn a_workloads_gpus_per_node_replaces_the_hardwares() {
    let dir_tmp = temp("gpus-per-node");
    let dir = dir_tmp.path();
    let text = std::fs::read_to_string(root().join("examples/workloads/mm-1b-7b-8k.toml"))
        .expect("workload");
    assert_eq!(text.matches("hardware = \"h100\"").count(), 1, "the workload's [cluster] changed");
    let path = dir.join("one-gpu-nodes.toml");
    std::fs::write(
        &path,
        text.replacen("hardware = \"h100\"", "hardware = \"h100\"\ngpus_per_node = 1", 1),
    )
    .expect("write");
    let plan = |workload: &str| -> Vec<(String, f64)> {
        let v: Value =
            serde_json::from_str(&stdout(&hetpar(&["plan", workload, "--json"]))).expect("json");
        let candidates = v["candidates"].as_array().expect("candidates");
        candidates
            .iter()
            .map(|c| {
                (
                    c["kind"].as_str().expect("kind").to_string(),
                    c["step_time_s"].as_f64().expect("s"),
                )
            })
            .collect()
    };
    let (nodes_of_8, nodes_of_1) =
        (plan("examples/workloads/mm-1b-7b-8k.toml"), plan(path.to_str().expect("utf-8")));
    assert_eq!(nodes_of_8.len(), 3);
    for ((kind, fast), (other, slow)) in nodes_of_8.iter().zip(&nodes_of_1) {
        assert_eq!(kind, other);
        assert!(slow > fast, "{kind}: {slow} s on one-GPU nodes against {fast} s on H100 nodes");
    }
    // The table's header says the nodes the plan assumed, not only the hardware's.
    let text = stdout(&hetpar(&["plan", path.to_str().expect("utf-8")]));
    let header = text.lines().next().unwrap_or_default();
    assert!(header.contains("; here 1 per node, as the workload says)"), "{header}");
}

/// `plan --set` edits a workload as an edited file does (the same candidates), and a value
/// the workload refuses is named with the sets that made it, in one line.
#[test]
fn plan_set_overrides_a_workload_as_an_edited_file_does() {
    let tmp = temp("plan-set");
    let workload = "examples/workloads/mm-1b-7b-8k.toml";
    let text = std::fs::read_to_string(root().join(workload)).expect("workload");
    assert_eq!(text.matches("seq_len = 8192").count(), 1, "the workload's [workload] changed");
    let edited = tmp.path().join("16k.toml");
    std::fs::write(&edited, text.replacen("seq_len = 8192", "seq_len = 16384", 1)).expect("write");
    let candidates = |args: &[&str]| -> Value {
        let v: Value =
            serde_json::from_str(&stdout(&hetpar(&[&["plan"], args, &["--json"]].concat())))
                .expect("json");
        v["candidates"].clone()
    };
    let set = candidates(&[workload, "--set", "workload.seq_len=16384"]);
    assert_eq!(set, candidates(&[edited.to_str().expect("utf-8")]));
    assert_ne!(set, candidates(&[workload]));
    let out = hetpar(&["plan", workload, "--set", "workload.seq_len=0"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: {workload} with --set workload.seq_len=0: ")),
        "{err}"
    );
    // Refused before the search: a step past 2^32 tokens, and names an emitted config could
    // not carry.
    for (set, want) in [
        (
            "workload.global_batch=1048576",
            "workload.global_batch: global_batch(1048576) x seq_len(8192) = 8589934592 tokens a step is more than 4294967296",
        ),
        ("name=\"../up\"", "name: \"../up\" is not a name"),
        (
            "name=\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"",
            "name: 51 characters, more than 50",
        ),
    ] {
        let out = hetpar(&["plan", workload, "--set", set]);
        let err = String::from_utf8(out.stderr).expect("utf-8");
        assert!(out.status.code() == Some(1) && err.contains(want), "{set}: {err}");
    }
}

#[test]
fn plan_json_has_the_interface_fields_and_emits_a_config_layout_accepts() {
    let dir_tmp = temp("plan");
    let dir = dir_tmp.path();
    let cfg = dir.join("emitted.toml");
    let out = hetpar(&[
        "plan",
        "examples/workloads/mm-6b-gptoss120b.toml",
        "--json",
        "--emit-config",
        cfg.to_str().expect("utf-8"),
    ]);
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let candidates = v["candidates"].as_array().expect("candidates");
    let kinds: Vec<&str> = candidates.iter().map(|c| c["kind"].as_str().expect("kind")).collect();
    assert_eq!(kinds, ["homogeneous", "colocated", "non_colocated"]);
    for c in candidates {
        for key in ["step_time_s", "tflops_per_gpu", "tokens_per_s", "mem_gib_per_gpu"] {
            assert!(c[key].as_f64().expect(key) > 0.0, "{key}: {c}");
        }
        let modules = c["modules"].as_array().expect("modules");
        assert_eq!(modules.len(), 2);
        assert!(modules.iter().all(|m| m["tp"].as_u64().is_some() && m["ranks"].is_array()));
    }
    assert!(v["why"].as_array().is_some_and(|w| !w.is_empty()));
    let text = std::fs::read_to_string(&cfg).expect("emitted");
    assert!(text.starts_with("# Written by `hetpar plan`"), "{text}");
    // Its synthetic items fall short of the workload's, and it says so.
    assert!(text.contains("# Its synthetic data draws 0..="), "{text}");
    let layout = stdout(&hetpar(&["layout", cfg.to_str().expect("utf-8")]));
    assert!(layout.contains("llm"), "{layout}");
}

/// A homogeneous winner with the LLM pipelined: the prediction's encoders sit on the LLM's
/// first stage, which a config cannot say; the emitted file says what it does instead.
#[test]
fn an_emitted_homogeneous_config_says_where_its_encoders_differ() {
    let dir_tmp = temp("plan-homogeneous");
    let cfg = dir_tmp.path().join("emitted.toml");
    let workload = "examples/workloads/vision-audio-8b.toml";
    let path = cfg.to_str().expect("utf-8");
    let out = hetpar(&["plan", workload, "--gpus", "3", "--emit-config", path]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&cfg).expect("emitted");
    assert!(text.contains("the homogeneous candidate"), "{text}");
    assert!(
        text.contains("# The prediction places the encoders on the LLM's first pipeline stage")
            && text.contains("its layers split\n# over the LLM's 3 pipeline stages."),
        "{text}"
    );
    let layout = stdout(&hetpar(&["layout", path]));
    assert!(layout.contains("module vision (vit): ranks 0-2, tp1 cp1 dp1 pp3"), "{layout}");
}

#[test]
fn plan_reads_a_hardware_file() {
    // Llama 3 405B at 131K with CP 16 (published: 380 TFLOPS/GPU), planned with the built-in
    // factors and with examples/hardware/h100-ring-cp.toml (CP at the measured ring cost):
    // the file's factors reach the search, the rest take the built-in values.
    let tflops = |extra: &[&str]| {
        let mut args = vec!["plan", "examples/workloads/llama3-405b-131k.toml", "--json"];
        args.extend_from_slice(extra);
        let v: Value = serde_json::from_str(&stdout(&hetpar(&args))).expect("json");
        v["candidates"][0]["tflops_per_gpu"].as_f64().expect("tflops")
    };
    let built_in = tflops(&[]);
    let ring = tflops(&["--hardware", "examples/hardware/h100-ring-cp.toml"]);
    assert!(built_in < 190.0, "built-in factors: {built_in}");
    assert!((ring - 380.0).abs() / 380.0 <= 0.10, "measured ring cost: {ring}");
    // A workload naming a hardware file finds it next to itself.
    let dir_tmp = temp("hardware");
    let dir = dir_tmp.path();
    std::fs::copy(root().join("examples/hardware/h100-ring-cp.toml"), dir.join("ring.toml"))
        .expect("copy");
    let text = std::fs::read_to_string(root().join("examples/workloads/llama3-405b-131k.toml"))
        .expect("workload");
    let named = text.replace("hardware = \"h100\"", "hardware = \"ring.toml\"");
    assert_ne!(named, text);
    let workload = dir.join("workload.toml");
    std::fs::write(&workload, named).expect("write");
    let v: Value = serde_json::from_str(&stdout(&hetpar(&[
        "plan",
        workload.to_str().expect("utf-8"),
        "--json",
    ])))
    .expect("json");
    assert_eq!(v["candidates"][0]["tflops_per_gpu"].as_f64(), Some(ring));
    // A file with two tables is refused in one line that names them.
    let two = dir.join("two.toml");
    let table = |name: &str| {
        format!(
            "[{name}]\ndescription = \"x\"\npeak_tflops = 1.0\nmemory_gib = 1.0\nhbm_gbps = 1.0\ngpus_per_node = 1\nintra_node_gbps = 1.0\ninter_node_gbps = 1.0\nlatency_us = 1.0\n"
        )
    };
    std::fs::write(&two, table("a") + &table("b")).expect("write");
    let out = hetpar(&[
        "plan",
        "examples/workloads/gpt-1.7b.toml",
        "--hardware",
        two.to_str().expect("utf-8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("2 hardware tables (a, b); a hardware file holds one"), "{err}");
}

#[test]
fn plan_errors_are_one_line() {
    let out = hetpar(&["plan", "examples/workloads/mm-3b-70b-8k.toml", "--gpus", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("no layout of mm-3b-70b-8k fits 2 GPUs"), "{err}");
    let out = hetpar(&["plan", "examples/colocated-fanin.toml"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    // A training config is not a workload: said so, with what a workload holds.
    assert!(
        err.starts_with("error: examples/colocated-fanin.toml: a training config ([train]), where hetpar plan takes a workload: "),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // Each refusal names the field that holds the number it names.
    let wl = "examples/workloads/vision-audio-8b.toml";
    for (set, want) in [
        (
            "workload.seq_len=1024",
            "modules.audio: an item's rows (a clip's frames after the stride-2 stem) must be at least 1 and fewer than seq_len(1024), got 1500",
        ),
        ("modules.llm.token_fraction=0.2", "modules.llm.token_fraction: 0.2: an encoder's share"),
        ("train.lr=1", "with --set train.lr=1: unknown table `[train]`, expected one of"),
    ] {
        let out = hetpar(&["plan", wl, "--set", set]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.code() == Some(1) && err.contains(want), "{set}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

#[test]
fn calibrate_writes_a_spec_that_plan_reads_as_local() {
    let dir_tmp = temp("calibrate");
    let dir = dir_tmp.path();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hetpar"))
            .args(args)
            .current_dir(dir)
            .output()
            .expect("hetpar runs")
    };
    let workload = root().join("examples/workloads/gpt-1.7b.toml");
    let workload = workload.to_str().expect("utf-8");
    let before = run(&["plan", workload, "--hardware", "local"]);
    assert!(String::from_utf8_lossy(&before.stderr).contains("run `hetpar calibrate`"));
    let spec = stdout(&run(&["calibrate", "--iters", "1"]));
    let table = hetpar_plan::hardware::parse(&spec).expect("a hardware table");
    let local = &table["local"];
    assert!(local.peak_tflops > 0.0 && local.hbm_gbps > 0.0 && local.intra_node_gbps > 0.0);
    // A 1.7B model at TP1 PP1 pinned does not fit a CPU core's share of memory: the planner
    // says so instead of inventing a layout.
    let out = run(&["plan", workload, "--hardware", "local", "--gpus", "48"]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success() || err.contains("no layout"), "{err}");
}

/// A directory of one test's own, removed with everything in it when the value drops (a
/// failing test's too, as it unwinds).
fn temp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("hetpar-cli-{name}-")).tempdir().expect("temp dir")
}

/// A tokenizer replaced at the same path (the config unchanged) is refused by a resume, by
/// eval and by export: each checkpoint records the SHA-256 of the tokenizer its run read.
#[test]
fn a_tokenizer_replaced_at_the_same_path_is_refused() {
    let dir = temp("tokenizer-in-place");
    let (set, out) = (dir.path().join("set"), dir.path().join("out"));
    let (set_s, out_s) = (set.to_str().expect("utf-8"), out.to_str().expect("utf-8"));
    let made = hetpar(&["data", "synth", "--out", set_s, "--samples", "40"]);
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let path = format!("data.path={:?}", set.join("train.json").display().to_string());
    let data = ["--set", "data.source=\"llava\"", "--set", &path];
    let run = hetpar(&[&["train", "--steps", "2", "--out", out_s][..], &data].concat());
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoints/step-00000002/manifest.json"))
            .expect("manifest"),
    )
    .expect("json");
    let tokenizer = set.join("tokenizer.json");
    let (sha, _) = hetpar_runtime::checkpoint::sha256(&tokenizer).expect("sha");
    assert_eq!(manifest["tokenizer_sha256"], Value::from(sha.clone()), "{manifest}");
    // The same file name, other bytes.
    let vocab = hetpar_data::chat::Vocab::train(&["another text".to_string()], 300).expect("bpe");
    vocab.save(&tokenizer).expect("save");
    let resume = ["train", "--steps", "3", "--out", out_s, "--resume", "auto"];
    let resumed = hetpar(&[&resume[..], &data].concat());
    let err = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(
        resumed.status.code() == Some(1)
            && err.contains("is not the one the checkpoint was trained with")
            && err.contains(&format!("SHA-256 {}... when saved", &sha[..16])),
        "{err}"
    );
    let eval = hetpar(&["eval", out_s, "--data", set_s]);
    let err = String::from_utf8_lossy(&eval.stderr).to_string();
    assert!(
        !eval.status.success() && err.contains(&format!("SHA-256 {}... when saved", &sha[..16])),
        "{err}"
    );
    // So is an export, which would ship that tokenizer with the model, and writes nothing.
    let hf = dir.path().join("hf");
    let export = hetpar(&["export", out_s, "--hf", hf.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&export.stderr).to_string();
    assert!(
        export.status.code() == Some(1)
            && err.contains("is not the one the checkpoint was trained with")
            && err.contains(&format!("SHA-256 {}... when saved", &sha[..16])),
        "{err}"
    );
    assert!(!hf.exists());
}

/// The bare `hetpar train` trains on files: the synth set generated once into the cache, held-out loss and
/// answer accuracy before the first step, every --eval-every steps and after the last, the
/// data wait of each step, the two pictures; `hetpar eval` of the checkpoint finds what
/// the last evaluation found.
#[test]
fn train_on_the_synth_set_evaluates_held_out_answers_and_eval_agrees() {
    let out_dir_tmp = temp("synth");
    let out_dir = out_dir_tmp.path();
    let out = out_dir.to_str().expect("utf-8");
    let args = ["train", "--steps", "4", "--eval-every", "2"];
    let run = hetpar(&[&args[..], &["--out", out, "--set", "data.samples=60"]].concat());
    let text = stdout(&run);
    assert!(run.status.success(), "{text}{}", String::from_utf8_lossy(&run.stderr));
    let generated = text
        .lines()
        .find_map(|l| l.strip_prefix("generating the synthetic dataset (60 samples) into "))
        .expect("the set is generated on first use");
    assert!(text.contains("54 records") && text.contains("6 records"), "{text}");
    let evals: Vec<&str> = text.lines().filter(|l| l.starts_with("held-out after ")).collect();
    assert_eq!(evals.len(), 3, "{text}");
    assert!(evals[2].starts_with("held-out after 4 steps: loss "), "{text}");
    assert!(text.contains("pictures: "), "{text}");
    for svg in ["loss.svg", "time.svg"] {
        let picture = std::fs::read_to_string(out_dir.join(svg)).expect("svg");
        assert!(picture.starts_with("<svg ") && picture.trim_end().ends_with("</svg>"), "{svg}");
    }
    let metrics = std::fs::read_to_string(out_dir.join("metrics.jsonl")).expect("metrics");
    let lines: Vec<Value> =
        metrics.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    let held: Vec<&Value> = lines.iter().filter(|l| l.get("heldout").is_some()).collect();
    let at: Vec<u64> = held.iter().map(|l| l["step"].as_u64().expect("step")).collect();
    assert_eq!(at, [0, 2, 4]);
    let (first, last) = (&held[0]["heldout"], &held[2]["heldout"]);
    assert!(last["loss"].as_f64() < first["loss"].as_f64(), "{first} -> {last}");
    for kind in ["image", "audio"] {
        assert!(last["by_kind"][kind]["answers"].as_u64() > Some(0), "{kind}: {last}");
    }
    let steps: Vec<&Value> = lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(steps.len(), 4);
    assert!(steps.iter().all(|s| s["data_wait_s"].as_f64() >= Some(0.0)), "{metrics}");
    // Each rank's peak of what it holds: all three ranks hold parameters.
    for s in &steps {
        let peaks = s["rank_peak_bytes"].as_array().expect("per rank");
        assert!(peaks.len() == 3 && peaks.iter().all(|p| p.as_u64() > Some(0)), "{s}");
    }
    // TensorBoard's event file, next to metrics.jsonl (its format is tested in the binary).
    let events: Vec<_> = std::fs::read_dir(out_dir)
        .expect("out")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("events.out.tfevents."))
        .collect();
    assert_eq!(events.len(), 1);
    assert!(events[0].metadata().expect("meta").len() > 100);
    assert!(text.contains("TensorBoard events: "), "{text}");
    // The same checkpoint, evaluated on its own: the same numbers, whatever learning rate
    // a `--set` gives (noted on stderr, away from the JSON).
    let lr = ["--set", "train.lr=0.5"];
    let eval =
        hetpar(&[&["eval", out, "--data", generated, "--json", "--show", "2"][..], &lr].concat());
    let e: Value = serde_json::from_str(&stdout(&eval)).expect("json");
    let err = String::from_utf8_lossy(&eval.stderr);
    assert!(err.contains("note: --set train.lr has no effect on an evaluation"), "{err}");
    // The first two answers, as text and ids, with what greedy decoding emits.
    let shown = e["answers"].as_array().expect("answers");
    assert_eq!(shown.len(), 2, "{e}");
    for x in shown {
        let text = x["expected"].as_str().expect("text");
        assert!(text.ends_with("<|end|>"), "{x}");
        assert_eq!(
            x["expected_ids"].as_array().map(Vec::len),
            x["top_ids"].as_array().map(Vec::len)
        );
        assert!(x["greedy"].is_string() && x["right"].is_boolean(), "{x}");
    }
    let plain = stdout(&hetpar(&["eval", out, "--data", generated, "--show", "3"]));
    assert!(plain.contains("\nthe first 3 of "), "{plain}");
    // Without --data: the run's own held-out records, the same numbers.
    let own = stdout(&hetpar(&["eval", out, "--show", "3"]));
    let at = |t: &str| t.split_once(": ").map(|(_, r)| r.to_string()).expect("a result");
    assert_eq!(at(&own), at(&plain), "{own}");
    assert!(own.contains(&format!(" on {generated}/heldout.json: ")), "{own}");
    assert_eq!(plain.lines().filter(|l| l.starts_with("  ") && l.contains("\"")).count(), 3);
    assert_eq!(e["step"], 4);
    for key in ["loss", "answer_accuracy", "token_accuracy", "targets", "by_kind"] {
        assert_eq!(e[key], last[key], "{key}: {e} vs {last}");
    }
    // The export carries the run's tokenizer next to the LLM, loadable as the data's own.
    let hf = out_dir.join("hf");
    let exp = hetpar(&["export", out, "--hf", hf.to_str().expect("utf-8")]);
    assert!(stdout(&exp).contains("tokenizer: "), "{}", stdout(&exp));
    let tok = hf.join("llm").join("tokenizer.json");
    let theirs = PathBuf::from(generated).join("tokenizer.json");
    assert_eq!(std::fs::read(&tok).expect("tokenizer"), std::fs::read(&theirs).expect("data's"));
    let vocab = hetpar_data::chat::Vocab::load(&tok).expect("loads");
    assert_eq!(vocab.id("<|end|>"), Some(4));
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(hf.join("llm").join("tokenizer_config.json")).expect("config"),
    )
    .expect("json");
    assert_eq!(cfg["eos_token"], "<|end|>");
    let template = cfg["chat_template"].as_str().expect("template");
    assert!(template.contains("<|assistant|>") && template.contains("'gpt'"), "{template}");
    // The vision tower's image processor: hetpar's pixels, as SigLIP's processor says them.
    let processor: Value = serde_json::from_str(
        &std::fs::read_to_string(hf.join("vision").join("preprocessor_config.json"))
            .expect("preprocessor_config.json"),
    )
    .expect("json");
    assert_eq!(processor["size"], serde_json::json!({"height": 32, "width": 32}));
    assert_eq!(
        (&processor["image_mean"], &processor["resample"]),
        (&serde_json::json!([0.5, 0.5, 0.5]), &Value::from(3))
    );
    // The audio tower's directory loads as HF's WhisperEncoder on its own: the checkpoint's
    // tensors bit for bit without their `audio_tower.` prefix (the projector's as they
    // are), Whisper's fixed positions as hetpar's table, and a feature extractor for the
    // encoder's 128 frames (1.28 s: `clip_samples`, `chunk_length` rounded up).
    let audio = hf.join("audio");
    let cpu = &candle_core::Device::Cpu;
    let exported = candle_core::safetensors::load(audio.join("model.safetensors"), cpu)
        .expect("the audio tower's weights");
    let ckpt = out_dir.join("checkpoints").join("step-00000004");
    let saved = candle_core::safetensors::load(ckpt.join("audio.stage0.safetensors"), cpu)
        .expect("the checkpoint's audio tower");
    assert_eq!(exported.len(), saved.keys().filter(|k| !k.contains(':')).count() + 1);
    assert!(exported.contains_key("conv1.weight") && exported.contains_key("layer_norm.bias"));
    let bits = |t: &candle_core::Tensor| {
        let v: Vec<f32> = t.flatten_all().expect("flat").to_vec1().expect("f32");
        v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    for (k, t) in &exported {
        let want = match k.as_str() {
            "embed_positions.weight" => {
                let d = t.dims();
                assert_eq!(d[0], 64, "{k}: one position per row of a clip");
                hetpar_nn::models::audio::sinusoids(64, d[1], candle_core::DType::F32)
                    .expect("table")
            }
            _ => saved
                .get(&format!("audio_tower.{k}"))
                .or_else(|| k.starts_with("audio_projector.").then(|| &saved[k]))
                .unwrap_or_else(|| panic!("{k} is not the checkpoint's"))
                .clone(),
        };
        assert_eq!(bits(t), bits(&want), "{k}");
    }
    let features: Value = serde_json::from_str(
        &std::fs::read_to_string(audio.join("preprocessor_config.json")).expect("features"),
    )
    .expect("json");
    assert_eq!(features["feature_extractor_type"], "WhisperFeatureExtractor");
    assert_eq!(
        [&features["clip_samples"], &features["chunk_length"], &features["feature_size"]],
        [&Value::from(20480), &Value::from(2), &Value::from(16)]
    );
    // Generation stops at <|end|> and pads with <|pad|>: in the model's config and its
    // generation config (HF's Llama defaults would name <|user|> and <|assistant|>).
    for name in ["config.json", "generation_config.json"] {
        let c: Value =
            serde_json::from_str(&std::fs::read_to_string(hf.join("llm").join(name)).expect(name))
                .expect("json");
        assert_eq!((&c["eos_token_id"], &c["pad_token_id"]), (&Value::from(4), &Value::from(0)));
        assert!(c["bos_token_id"].is_null(), "{name}: {c}");
    }
    // A clip that does not decode is named, as training names it, though it is read on
    // the audio encoder's rank alone (not rank 0's report that the rank failed).
    let broken = out_dir.join("broken-clip");
    let records: Value = serde_json::from_str(
        &std::fs::read_to_string(Path::new(generated).join("heldout.json")).expect("heldout"),
    )
    .expect("json");
    let mut first_clip = None;
    for r in records.as_array().expect("records") {
        for key in ["image", "audio"] {
            let files = match &r[key] {
                Value::String(f) => vec![f.as_str()],
                Value::Array(fs) => fs.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            for f in files {
                let to = broken.join(f);
                std::fs::create_dir_all(to.parent().expect("parent")).expect("media dir");
                std::fs::copy(Path::new(generated).join(f), &to).expect("media");
                if key == "audio" && first_clip.is_none() {
                    first_clip = Some(to);
                }
            }
        }
    }
    for f in ["heldout.json", "tokenizer.json"] {
        std::fs::copy(Path::new(generated).join(f), broken.join(f)).expect("copy");
    }
    let clip = first_clip.expect("a held-out record with a clip");
    std::fs::write(&clip, b"RIFF\0\0\0\0WAVE").expect("a clip cut short");
    let failed = hetpar(&["eval", out, "--data", broken.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&failed.stderr).to_string();
    assert!(
        !failed.status.success()
            && err.contains("error: data: ")
            && err.contains(&clip.display().to_string()),
        "{err}"
    );
    // A data directory that is not there is named.
    let missing = hetpar(&["eval", out, "--data", "/nonexistent/set"]);
    let err = String::from_utf8_lossy(&missing.stderr).to_string();
    assert!(!missing.status.success() && err.contains("/nonexistent/set"), "{err}");
    // A records file named bare, from its own directory (its parent is the empty path):
    // that directory is the one its tokenizer and media are in.
    let bare = command(&["eval", out, "--data", "heldout.json"])
        .current_dir(generated)
        .output()
        .expect("hetpar runs");
    let err = String::from_utf8_lossy(&bare.stderr).to_string();
    assert!(bare.status.success() && stdout(&bare).contains("on heldout.json: loss "), "{err}");
    // The same records next to another tokenizer: refused, naming both (its ids would not
    // mean what the model learned).
    let other = out_dir.join("other-tokenizer");
    std::fs::create_dir_all(&other).expect("dir");
    std::fs::copy(theirs.with_file_name("heldout.json"), other.join("heldout.json")).expect("copy");
    let texts = ["another tokenizer's text".to_string()];
    let vocab = hetpar_data::chat::Vocab::train(&texts, 300).expect("vocab");
    vocab.save(&other.join("tokenizer.json")).expect("save");
    let refused = hetpar(&["eval", out, "--data", other.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        !refused.status.success()
            && err.contains("is not the one the checkpoint was trained with")
            && err.contains(&theirs.display().to_string()),
        "{err}"
    );
    // Training on from the checkpoint with that tokenizer is refused the same way.
    std::fs::copy(theirs.with_file_name("train.json"), other.join("train.json")).expect("copy");
    let path = format!("data.path={:?}", other.join("train.json").display().to_string());
    let args = ["train", "--steps", "5", "--out", out, "--resume", "auto"];
    let resumed =
        hetpar(&[&args[..], &["--set", "data.source=\"llava\"", "--set", &path]].concat());
    let err = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(
        resumed.status.code() == Some(1)
            && err.contains("this run's tokenizer")
            && err.contains("is not the one the checkpoint was trained with"),
        "{err}"
    );
    // An eval --set the checkpoint's config refuses is named alone (not with the data keys
    // eval sets itself).
    let bad = hetpar(&["eval", out, "--data", generated, "--set", "train.global_batch=3"]);
    let err = String::from_utf8_lossy(&bad.stderr).to_string();
    assert!(
        err.contains("config.toml with --set train.global_batch=3: train.global_batch: "),
        "{err}"
    );
    // So is a synth set of another seed, which the resume generates before it checks.
    let args = ["train", "--steps", "5", "--out", out, "--resume", "auto", "--set"];
    let resumed = hetpar(&[&args[..], &["data.samples=60", "--set", "train.seed=7"]].concat());
    let err = String::from_utf8_lossy(&resumed.stderr).to_string();
    assert!(
        resumed.status.code() == Some(1)
            && err.contains("-n60-seed7/tokenizer.json is not the one the checkpoint was trained"),
        "{err}"
    );
    // The checkpoint's config, edited: eval, export and a resume all refuse it by name (it
    // would train, score or export another model's settings under the checkpoint's name);
    // an edit of the same length by its SHA-256, a longer one by its length.
    let config = ckpt.join("config.toml");
    let text = std::fs::read_to_string(&config).expect("config");
    assert_eq!(text.matches("dtype = \"f32\"").count(), 1, "{text}");
    std::fs::write(&config, text.replacen("dtype = \"f32\"", "dtype = \"f64\"", 1)).expect("edit");
    let refused = hetpar(&["eval", out, "--data", generated]);
    let err = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        err.contains("config.toml: SHA-256 ") && err.contains(" where the manifest says "),
        "{err}"
    );
    std::fs::write(&config, text.replacen("seq_len = ", "seq_len = 1", 1)).expect("edit");
    let hf2 = out_dir.join("hf2");
    for args in [
        vec!["eval", out, "--data", generated],
        vec!["export", out, "--hf", hf2.to_str().expect("utf-8")],
        vec!["train", "--steps", "5", "--out", out, "--resume", "auto"],
    ] {
        let refused = hetpar(&args);
        let err = String::from_utf8_lossy(&refused.stderr).to_string();
        assert!(
            refused.status.code() == Some(1)
                && err.contains("config.toml: ")
                && err.contains("bytes where the manifest says")
                && err.trim_end().ends_with("it was edited or is corrupt"),
            "{args:?}: {err}"
        );
    }
    // An export of a run without a tokenizer (in-process tokens) into the same directory
    // removes the earlier export's tokenizer files, which would describe other tokens.
    let mem = out_dir.join("in-memory");
    let mem_s = mem.to_str().expect("utf-8");
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "1", "--out", mem_s]));
    let again = hetpar(&["export", mem_s, "--hf", hf.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&again.stderr).to_string();
    assert!(stdout(&again).contains("no tokenizer"), "{err}");
    let files =
        "tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json";
    assert!(err.contains(&format!("note: removed an earlier export's {files} from")), "{err}");
    assert!(!tok.exists());
    // A directory holding other files (a dataset, whose audio/ bears a module's name) is
    // refused before anything is written there.
    let (_set, set_dir) = synth_set("export-into-a-set");
    let into = hetpar(&["export", mem_s, "--hf", set_dir.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&into.stderr).to_string();
    assert_eq!(into.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "holds what an export of this checkpoint's modules (audio, llm, vision) does not write: audio/"
        ),
        "{err}"
    );
    assert!(!set_dir.join("llm").exists());
}

/// An f64 run's checkpoint evaluates in f64, as the run evaluated its held-out set: the
/// same numbers to the last bit; and its saved config says f64 and trains as the run did.
#[test]
fn an_f64_runs_checkpoint_evaluates_and_its_config_trains_in_f64() {
    let out_dir_tmp = temp("synth-f64");
    let out_dir = out_dir_tmp.path();
    let out = out_dir.to_str().expect("utf-8");
    let args = ["train", "--steps", "1", "--dtype", "f64", "--out", out];
    // 50 samples: a set of its own in the cache (the synth test generates the 60-sample one
    // and expects to be first).
    let text = stdout(&hetpar(&[&args[..], &["--set", "data.samples=50"]].concat()));
    let data = text
        .lines()
        .find_map(|l| l.strip_prefix("data ")?.strip_suffix("/train.json: 45 records"))
        .unwrap_or_else(|| panic!("no training records line in {text}"));
    let last = metrics(out_dir)
        .into_iter()
        .rfind(|l| l.get("heldout").is_some())
        .expect("a held-out evaluation")["heldout"]
        .clone();
    let e: Value = serde_json::from_str(&stdout(&hetpar(&["eval", out, "--data", data, "--json"])))
        .expect("json");
    for key in ["loss", "answer_accuracy", "token_accuracy", "targets"] {
        assert_eq!(e[key], last[key], "{key}: {e} vs {last}");
    }
    // The same set under a name that Rust's debug quoting and TOML's spell differently (a
    // combining accent, as macOS writes é in file names).
    let accented = out_dir.join("de\u{301}");
    std::os::unix::fs::symlink(data, &accented).expect("symlink");
    let again = hetpar(&["eval", out, "--data", accented.to_str().expect("utf-8"), "--json"]);
    let again: Value = serde_json::from_str(&stdout(&again)).expect("json");
    assert_eq!(again["loss"], e["loss"], "{again}");
    let saved = out_dir.join("config.toml");
    let config = std::fs::read_to_string(&saved).expect("config.toml");
    assert!(config.contains("dtype = \"f64\""), "{config}");
    let again = out_dir.join("again");
    let text = stdout(&hetpar(&[
        "train",
        saved.to_str().expect("utf-8"),
        "--steps",
        "1",
        "--out",
        again.to_str().expect("utf-8"),
    ]));
    assert!(text.contains(" backend, F64, "), "{text}");
    let first_loss = |dir: &Path| {
        metrics(dir).iter().find_map(|v| v.get("loss")?.as_f64()).expect("a step's loss")
    };
    assert_eq!(first_loss(out_dir).to_bits(), first_loss(&again).to_bits());
}

#[test]
fn train_writes_metrics_and_the_loss_falls() {
    let out_dir_tmp = temp("train");
    let out_dir = out_dir_tmp.path();
    let (config, out) = ("examples/in-memory.toml", out_dir.to_str().expect("utf-8"));
    let out = hetpar(&["train", config, "--steps", "12", "--out", out]);
    let text = stdout(&out);
    // Three rank threads share this machine's threads, each taking its share.
    let share = hetpar_nn::kernels::share_of(3);
    let threads = if share == 1 { "1 thread".to_string() } else { format!("{share} threads") };
    let head = format!(
        "training in-memory on 3 ranks (local backend, F32, {threads} per rank) for 12 steps"
    );
    assert!(text.contains(&head), "{text}");
    let summary = text.lines().find(|l| l.starts_with("in-memory: loss")).expect("a summary");
    assert!(text.lines().last().expect("lines").starts_with("checkpoint committed: "), "{text}");
    assert!(summary.contains("over 12 steps"), "{summary}");
    assert!(text.contains("time on rank 0 by action: backward "), "{text}");
    assert!(text.contains("boundary bytes per step (all ranks): vision -> llm "), "{text}");
    // Without a terminal the progress is one line per step on stderr.
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.lines().any(|l| l.starts_with("step 12/12  loss ")), "{err}");
    // A line per step, then the final checkpoint's.
    let (saves, steps): (Vec<Value>, Vec<Value>) =
        metrics(out_dir).into_iter().partition(|v| v.get("checkpoint").is_some());
    assert_eq!(steps.len(), 12);
    assert_eq!(saves.len(), 1, "{saves:?}");
    assert_eq!(saves[0]["step"], 12, "{saves:?}");
    for s in &steps {
        for key in ["step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "step_s"] {
            assert!(s.get(key).is_some(), "{key} in {s}");
        }
        for m in ["vision", "audio", "llm"] {
            assert!(s["module_grad_norms"][m].as_f64().expect("norm") > 0.0, "{m} in {s}");
        }
        for kind in ["forward", "backward", "boundary", "reduce", "optimizer"] {
            assert!(s["seconds"][kind].as_f64().expect("seconds") >= 0.0, "{kind} in {s}");
        }
        for e in ["vision -> llm", "audio -> llm"] {
            let fwd = s["boundary_bytes"][e]["forward"].as_u64().expect("bytes");
            assert_eq!(Some(fwd), s["boundary_bytes"][e]["backward"].as_u64(), "{e} in {s}");
        }
    }
    let loss = |i: usize| steps[i]["loss"].as_f64().expect("loss");
    assert!(loss(11) < loss(0) - 1.0, "the loss falls: {} -> {}", loss(0), loss(11));
    let resolved = std::fs::read_to_string(out_dir.join("config.toml")).expect("config");
    assert!(resolved.contains("name = \"in-memory\""), "{resolved}");
    // The run's checkpoint exports to HF directories, one per module.
    let hf = out_dir.join("hf");
    let out =
        hetpar(&["export", out_dir.to_str().expect("utf-8"), "--hf", hf.to_str().expect("utf-8")]);
    let text = stdout(&out);
    assert!(text.contains("llm: LlamaForCausalLM"), "{text}");
    for m in ["vision", "audio", "llm"] {
        assert!(hf.join(m).join("model.safetensors").is_file(), "{m}");
        let c: Value = serde_json::from_str(
            &std::fs::read_to_string(hf.join(m).join("config.json")).expect("config.json"),
        )
        .expect("json");
        assert!(c["architectures"][0].is_string(), "{m}: {c}");
    }
}

#[test]
fn train_refuses_what_it_cannot_run_in_one_line() {
    let too_many = (hetpar_layout::graph::MAX_SIZE + 1).to_string();
    for (args, said) in [
        (&["--steps", "1", "--dtype", "f16"][..], "--dtype \"f16\": use f32, f64 or bf16"),
        // Before, these aborted allocating the run's records of their steps.
        (&["--steps", &too_many], "--steps: 16777217 is more than 16777216"),
        (&["--set", &format!("train.steps={too_many}")], "train.steps: 16777217 is more than"),
    ] {
        let out = hetpar(&[&["train", "examples/in-memory.toml"][..], args].concat());
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8(out.stderr).expect("utf-8");
        assert!(err.starts_with("error: ") && err.contains(said), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}

/// `dtype = "bf16"` trains f32 weights with bf16 products: its losses leave f32's at bf16's
/// rounding (not at f32's), and its layout still matches the one-rank reference that
/// multiplies the same way.
#[test]
fn bf16_multiplies_in_bf16_and_keeps_parity() {
    let dir_tmp = temp("train-bf16");
    let dir = dir_tmp.path();
    let demo = std::fs::read_to_string(root().join("examples/in-memory.toml")).expect("demo");
    let path = dir.join("bf16.toml");
    std::fs::write(&path, demo.replacen("lr = 3e-3", "lr = 3e-3\ndtype = \"bf16\"", 1))
        .expect("write");
    let check = |args: &[&str]| -> Value {
        let mut all = vec!["check", path.to_str().expect("utf-8"), "--steps", "2", "--json"];
        all.extend(args);
        let out = hetpar(&all);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str(&stdout(&out)).expect("json")
    };
    // Parity runs in f32 unless asked otherwise, whatever the config trains in, and says so.
    let (bf16, f32) = (check(&["--dtype", "bf16"]), check(&[]));
    let noted = hetpar(&["check", path.to_str().expect("utf-8"), "--steps", "1"]);
    let err = String::from_utf8(noted.stderr).expect("utf-8");
    assert!(err.contains("trains in bf16; check compares in f32 (--dtype bf16"), "{err}");
    assert_eq!(bf16["dtype"], "bf16", "{bf16}");
    assert_eq!(f32["dtype"], "f32", "{f32}");
    assert_eq!(bf16["pass"], Value::Bool(true), "{bf16}");
    let loss = |v: &Value| v["steps"][1]["loss"].as_f64().expect("loss");
    let moved = (loss(&bf16) - loss(&f32)).abs() / loss(&f32);
    assert!(moved > 1e-6 && moved < 1e-2, "bf16 {bf16} against f32 {f32}");
    // `--dtype bf16` on an f32 config: the run says so, and its saved config (which resume
    // and `hetpar eval` read) says bf16.
    let out_dir = dir.join("run");
    let out = out_dir.to_str().expect("utf-8");
    let run = hetpar(&[
        "train",
        "examples/in-memory.toml",
        "--steps",
        "1",
        "--dtype",
        "bf16",
        "--out",
        out,
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    // The kernel named is this machine's (AMX-BF16 tiles, AVX512-BF16 or the fallback).
    let kernel = hetpar_nn::kernels::bf16::kernel();
    assert!(
        stdout(&run).contains(&format!("(local backend, bf16 products ({kernel}), f32 weights, ")),
        "{}",
        stdout(&run)
    );
    let saved = std::fs::read_to_string(out_dir.join("config.toml")).expect("config.toml");
    assert!(saved.contains("dtype = \"bf16\""), "{saved}");
}

/// The demo with its colocated vision encoder offloaded: the gradients and optimizer state
/// sit on the host during the LLM phase, the losses are bitwise those without offload, and
/// every module's collective and resident bytes are in metrics.jsonl.
#[test]
fn train_offloads_a_colocated_encoder() {
    let dir_tmp = temp("train-offload");
    let dir = dir_tmp.path();
    let demo = std::fs::read_to_string(root().join("examples/in-memory.toml")).expect("demo");
    assert_eq!(demo.matches("tp = 1").count(), 1, "the vision layout is the one tp = 1");
    let path = dir.join("offload.toml");
    std::fs::write(&path, demo.replacen("tp = 1", "tp = 1\noffload = true", 1)).expect("write");
    let steps_of = |config: &str, out: &str| -> Vec<Value> {
        let out_dir = dir.join(out);
        let args = ["train", config, "--steps", "2", "--out", out_dir.to_str().expect("utf-8")];
        let run = hetpar(&args);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        // The steps' lines (not the checkpoint's).
        metrics(&out_dir).into_iter().filter(|v| v.get("checkpoint").is_none()).collect()
    };
    let demo_path = root().join("examples/in-memory.toml");
    let plain = steps_of(demo_path.to_str().expect("utf-8"), "plain");
    let off = steps_of(path.to_str().expect("utf-8"), "off");
    for (a, b) in plain.iter().zip(&off) {
        assert_eq!(a["loss"], b["loss"]);
        let host = |s: &Value, m: &str| s["resident_bytes"][m]["host"].as_u64().expect("bytes");
        let llm_phase =
            |s: &Value, m: &str| s["resident_bytes"][m]["llm_phase"].as_u64().expect("bytes");
        assert_eq!(host(a, "vision"), 0);
        assert!(host(b, "vision") > 0, "{b}");
        assert_eq!(llm_phase(a, "vision") - llm_phase(b, "vision"), host(b, "vision"), "{b}");
        for m in ["vision", "audio", "llm"] {
            assert!(b["collective_bytes"][m].as_u64().is_some(), "{m} in {b}");
        }
        // The LLM at tp2 with SP moves activations inside every layer.
        assert!(b["collective_bytes"]["llm"].as_u64() > Some(0), "{b}");
        // Model FLOPs per module and MFU against the measured peak.
        let mfu = b["mfu"].as_f64().expect("mfu");
        assert!(mfu > 0.0 && mfu < 1.0, "{b}");
        assert!(b["model_flops"]["llm"].as_f64() > b["model_flops"]["vision"].as_f64(), "{b}");
    }
}

#[test]
fn check_passes_every_example_in_f32_and_f64() {
    for dtype in ["f32", "f64"] {
        for ex in examples() {
            let out = hetpar(&["check", &ex, "--dtype", dtype, "--json"]);
            let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
            assert_eq!(v["pass"], Value::Bool(true), "{ex} {dtype}: {v}");
            let steps = v["steps"].as_array().expect("steps");
            assert_eq!(steps.len(), 3, "{ex}");
            for key in ["step", "loss", "ref_loss", "grad_norm", "ref_grad_norm"] {
                assert!(steps[0].get(key).is_some(), "{key} in {v}");
            }
            let tol = if dtype == "f64" { 1e-10 } else { 1e-5 };
            assert!(v["max_loss_rel_diff"].as_f64().expect("diff") <= tol, "{ex}: {v}");
            assert!(v["max_grad_norm_rel_diff"].as_f64().expect("diff") <= tol, "{ex}: {v}");
            assert_eq!(v["reference_ranks"], 1, "{ex}");
        }
    }
}

#[test]
fn check_fails_past_the_tolerance_naming_the_differences() {
    // f32 rounding of another layout (a few 1e-9 here) is past a tolerance of 1e-12.
    let out = hetpar(&["check", "examples/colocated-fanin.toml", "--steps", "1", "--tol", "1e-12"]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).expect("utf-8");
    assert!(text.contains("FAIL: largest relative difference"), "{text}");
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.starts_with("error: parity fails: the relative difference "), "{err}");
    // Only what exceeds the tolerance is named: at 0 a loss that agrees to the bit is not.
    let out = hetpar(&["check", "examples/in-memory.toml", "--steps", "2", "--tol", "0"]);
    let err = String::from_utf8(out.stderr).expect("utf-8");
    let said = err.lines().last().unwrap_or_default();
    assert!(said.starts_with("error: parity fails: the relative difference "), "{err}");
    assert!(said.ends_with(" exceeds 0e0"), "{err}");
    assert!(!said.contains("0.00e0 in"), "{err}");
}

/// A reference must train the same model on the same data with the same settings (its
/// layout aside): one with another seed or another model is refused, naming what differs,
/// rather than compared into a failure that reads as a layout bug.
#[test]
fn check_refuses_a_reference_of_another_model_or_seed() {
    let dir_tmp = temp("check-reference");
    let dir = dir_tmp.path();
    let cfg = std::fs::read_to_string(root().join("examples/colocated-fanin.toml")).expect("cfg");
    let other = dir.join("other-seed.toml");
    std::fs::write(&other, cfg.replacen("seed = 1234", "seed = 99", 1)).expect("write");
    let check = |reference: &str| {
        let out = hetpar(&["check", "examples/colocated-fanin.toml", "--reference", reference]);
        assert_eq!(out.status.code(), Some(1));
        assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
        String::from_utf8(out.stderr).expect("utf-8")
    };
    let err = check(other.to_str().expect("utf-8"));
    assert!(err.contains("it differs in train.seed 1234 here, 99 in the reference\n"), "{err}");
    let err = check("examples/demo.toml");
    assert!(
        err.contains(
            "modules.audio only in the reference; modules.llm.ffn 256 here, 192 in the reference;"
        ),
        "{err}"
    );
    // Another layout of the same training, in one microbatch a step, is a reference.
    let layout = dir.join("other-layout.toml");
    let text =
        cfg.replacen("microbatches = 2", "microbatches = 1", 1).replacen("tp = 8", "tp = 4", 1);
    std::fs::write(&layout, text).expect("write");
    let args = ["check", "examples/colocated-fanin.toml", "--steps", "1", "--reference"];
    let out = hetpar(&[&args[..], &[layout.to_str().expect("utf-8")]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `bench train` measures every rank and simulates the schedule with what it measured;
/// `bench executor` finds the executor and the plain loop bitwise equal.
#[test]
fn bench_train_and_executor_report_what_they_measure() {
    let out = hetpar(&["bench", "train", "--steps", "1", "--warmup", "0", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let ranks = v["ranks"].as_array().expect("ranks");
    assert_eq!(ranks.len(), 3, "{v}");
    for r in ranks {
        let idle = r["idle"].as_f64().expect("idle");
        let predicted = r["predicted_idle"].as_f64().expect("predicted");
        assert!((0.0..1.0).contains(&idle) && (0.0..1.0).contains(&predicted), "{r}");
        assert!(r["seconds"]["forward"].as_f64() > Some(0.0), "{r}");
    }
    let bubble = v["predicted_bubble"].as_f64().expect("bubble");
    assert!(bubble > 0.0 && bubble < 1.0, "{v}");
    let out = hetpar(&["bench", "executor", "--steps", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout(&out).contains("losses and norms bitwise equal"), "{}", stdout(&out));
}

/// `bench plans` times every rank's plans and each rank's share on the demo (both
/// strategies of its edges) and checks each share, or times the shares alone
/// (`--shares-only`); ranks outside the world are refused.
#[test]
fn bench_plans_times_and_checks_each_ranks_share() {
    let out = hetpar(&["bench", "plans", "--steps", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = stdout(&out);
    assert!(text.contains("vision -> llm exact, audio -> llm leaders"), "{text}");
    assert!(text.contains("op for op (3 ranks x 2 steps)"), "{text}");
    let steps: Vec<&str> = text.lines().filter(|l| l.starts_with("   ")).collect();
    assert_eq!(steps.len(), 2, "{text}");
    // Without every rank's plans: the same steps and rows, no whole time, no comparison.
    let out = hetpar(&["bench", "plans", "--steps", "2", "--shares-only"]);
    let shares = stdout(&out);
    let alone: Vec<&str> = shares.lines().filter(|l| l.starts_with("   ")).collect();
    let columns = |l: &str| l.split_whitespace().take(3).map(str::to_string).collect::<Vec<_>>();
    for (a, s) in alone.iter().zip(&steps) {
        assert_eq!(columns(a)[..2], columns(s)[..2], "{shares}");
        assert_eq!(columns(a)[2], "-", "{shares}");
    }
    assert_eq!(alone.len(), 2, "{shares}");
    assert!(shares.contains("the shares were not compared") && !shares.contains("op for op"));
    let out = hetpar(&["bench", "plans", "--ranks", "0,3"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rank 3 is outside the config's world of 3 ranks"), "{err}");
}

/// `--set` overrides a config value before validation on train, check, layout and
/// schedule; a bad one is a one-line error naming it.
#[test]
fn set_overrides_config_values_everywhere() {
    let demo = root().join("examples/in-memory.toml");
    let demo = demo.to_str().expect("utf-8");
    let out = hetpar(&["layout", demo, "--json", "--set", "modules.llm.parallel.tp=1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let llm = v["modules"].as_array().expect("modules").iter().find(|m| m["name"] == "llm");
    assert_eq!(llm.expect("llm")["tp"], 1, "{v}");
    let out = hetpar(&["schedule", demo, "--set", "train.microbatches=4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let args = ["check", demo, "--steps", "1", "--json", "--set", "modules.vision.trainable=false"];
    let out = hetpar(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_str(&stdout(&out)).expect("json");
    assert_eq!(v["pass"], true, "{v}");
    let out = hetpar(&["train", "--steps", "1", "--set", "modules.llm.parallel.tp=3"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("with --set modules.llm.parallel.tp=3") && err.contains("tp(3)"), "{err}");
}

/// A run's metrics.jsonl, a value per line.
fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect()
}

/// Losses per step of a run's metrics.jsonl, in file order (its checkpoint lines left out).
/// The names in directory `d`, sorted.
fn entries(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap_or_else(|e| panic!("{}: {e}", d.display()))
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn losses(out: &Path) -> Vec<(u64, f64)> {
    metrics(out)
        .iter()
        .filter(|v| v.get("checkpoint").is_none())
        .map(|v| (v["step"].as_u64().expect("step"), v["loss"].as_f64().expect("loss")))
        .collect()
}

/// Starts `hetpar train` on the in-memory example for `steps` steps into `out` and waits until its
/// metrics hold `lines` steps.
fn start_training(out: &Path, steps: &str, extra: &[&str], lines: usize) -> std::process::Child {
    start_training_to(out, (steps, extra, lines), std::process::Stdio::null())
}

/// [`start_training`] with its stderr sent to `stderr`.
fn start_training_to(
    out: &Path,
    (steps, extra, lines): (&str, &[&str], usize),
    stderr: std::process::Stdio,
) -> std::process::Child {
    let mut args =
        vec!["train", IN_MEMORY, "--steps", steps, "--out", out.to_str().expect("utf-8")];
    args.extend(extra);
    let child = Command::new(env!("CARGO_BIN_EXE_hetpar"))
        .args(&args)
        .current_dir(root())
        .stdout(std::process::Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("hetpar starts");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |t| t.lines().count())
        < lines
    {
        assert!(start.elapsed().as_secs() < 120, "training never reached {lines} steps");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}

/// A second signal while the run finishes its step after the first ends it at once, exit
/// 130, saying so on stderr.
#[test]
fn a_second_signal_stops_at_once_and_says_so() {
    let tmp = temp("second-signal");
    let out = tmp.path().join("run");
    let slow = ["--set", "modules.llm.layers=40"];
    let child = start_training_to(&out, ("100000", &slow, 2), std::process::Stdio::piped());
    // Each of the model's steps takes some 100 ms or more; the second signal comes well
    // inside the step the first lets finish.
    let pid = child.id().to_string();
    for _ in 0..2 {
        assert!(Command::new("kill").args(["-INT", &pid]).status().expect("kill").success());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let done = child.wait_with_output().expect("exits");
    let err = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(130), "{err}");
    assert!(
        err.contains(
            "error: a second signal: stopping at once, without committing a checkpoint (exit 130)"
        ),
        "{err}"
    );
}

/// The in-memory example trained 4 steps into `TMP/run`, a checkpoint after steps 2 and 4.
fn four_steps_saved(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = temp(name);
    let out = tmp.path().join("run");
    let out_s = out.to_str().expect("utf-8");
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "4", "--save-every", "2", "--out", out_s]));
    (tmp, out)
}

/// `--resume auto` of [`four_steps_saved`]'s run, to 6 steps.
fn resume_to_six(out: &Path) -> Output {
    let out = out.to_str().expect("utf-8");
    hetpar(&["train", IN_MEMORY, "--steps", "6", "--out", out, "--resume", "auto"])
}

/// A run resumed from a checkpoint kept elsewhere in its own `--out` (not under its
/// `checkpoints/`) starts its metrics with the steps before it, read from the earlier run it
/// moves aside, with `--out` given relative to where the command runs as well.
#[test]
fn a_resume_from_a_copy_kept_in_a_relative_out_keeps_its_history() {
    let tmp = temp("relative-history");
    let config = root().join(IN_MEMORY);
    let train = |args: &[&str]| {
        let done = Command::new(env!("CARGO_BIN_EXE_hetpar"))
            .args([&["train", config.to_str().expect("utf-8")][..], args].concat())
            .current_dir(tmp.path())
            .output()
            .expect("hetpar runs");
        stdout(&done);
    };
    train(&["--steps", "4", "--save-every", "2", "--out", "b"]);
    let (from, kept) =
        (tmp.path().join("b/checkpoints/step-00000002"), tmp.path().join("b/keep/step-00000002"));
    std::fs::create_dir_all(&kept).expect("keep");
    for e in std::fs::read_dir(&from).expect("step 2").flatten() {
        std::fs::copy(e.path(), kept.join(e.file_name())).expect("copied");
    }
    train(&["--steps", "3", "--out", "b", "--resume", "b/keep/step-00000002"]);
    let lines = metrics(&tmp.path().join("b"));
    let steps: Vec<u64> = lines
        .iter()
        .filter(|v| v.get("loss").is_some())
        .map(|v| v["step"].as_u64().expect("step"))
        .collect();
    assert_eq!(steps, [0, 1, 2], "{lines:?}");
    assert!(tmp.path().join("b/earlier-1/metrics.jsonl").is_file());
}

/// A run into a relative `--out` names its checkpoints in `metrics.jsonl` by absolute
/// paths, and so does the earlier run a second one moves aside: each line names a
/// checkpoint that is there, from wherever the metrics are read.
#[test]
fn metrics_name_checkpoints_by_absolute_paths() {
    let tmp = temp("relative-out");
    let config = root().join(IN_MEMORY);
    let train = || {
        let done = Command::new(env!("CARGO_BIN_EXE_hetpar"))
            .args(["train", config.to_str().expect("utf-8"), "--steps", "2", "--out", "run"])
            .current_dir(tmp.path())
            .output()
            .expect("hetpar runs");
        stdout(&done);
    };
    train();
    train();
    for metrics in ["run/metrics.jsonl", "run/earlier-1/metrics.jsonl"] {
        let lines = std::fs::read_to_string(tmp.path().join(metrics)).expect("metrics");
        let dirs: Vec<PathBuf> = lines
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| v["checkpoint"]["dir"].as_str().map(PathBuf::from))
            .collect();
        assert_eq!(dirs.len(), 1, "{metrics}: {lines}");
        assert!(dirs[0].is_absolute() && dirs[0].join("manifest.json").is_file(), "{dirs:?}");
    }
}

/// A checkpoint named by its manifest or by its directory's `latest` is taken for itself;
/// a path that is not there, or another file, is named as what it is; a `latest` removed
/// beside committed checkpoints gets a note naming the one taken.
#[test]
fn checkpoint_paths_are_taken_for_what_they_name() {
    let (tmp, out) = four_steps_saved("paths");
    let root = out.join("checkpoints");
    let export = |ckpt: &Path, to: &str| {
        let hf = tmp.path().join(to);
        hetpar(&["export", ckpt.to_str().expect("utf-8"), "--hf", hf.to_str().expect("utf-8")])
    };
    for (ckpt, step) in
        [(root.join("latest"), 4), (root.join("step-00000002").join("manifest.json"), 2)]
    {
        let text = stdout(&export(&ckpt, &format!("hf{step}")));
        let dir = root.join(format!("step-{step:08}"));
        assert!(text.contains(&format!("exported {} to ", dir.display())), "{text}");
    }
    for (ckpt, says) in [
        (tmp.path().join("nowhere"), "no such file or directory"),
        (out.join("config.toml"), "a file, not a checkpoint"),
    ] {
        let err = String::from_utf8_lossy(&export(&ckpt, "hf-none").stderr).to_string();
        assert!(err.contains(&format!("{}: {says}", ckpt.display())), "{err}");
    }
    std::fs::remove_file(root.join("latest")).expect("removed");
    let done = export(&out, "hf-newest");
    let err = String::from_utf8_lossy(&done.stderr).to_string();
    let newest = root.join("step-00000004");
    assert!(stdout(&done).contains(&format!("exported {} to ", newest.display())), "{err}");
    assert!(
        err.contains(&format!("is missing (removed, or a crash before it was written); the newest committed checkpoint is {}", newest.display())),
        "{err}"
    );
    // A `latest` that is not text, or not a file, names no checkpoint either (a FIFO's
    // read would wait for a writer).
    let latest = root.join("latest");
    for (to, says) in [
        (
            "hf-bytes",
            "names \"\u{fffd}\u{fffd}\\0\", which is not the name of a checkpoint in this directory",
        ),
        ("hf-fifo", "is a FIFO, not a regular file"),
    ] {
        let _ = std::fs::remove_file(&latest);
        match to {
            "hf-fifo" => mkfifo(&latest),
            _ => std::fs::write(&latest, [0xff, 0xfe, 0]).expect("latest"),
        }
        let hf = tmp.path().join(to);
        let out_s = out.to_str().expect("utf-8");
        let done = hetpar_within(60, &["export", out_s, "--hf", hf.to_str().expect("utf-8")]);
        let err = String::from_utf8_lossy(&done.stderr).to_string();
        assert!(stdout(&done).contains(&format!("exported {} to ", newest.display())), "{err}");
        let note = format!("; the newest committed one is {}", newest.display());
        assert!(err.contains(&format!("{} {says}{note}", latest.display())), "{err}");
    }
}

/// A checkpoint's file replaced by something that is not a file is refused at once, naming
/// it, by a resume and by `export`: a link to `/dev/zero` in a tensor file's place (which
/// was hashed without end) or in the config's (read whole into memory without end), and a
/// FIFO (whose open waits for a writer).
#[test]
fn a_device_or_a_fifo_in_a_checkpoint_files_place_is_refused_at_once() {
    let (tmp, out) = four_steps_saved("device-in-checkpoint");
    let step4 = out.join("checkpoints").join("step-00000004");
    let (out_s, step4_s) = (out.to_str().expect("utf-8"), step4.to_str().expect("utf-8"));
    let hf = tmp.path().join("hf");
    for (file, swap, says) in [
        ("llm.stage0.safetensors", "/dev/zero", "a character device, not a regular file"),
        ("llm.stage0.safetensors", "fifo", "a FIFO, not a regular file"),
        ("config.toml", "/dev/zero", "a character device, not a regular file"),
        ("config.toml", "fifo", "a FIFO, not a regular file"),
    ] {
        let path = step4.join(file);
        let kept = tmp.path().join("kept");
        std::fs::rename(&path, &kept).expect("set aside");
        match swap {
            "fifo" => mkfifo(&path),
            device => std::os::unix::fs::symlink(device, &path).expect("link"),
        }
        let resume = ["train", IN_MEMORY, "--steps", "6", "--out", out_s, "--resume", step4_s];
        let export = ["export", step4_s, "--hf", hf.to_str().expect("utf-8")];
        for args in [&resume[..], &export[..]] {
            let done = hetpar_within(60, args);
            let err = String::from_utf8_lossy(&done.stderr).to_string();
            assert!(!done.status.success(), "{args:?}: {err}");
            assert!(err.contains(&format!("{}: {says}", path.display())), "{args:?}: {err}");
        }
        std::fs::remove_file(&path).expect("removed");
        std::fs::rename(&kept, &path).expect("put back");
    }
    assert!(!out.join("earlier-1").exists());
}

/// Names a run writes under `--out` that are taken by something of another kind are
/// refused before the run trains: a file called `checkpoints` (the run trained to its
/// first checkpoint and failed there), and `metrics.jsonl` a link to `/dev/full` (read
/// without end when the run went on from it).
#[test]
fn run_files_of_the_wrong_kind_are_refused_before_training() {
    let tmp = temp("wrong-kind");
    for (name, make, says) in [
        (
            "checkpoints",
            "file",
            "is a regular file, where the run keeps its checkpoints in a directory of that name",
        ),
        (
            "metrics.jsonl",
            "/dev/full",
            "is a character device, where the run keeps a file of that name",
        ),
        ("loss.svg", "dir", "is a directory, where the run keeps a file of that name"),
    ] {
        let out = tmp.path().join(name.replace('.', "-"));
        std::fs::create_dir_all(&out).expect("out");
        let path = out.join(name);
        match make {
            "file" => std::fs::write(&path, "x").expect("file"),
            "dir" => std::fs::create_dir(&path).expect("dir"),
            device => std::os::unix::fs::symlink(device, &path).expect("link"),
        }
        let done = hetpar_within(
            60,
            &["train", IN_MEMORY, "--steps", "2", "--out", out.to_str().expect("utf-8")],
        );
        let err = String::from_utf8_lossy(&done.stderr).to_string();
        assert!(!done.status.success(), "{err}");
        assert!(err.contains(&format!("{}: {} {says}", out.display(), path.display())), "{err}");
        assert!(!String::from_utf8_lossy(&done.stdout).contains("step 1"), "{err}");
    }
}

/// A config, workload or hardware file named on the command line is read up to a limit
/// far above any real one: `/dev/zero` in its place is refused, not read into memory
/// without end.
#[test]
fn an_endless_config_is_refused_at_the_limit() {
    for args in [&["layout", "/dev/zero"][..], &["plan", "/dev/zero"][..]] {
        let done = hetpar_within(60, args);
        let err = String::from_utf8_lossy(&done.stderr).to_string();
        assert!(!done.status.success());
        assert!(
            err.contains("it (a character device) holds more than 16777216 bytes"),
            "{args:?}: {err}"
        );
    }
}

/// Cuts the file at `path` to half its length.
fn cut_short(path: &Path) {
    let len = std::fs::metadata(path).expect("a file").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(len / 2))
        .expect("cut short");
}

/// A checkpoint directory renamed for another step than its manifest's is refused by a
/// resume before anything moves: the run would take it for a later checkpoint, move it
/// aside as a branch past the step it goes on from, and then fail to find it.
#[test]
fn a_checkpoint_renamed_for_another_step_is_refused_before_anything_moves() {
    let (_tmp, out) = four_steps_saved("renamed-step");
    let root = out.join("checkpoints");
    std::fs::rename(root.join("step-00000004"), root.join("step-00000010")).expect("renamed");
    std::fs::write(root.join("latest"), "step-00000010").expect("latest");
    let done = resume_to_six(&out);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success());
    assert!(
        err.contains(
            "it is the checkpoint after step 4, but its directory is named for step 10: rename the directory step-00000004"
        ),
        "{err}"
    );
    assert!(root.join("step-00000010").join("manifest.json").is_file());
    assert!(!out.join("earlier-1").exists());
}

/// A resume refused by the checkpoint's checksums (a tensor file cut short) writes nothing
/// under `--out`: not the new config, not metrics, not another TensorBoard event file.
#[test]
fn a_resume_refused_by_its_checksums_writes_nothing() {
    let (_tmp, out) = four_steps_saved("refused-resume");
    let tensors = out.join("checkpoints").join("step-00000004").join("llm.stage0.safetensors");
    cut_short(&tensors);
    let snapshot = || {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&out)
            .expect("out")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.is_file())
            .map(|p| (p.display().to_string(), std::fs::read(&p).expect("read")))
            .collect();
        files.sort();
        files
    };
    let before = snapshot();
    let done = resume_to_six(&out);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success());
    assert!(err.contains("llm.stage0.safetensors"), "{err}");
    assert!(snapshot() == before, "{err}");
}

/// A resume refused by its checksums moves nothing aside: not the checkpoints past the step
/// it goes back to, not an earlier run under another `--out` it starts from. (The moves wait
/// for the run's first line, once the checkpoint is loaded.)
#[test]
fn a_resume_refused_by_its_checksums_moves_nothing_aside() {
    let (tmp, out) = four_steps_saved("refused-aside");
    let step2 = out.join("checkpoints").join("step-00000002");
    let tensors = step2.join("llm.stage0.safetensors");
    cut_short(&tensors);
    let other = tmp.path().join("other");
    let other_s = other.to_str().expect("utf-8");
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "1", "--out", other_s]));
    let metrics = std::fs::read(other.join("metrics.jsonl")).expect("metrics");
    for into in [&out, &other] {
        let done = hetpar(&[
            "train",
            IN_MEMORY,
            "--steps",
            "6",
            "--out",
            into.to_str().expect("utf-8"),
            "--resume",
            step2.to_str().expect("utf-8"),
        ]);
        let err = String::from_utf8_lossy(&done.stderr);
        assert!(!done.status.success());
        assert!(err.contains("llm.stage0.safetensors"), "{err}");
        assert!(!into.join("earlier-1").exists(), "{err}");
    }
    assert!(out.join("checkpoints").join("step-00000004").join("manifest.json").is_file());
    assert_eq!(std::fs::read(other.join("metrics.jsonl")).expect("kept"), metrics);
}

/// An `--out` that is a file (with or without a trailing slash), lies under one, or is a
/// link to nothing is refused before the run says anything.
#[test]
fn an_out_that_is_a_file_is_refused_at_once() {
    let tmp = temp("out-file");
    let file = tmp.path().join("notes.txt");
    std::fs::write(&file, "mine").expect("a file");
    let slash = PathBuf::from(format!("{}/", file.display()));
    for out in [file.clone(), file.join("run"), slash] {
        let done =
            hetpar(&["train", IN_MEMORY, "--steps", "1", "--out", out.to_str().expect("utf-8")]);
        let err = String::from_utf8_lossy(&done.stderr);
        assert!(!done.status.success());
        assert!(err.contains(&format!("{} is not a directory", file.display())), "{err}");
        assert!(done.stdout.is_empty(), "{}", String::from_utf8_lossy(&done.stdout));
    }
    assert_eq!(std::fs::read_to_string(&file).expect("kept"), "mine");
    let dangling = tmp.path().join("gone");
    std::os::unix::fs::symlink(tmp.path().join("nowhere"), &dangling).expect("a link");
    let done = hetpar(&["train", IN_MEMORY, "--out", dangling.to_str().expect("utf-8")]);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(err.contains(&format!("{} is a link to nothing", dangling.display())), "{err}");
}

/// A signal before the first step, once the run has said what it trains (so the handler is
/// in place), stops a fresh run before it moves the earlier run under `--out` aside or
/// writes anything there.
#[test]
fn a_signal_before_the_first_step_leaves_the_earlier_run_in_place() {
    use std::io::BufRead;
    let tmp = temp("early-signal");
    let out = tmp.path().join("run");
    let out_s = out.to_str().expect("utf-8");
    let listing = || {
        let mut names: Vec<_> = std::fs::read_dir(&out)
            .expect("out")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    // The signal comes during the matmul peak's measurement, some 0.2 s between the
    // description and the move; a test process slow enough to miss it lets the run move
    // the earlier one (and says so), and is tried again on a fresh earlier run.
    for _ in 0..3 {
        let _ = std::fs::remove_dir_all(&out);
        stdout(&hetpar(&["train", IN_MEMORY, "--steps", "2", "--out", out_s]));
        let before = listing();
        let metrics = std::fs::read(out.join("metrics.jsonl")).expect("metrics");
        let mut child = Command::new(env!("CARGO_BIN_EXE_hetpar"))
            .args(["train", IN_MEMORY, "--steps", "2", "--out", out_s])
            .current_dir(root())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("hetpar starts");
        let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut said = String::new();
        for line in lines.by_ref() {
            let line = line.expect("utf-8");
            said += &line;
            said.push('\n');
            if line.starts_with("resolved config") {
                let pid = child.id().to_string();
                assert!(
                    Command::new("kill").args(["-INT", &pid]).status().expect("kill").success()
                );
                break;
            }
        }
        said.extend(lines.map(|l| l.expect("utf-8") + "\n"));
        let done = child.wait_with_output().expect("exits");
        let err = String::from_utf8_lossy(&done.stderr);
        if said.contains("held an earlier run; moved it") {
            // Too late: try again.
            continue;
        }
        assert_eq!(done.status.code(), Some(1), "{said}{err}");
        assert!(
            err.contains(&format!(
                "stopped by a signal before the first step began; nothing under {out_s} was moved or written"
            )),
            "{err}"
        );
        assert_eq!(listing(), before);
        assert_eq!(std::fs::read(out.join("metrics.jsonl")).expect("metrics"), metrics);
        return;
    }
    panic!("three runs moved the earlier run before the signal reached them");
}

/// SIGTERM mid-run: every rank finishes its step, a checkpoint is committed and the run
/// exits cleanly; `--resume auto` then reproduces the uninterrupted run's losses exactly,
/// with no step in metrics.jsonl twice.
#[test]
fn sigterm_commits_a_checkpoint_and_resume_auto_reproduces_the_run() {
    let (full_tmp, cut_tmp) = (temp("sigterm-full"), temp("sigterm-cut"));
    let (full, cut) = (full_tmp.path(), cut_tmp.path());
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "40", "--out", full.to_str().expect("utf-8")]));
    let mut child = start_training(cut, "40", &[], 2);
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let status = child.wait().expect("exits");
    assert!(status.success(), "a stop by SIGTERM is clean: {status}");
    let stopped = losses(cut).len();
    assert!(stopped < 40, "the signal came after the run ended");
    let out = hetpar(&[
        "train",
        IN_MEMORY,
        "--steps",
        "40",
        "--out",
        cut.to_str().expect("utf-8"),
        "--resume",
        "auto",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains(&format!("resuming from {}", cut.join("checkpoints").display())),
        "{text}"
    );
    assert!(text.contains(&format!("{stopped} of 40 steps done")), "{text}");
    let (a, b) = (losses(full), losses(cut));
    assert_eq!(b.iter().map(|x| x.0).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.1.to_bits(), y.1.to_bits(), "step {}: {} vs {}", x.0, x.1, y.1);
    }
    // Each save has its line, the one resumed from kept: after the stop, then at the end,
    // each with the bytes its manifest lists for the tensor files.
    let saves: Vec<Value> =
        metrics(cut).into_iter().filter(|v| v.get("checkpoint").is_some()).collect();
    let steps: Vec<u64> = saves.iter().map(|v| v["step"].as_u64().expect("step")).collect();
    assert_eq!(steps, vec![stopped as u64, 40], "{saves:?}");
    let last = &saves[1]["checkpoint"];
    let dir = PathBuf::from(last["dir"].as_str().expect("dir"));
    assert_eq!(dir, cut.join("checkpoints").join("step-00000040"));
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    let tensors: Vec<&Value> = manifest["files"]
        .as_array()
        .expect("files")
        .iter()
        .filter(|f| f["file"].as_str().is_some_and(|n| n.ends_with(".safetensors")))
        .collect();
    assert_eq!(last["files"].as_u64(), Some(tensors.len() as u64), "{last}");
    let bytes: u64 = tensors.iter().map(|f| f["bytes"].as_u64().expect("bytes")).sum();
    assert_eq!(last["bytes"].as_u64(), Some(bytes), "{last}");
    assert!(last["seconds"].as_f64().is_some_and(|s| s > 0.0), "{last}");
    assert!(
        text.contains(&format!("checkpoint after step 40 committed: {} (", dir.display())),
        "{text}"
    );
}

/// SIGKILL while training with a checkpoint every step: whatever it interrupted, `latest`
/// names a committed checkpoint and `--resume auto` goes on from it; `--resume auto` with
/// nothing saved starts fresh and says so; `--resume DIR` that does not exist is an error.
#[test]
fn a_killed_run_resumes_from_its_last_committed_checkpoint() {
    let dir_tmp = temp("sigkill");
    let dir = dir_tmp.path();
    let mut child = start_training(dir, "60", &["--save-every", "1", "--keep", "2"], 3);
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    let ckpts = dir.join("checkpoints");
    let name = std::fs::read_to_string(ckpts.join("latest")).expect("latest");
    assert!(ckpts.join(name.trim()).join("manifest.json").is_file(), "{name}");
    let kept = std::fs::read_dir(&ckpts)
        .expect("checkpoints")
        .filter(|e| e.as_ref().expect("entry").file_name().to_string_lossy().starts_with("step-"))
        .count();
    assert!(kept <= 3, "--keep 2 (plus one being replaced): {kept}");
    let args = [
        "train",
        IN_MEMORY,
        "--steps",
        "60",
        "--out",
        dir.to_str().expect("utf-8"),
        "--resume",
        "auto",
    ];
    let text = stdout(&hetpar(&args));
    assert!(text.contains("resuming from "), "{text}");
    let steps: Vec<u64> = losses(dir).iter().map(|x| x.0).collect();
    assert_eq!(steps, (0..60).collect::<Vec<_>>());

    let fresh_tmp = temp("resume-fresh");
    let fresh = fresh_tmp.path();
    let args = [
        "train",
        IN_MEMORY,
        "--steps",
        "1",
        "--out",
        fresh.to_str().expect("utf-8"),
        "--resume",
        "auto",
    ];
    let text = stdout(&hetpar(&args));
    assert!(text.contains("--resume auto: no committed checkpoint under"), "{text}");
    assert!(text.contains("starting fresh"), "{text}");
    let out =
        hetpar(&["train", IN_MEMORY, "--steps", "1", "--resume", "/nonexistent/step-00000003"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(
        err.contains("--resume /nonexistent/step-00000003: no such file or directory"),
        "{err}"
    );
}

/// A resume under a config that differs from the checkpoint's says which keys changed,
/// with both values; under the same config it says nothing of the kind.
#[test]
fn a_resume_names_the_config_keys_that_changed() {
    let tmp = temp("resume-changes");
    let out = tmp.path().to_str().expect("utf-8");
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "1", "--out", out]));
    let resume = |steps: &str| {
        let args = ["train", IN_MEMORY, "--steps", steps, "--out", out, "--resume", "auto"];
        stdout(&hetpar(
            &[&args[..], &["--set", "train.lr=1e-4", "--set", "train.warmup=0"]].concat(),
        ))
    };
    let text = resume("2");
    assert!(
        text.contains("note: this run's config differs from the checkpoint's in 2 keys: train.lr 0.003 -> 0.0001; train.warmup 5 -> 0\n"),
        "{text}"
    );
    let text = resume("3");
    assert!(text.contains("resuming from ") && !text.contains("differs"), "{text}");
}

/// A fresh run into an `--out` that holds an earlier run moves that run to `earlier-N`
/// whole (checkpoints, metrics, config, event files), so their checkpoints never mix: the
/// fresh run's `--keep 1` keeps its own, and `--resume auto` and `eval` take its latest.
/// A `--resume` of a run directory whose `latest` names no checkpoint says which it took.
#[test]
fn a_fresh_run_moves_an_earlier_run_aside() {
    let tmp = temp("earlier");
    let dir = tmp.path();
    let out = dir.to_str().expect("utf-8");
    let train = |steps: &str| {
        stdout(&hetpar(&["train", IN_MEMORY, "--steps", steps, "--out", out, "--keep", "1"]))
    };
    assert!(!train("3").contains("earlier run"));
    let text = train("1");
    let earlier = dir.join("earlier-1");
    assert!(
        text.contains(&format!(
            "note: {out} held an earlier run; moved it to {} so that",
            earlier.display()
        )),
        "{text}"
    );
    let steps = |d: &Path| -> Vec<String> {
        entries(&d.join("checkpoints")).into_iter().filter(|n| n.starts_with("step-")).collect()
    };
    assert_eq!(steps(dir), ["step-00000001"]);
    assert_eq!(steps(&earlier), ["step-00000003"]);
    assert_eq!(losses(&earlier).len(), 3);
    assert_eq!(losses(dir).len(), 1);
    for d in [dir, earlier.as_path()] {
        assert!(d.join("config.toml").is_file(), "{}", d.display());
        let events = std::fs::read_dir(d)
            .expect("out")
            .filter(|e| {
                e.as_ref().expect("entry").file_name().to_string_lossy().starts_with("events.out")
            })
            .count();
        assert_eq!(events, 1, "{}", d.display());
    }
    assert!(train("1").contains("moved it to"));
    assert!(dir.join("earlier-2/checkpoints/step-00000001/manifest.json").is_file());
    // The earlier run is a run directory: a resume takes its latest, and names what its
    // `latest` file named where that is not a checkpoint.
    std::fs::write(earlier.join("checkpoints/latest"), "step-00000009").expect("latest");
    let args = ["train", IN_MEMORY, "--steps", "4", "--out", out, "--resume"];
    let text = stdout(&hetpar(&[&args[..], &[earlier.to_str().expect("utf-8")]].concat()));
    assert!(
        text.contains("names \"step-00000009\", which is not a committed checkpoint")
            && text.contains("resuming from "),
        "{text}"
    );
    // Going on from another run's checkpoint, the run moves the one in --out aside too, and
    // its metrics go on from the other run's.
    assert!(text.contains("moved it to") && text.contains("this run goes on from"), "{text}");
    assert_eq!(steps(dir), ["step-00000004"]);
    assert_eq!(steps(&dir.join("earlier-3")), ["step-00000001"]);
    let kept: Vec<u64> = losses(dir).iter().map(|l| l.0).collect();
    assert_eq!(kept, [0, 1, 2, 3]);
    // A moved run's metrics name its checkpoints where they now are.
    let dirs: Vec<String> = metrics(&earlier)
        .iter()
        .filter_map(|v| v.pointer("/checkpoint/dir").and_then(Value::as_str).map(String::from))
        .collect();
    assert_eq!(dirs, [earlier.join("checkpoints/step-00000003").display().to_string()]);
    // With no checkpoint of its own, `--resume auto` names the newest moved run that has.
    std::fs::remove_dir_all(dir.join("checkpoints")).expect("removed");
    let args = ["train", IN_MEMORY, "--steps", "1", "--out", out, "--resume", "auto"];
    let text = stdout(&hetpar(&args));
    let moved = dir.join("earlier-3").display().to_string();
    assert!(
        text.contains(&format!(
            "starting fresh ({moved} holds an earlier run's checkpoints: --resume {moved} goes on from its latest)"
        )) && text.contains("(it had no committed checkpoint to go on from)"),
        "{text}"
    );
}

/// A run that goes back to an earlier checkpoint of its own --out moves the checkpoints
/// past it aside (a branch it leaves), so `--keep` and `--resume auto` see one run; a
/// checkpoint named through a link is the run's own, and nothing of it moves.
#[test]
fn going_back_to_an_earlier_checkpoint_moves_the_later_ones_aside() {
    let tmp = temp("rewind");
    let dir = tmp.path().join("run");
    let out = dir.to_str().expect("utf-8");
    let train = |steps: &str, more: &[&str]| {
        let args = ["train", IN_MEMORY, "--steps", steps, "--out", out];
        stdout(&hetpar(&[&args[..], more].concat()))
    };
    train("3", &["--save-every", "1", "--keep", "0"]);
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(dir.join("checkpoints/step-00000003"), &link).expect("link");
    let text = train("4", &["--resume", link.to_str().expect("utf-8"), "--keep", "0"]);
    assert!(!text.contains("moved"), "{text}");
    let first = dir.join("checkpoints/step-00000001");
    let text = train("5", &["--resume", first.to_str().expect("utf-8")]);
    assert!(
        text.contains(
            "held 3 checkpoints past step 1, the one this run goes on from; moved them to "
        ),
        "{text}"
    );
    assert_eq!(entries(&dir.join("checkpoints")), ["latest", "step-00000001", "step-00000005"]);
    let moved = dir.join("earlier-1/checkpoints");
    assert_eq!(entries(&moved), ["latest", "step-00000002", "step-00000003", "step-00000004"]);
    assert_eq!(std::fs::read_to_string(moved.join("latest")).expect("latest"), "step-00000004");
    let kept: Vec<u64> = losses(&dir).iter().map(|l| l.0).collect();
    assert_eq!(kept, [0, 1, 2, 3, 4]);
    // TensorBoard's events likewise: one file for the run, each step once (the run's
    // history before step 1 carried over), and the branch's own beside its checkpoints.
    assert_eq!(event_steps(&dir), [vec![0, 1, 2, 3, 4]]);
    assert_eq!(event_steps(&dir.join("earlier-1")), [vec![0, 1, 2, 3]]);
    // Another writer's event file is not hetpar's to carry or delete.
    let theirs = dir.join("events.out.tfevents.1700000000.otherhost.99");
    std::fs::write(&theirs, b"").expect("write");
    train("6", &["--resume", "auto"]);
    assert!(theirs.exists());
    assert_eq!(event_steps(&dir), [vec![], vec![0, 1, 2, 3, 4, 5]]);
    // A run going on from the branch's checkpoint in a directory of its own carries the
    // branch's history, which stays where it is.
    let other = tmp.path().join("other");
    let branch = dir.join("earlier-1/checkpoints/step-00000004");
    let args = ["train", IN_MEMORY, "--steps", "5", "--out", other.to_str().expect("utf-8")];
    stdout(&hetpar(&[&args[..], &["--resume", branch.to_str().expect("utf-8")]].concat()));
    assert_eq!(event_steps(&other), [vec![0, 1, 2, 3, 4]]);
    assert_eq!(event_steps(&dir.join("earlier-1")), [vec![0, 1, 2, 3]]);
}

/// The steps of each TensorBoard event file in `dir` (in name order), its version record
/// left out: TFRecord framing around `Event` protobufs, whose field 2 is the step.
fn event_steps(dir: &Path) -> Vec<Vec<u64>> {
    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let mut v = 0;
        for shift in (0..64).step_by(7) {
            let byte = b[*at];
            *at += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                break;
            }
        }
        v
    }
    let files = entries(dir).into_iter().filter(|n| n.starts_with("events.out.tfevents."));
    files
        .map(|name| {
            let bytes = std::fs::read(dir.join(name)).expect("events");
            let (mut at, mut steps) = (0, Vec::new());
            while at < bytes.len() {
                let n = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8")) as usize;
                let data = &bytes[at + 12..at + 12 + n];
                at += 16 + n;
                let (mut i, mut step, mut version) = (0, 0, false);
                while i < data.len() {
                    let key = varint(data, &mut i);
                    match key & 7 {
                        0 if key >> 3 == 2 => step = varint(data, &mut i),
                        0 => _ = varint(data, &mut i),
                        1 => i += 8,
                        2 => {
                            version |= key >> 3 == 3;
                            i += varint(data, &mut i) as usize;
                        }
                        _ => i += 4,
                    }
                }
                if !version {
                    steps.push(step);
                }
            }
            steps
        })
        .collect()
}

/// The saved config holds the steps the run was given (its learning-rate schedule ran over
/// them), and a finished run submitted again has nothing to do: it says so, exits 0 and
/// writes nothing.
#[test]
fn the_saved_config_holds_steps_and_a_finished_run_resumed_again_does_nothing() {
    let tmp = temp("finished");
    let out = tmp.path().to_str().expect("utf-8");
    stdout(&hetpar(&["train", IN_MEMORY, "--steps", "2", "--out", out]));
    let saved: toml::Value = toml::from_str(
        &std::fs::read_to_string(tmp.path().join("config.toml")).expect("saved config"),
    )
    .expect("toml");
    assert_eq!(saved["train"]["steps"].as_integer(), Some(2), "{saved}");
    let metrics = || std::fs::read_to_string(tmp.path().join("metrics.jsonl")).expect("metrics");
    let before = metrics();
    for steps in ["2", "1"] {
        let args = ["train", IN_MEMORY, "--steps", steps, "--out", out, "--resume", "auto"];
        let text = stdout(&hetpar(&args));
        assert!(
            text.contains(&format!(
                "the checkpoint is at step 2 and --steps is {steps}: nothing to train"
            )),
            "{text}"
        );
        assert!(!text.contains("training "), "{text}");
    }
    assert_eq!(metrics(), before);
}

/// A records path that does not exist is named itself, not through the tokenizer or the
/// held-out set looked for next to it, and before the run's description (some 80 lines of
/// resolved config the error would otherwise follow).
#[test]
fn a_missing_data_path_is_named() {
    let tmp = temp("no-data");
    let out = tmp.path().to_str().expect("utf-8");
    let args = ["train", "examples/demo.toml", "--steps", "1", "--out", out];
    let sets = ["--set", "data.source=\"llava\"", "--set", "data.path=\"/nonexistent/x.json\""];
    let run = hetpar(&[&args[..], &sets[..]].concat());
    assert_eq!(run.status.code(), Some(1));
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert!(
        err.ends_with("error: data.path /nonexistent/x.json: no such file or directory (a LLaVA records file, or a directory holding train.json)\n"),
        "{err}"
    );
    let said = String::from_utf8(run.stdout).expect("utf-8");
    assert!(!said.contains("resolved config"), "{said}");
    // A directory without the records is named so, not through its missing tokenizer.
    let empty = tmp.path().join("empty");
    std::fs::create_dir_all(&empty).expect("a directory");
    let set = format!("data.path={:?}", empty.display().to_string());
    let run = hetpar(&[&args[..], &["--set", "data.source=\"llava\"", "--set", &set]].concat());
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert!(
        run.status.code() == Some(1)
            && err.contains(&format!(
                "data.path {}: a directory without train.json",
                empty.display()
            )),
        "{err}"
    );
}

/// A module trained frozen and then unfrozen on resume (LLaVA's second stage trains what
/// the first froze) trains on from the checkpoint with its AdamW moments at zero, saying
/// so; its next checkpoint holds its moments and counts its updates from there. Each
/// step's metrics give each module's learning rate (its own `lr`'s schedule, none while
/// frozen).
#[test]
fn a_module_frozen_when_saved_trains_on_when_a_resume_unfreezes_it() {
    let tmp = temp("unfreeze");
    let out = tmp.path().to_str().expect("utf-8");
    let cfg = "examples/in-memory.toml";
    let frozen = ["--set", "modules.vision.trainable=false"];
    let audio = ["--set", "modules.audio.lr=1e-4"];
    let run =
        hetpar(&[&["train", cfg, "--steps", "2", "--out", out][..], &frozen, &audio].concat());
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for s in metrics(tmp.path()).iter().filter(|v| v.get("loss").is_some()) {
        let (lr, lrs) = (s["lr"].as_f64().expect("lr"), &s["module_lrs"]);
        assert_eq!((lrs["llm"].as_f64(), &lrs["vision"]), (Some(lr), &Value::Null), "{s}");
        // The same warmup and cosine, from the module's own peak (train.lr is 0.003).
        let audio = lrs["audio"].as_f64().expect("audio's");
        assert!((audio / lr - 1e-4 / 3e-3).abs() < 1e-12, "{s}");
    }
    let steps = |step: &str| -> Value {
        let path = tmp.path().join(format!("checkpoints/step-{step}/manifest.json"));
        let m: Value =
            serde_json::from_str(&std::fs::read_to_string(path).expect("manifest")).expect("json");
        m["modules"]
            .as_array()
            .expect("modules")
            .iter()
            .map(|x| (x["module"].as_str().expect("name").to_string(), x["adam_steps"].clone()))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    assert_eq!(steps("00000002")["vision"], Value::from(0));
    let resumed = hetpar(&["train", cfg, "--steps", "3", "--out", out, "--resume", "auto"]);
    let text = stdout(&resumed);
    assert!(resumed.status.success(), "{text}{}", String::from_utf8_lossy(&resumed.stderr));
    assert!(
        text.contains("note: modules.vision was frozen when saved and trains from here: its AdamW moments start at zero"),
        "{text}"
    );
    let after = steps("00000003");
    assert_eq!((&after["vision"], &after["llm"]), (&Value::from(1), &Value::from(3)), "{after}");
    let last = metrics(tmp.path()).into_iter().rfind(|v| v.get("loss").is_some()).expect("steps");
    assert_eq!(
        (last["step"].as_u64(), last["module_lrs"]["vision"].as_f64()),
        (Some(2), last["lr"].as_f64())
    );
    // Frozen again on a further resume: no note.
    // A run's --out names its latest checkpoint, as for eval and export.
    let again = hetpar(
        &[&["train", cfg, "--steps", "4", "--out", out, "--resume", out][..], &frozen].concat(),
    );
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(!stdout(&again).contains("was frozen when saved"));
}

/// A file of the cached synth set gone (deleted, a disk filled) is named as the cache's
/// damage, with the directory whose removal has the next run generate the set again; a
/// generation left unfinished in the cache is noted when the next one starts.
#[test]
fn a_damaged_synth_cache_says_how_to_repair_it() {
    let tmp = temp("synth-cache");
    let (cache, out) = (tmp.path().join("cache"), tmp.path().join("out"));
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_hetpar"))
            .args(["train", "--steps", "1", "--set", "data.samples=20", "--out"])
            .arg(&out)
            .env("HETPAR_CACHE", &cache)
            .current_dir(root())
            .output()
            .expect("hetpar runs")
    };
    let killed = cache.join(".tmp-1-2-synth-killed");
    std::fs::create_dir_all(&killed).expect("a generation left behind");
    // One of this machine's, by a process that has ended: removed, not noted.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let ended =
        cache.join(format!(".tmp-synth-hetpar-synth-2-n20-seed1234-{}-999999999-1", host.trim()));
    std::fs::create_dir_all(&ended).expect("a generation left behind");
    let first = run();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let said = String::from_utf8_lossy(&first.stdout);
    assert!(
        said.contains(&format!("note: {} holds 1 unfinished generation", cache.display())),
        "{said}"
    );
    assert!(!ended.exists());
    std::fs::remove_dir(&killed).expect("removed");
    let set = std::fs::read_dir(&cache)
        .expect("cache")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("synth-")))
        .expect("the synth set");
    let image =
        std::fs::read_dir(set.join("images")).expect("images").flatten().next().expect("one");
    std::fs::remove_file(image.path()).expect("remove");
    let second = run();
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(
        second.status.code() == Some(1)
            && err.contains("missing file")
            && err.contains(&format!(
                "the synth set in the cache is damaged: delete {} and the next run generates it again",
                set.display()
            )),
        "{err}"
    );
}

/// `--eval-every` on data without a held-out split says it has nothing to evaluate.
#[test]
fn eval_every_without_a_heldout_split_says_so() {
    let tmp = temp("eval-every");
    let out = tmp.path().to_str().expect("utf-8");
    let args = ["train", "examples/in-memory.toml", "--steps", "1", "--out", out];
    let run = hetpar(&[&args[..], &["--eval-every", "1"]].concat());
    let text = stdout(&run);
    assert!(run.status.success(), "{text}");
    assert!(text.contains("note: --eval-every has nothing to evaluate"), "{text}");
}

/// `hetpar data synth --samples 1` would write an empty heldout.json that a run refuses:
/// refused itself, writing nothing.
#[test]
fn a_synth_set_of_one_sample_is_refused() {
    let tmp = temp("synth-one");
    let dir = tmp.path().join("data");
    let out = hetpar(&["data", "synth", "--out", dir.to_str().expect("utf-8"), "--samples", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(1)
            && err.contains("--samples 1: a set to train on needs at least 2 samples"),
        "{err}"
    );
    assert!(!dir.exists());
}

/// A 12-sample synthetic set written by `hetpar data synth` under a directory of its own
/// (removed with the returned guard).
fn synth_set(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = temp(name);
    let dir = tmp.path().join("data");
    stdout(&hetpar(&["data", "synth", "--out", dir.to_str().expect("utf-8"), "--samples", "12"]));
    (tmp, dir)
}

/// `layout` and `schedule` plan the items of the records a run on files draws for the step,
/// not a synthetic draw: each edge's bytes in `layout --json --step N` are what the run's
/// step N moved (`boundary_bytes` in its metrics), and the header says where the items
/// came from.
#[test]
fn layout_plans_the_items_a_run_on_files_draws() {
    let (tmp, dir) = synth_set("layout-data");
    let d = dir.to_str().expect("utf-8");
    let sets = ["--set", "data.source=\"llava\"", "--set", &format!("data.path={d:?}")];
    let out = tmp.path().join("run");
    let args = ["train", "examples/demo.toml", "--steps", "2", "--eval-every", "0", "--out"];
    stdout(&hetpar(&[&args[..], &[out.to_str().expect("utf-8")], &sets[..]].concat()));
    let steps: Vec<Value> = metrics(&out).into_iter().filter(|v| v.get("loss").is_some()).collect();
    for (step, metrics) in steps.iter().enumerate() {
        let n = step.to_string();
        let layout = stdout(&hetpar(
            &[&["layout", "examples/demo.toml", "--json", "--step", &n][..], &sets].concat(),
        ));
        let layout: Value = serde_json::from_str(&layout).expect("json");
        assert!(
            layout["items_from"].as_str().is_some_and(|f| f.contains("train.json")),
            "{layout}"
        );
        for e in layout["edges"].as_array().expect("edges") {
            let name = format!(
                "{} -> {}",
                e["src"].as_str().expect("src"),
                e["dst"].as_str().expect("dst")
            );
            let ran = &metrics["boundary_bytes"][&name];
            assert_eq!(
                (&e["bytes_fwd"], &e["bytes_bwd"]),
                (&ran["forward"], &ran["backward"]),
                "{name}, step {step}"
            );
        }
    }
    assert_eq!(steps.len(), 2);
    // In step 3 of this set, both vision replicas have no image in microbatch 1 (the
    // synthetic draw has no replica idle in that step).
    let at = ["schedule", "examples/demo.toml", "--step", "3"];
    let text = stdout(&hetpar(&[&at[..], &sets].concat()));
    assert!(text.contains("\nstep 3: items of the records the run draws (11 in "), "{text}");
    let idle = "vision: replicas with no item in step 3 pass empty (idle) but take part in every transform and reduction: mb 1 on ranks 0-1";
    assert!(text.contains(idle), "{text}");
    // Data that does not open here leaves the synthetic draw, and says so.
    let gone = ["--set", "data.source=\"llava\"", "--set", "data.path=\"/nonexistent/data\""];
    let text = stdout(&hetpar(&[&["layout", "examples/demo.toml"][..], &gone].concat()));
    assert!(
        text.contains("; items drawn by the synthetic source, not the config's data, which did not open here: "),
        "{text}"
    );
}

/// A record longer than seq_len whose items fit is cut at its end, and the data line says
/// how many were cut and by how much (RELIABILITY.md row 9: a count, not a silent cut).
#[test]
fn records_cut_at_seq_len_are_counted() {
    let (tmp, dir) = synth_set("cut");
    let d = dir.to_str().expect("utf-8");
    let path = dir.join("train.json");
    let mut records: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("records")).expect("json");
    // The last answer, after every item: cutting it cuts no item's rows.
    let turns = records[0]["conversations"].as_array_mut().expect("turns");
    let answer = &mut turns.last_mut().expect("a turn")["value"];
    *answer = Value::String(vec!["one blue square"; 200].join(" "));
    std::fs::write(&path, records.to_string()).expect("write");
    let out = tmp.path().join("run");
    let args = ["train", "examples/demo.toml", "--steps", "1", "--eval-every", "0"];
    let sets = ["--set", "data.source=\"llava\"", "--set", &format!("data.path={d:?}")];
    let text =
        stdout(&hetpar(&[&args[..], &sets[..], &["--out", out.to_str().expect("utf-8")]].concat()));
    let line = text.lines().find(|l| l.starts_with(&format!("data {}", path.display())));
    let line = line.unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(" records, 1 cut at seq_len 160 ("), "{line}");
    assert!(line.contains("first: record 0 id "), "{line}");
}

/// Clips longer than the audio encoder's input are cut to it in training, and not silently
/// (RELIABILITY.md row 9 as for records): the first step that cuts one prints a note, and
/// `metrics.jsonl` counts the cut clips by rank among its decodes.
#[test]
fn clips_cut_in_training_are_noted_and_counted() {
    let (tmp, dir) = synth_set("cut-clips");
    let d = dir.to_str().expect("utf-8");
    // Every clip 2 s, against the demo's 128 frames of 10 ms.
    for e in std::fs::read_dir(dir.join("audio")).expect("audio").flatten() {
        wav(&e.path(), 32_000);
    }
    let out = tmp.path().join("run");
    let args = ["train", "examples/demo.toml", "--steps", "2", "--eval-every", "0"];
    let sets = ["--set", "data.source=\"llava\"", "--set", &format!("data.path={d:?}")];
    let text =
        stdout(&hetpar(&[&args[..], &sets[..], &["--out", out.to_str().expect("utf-8")]].concat()));
    let note = "note: some clips are longer than the audio encoder's input (1.28 s) and are cut";
    assert_eq!(text.matches(note).count(), 1, "{text}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    let last: Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .rfind(|l| l.get("loss").is_some())
        .expect("a step");
    let counts = |key: &str| -> Vec<u64> {
        last[key].as_array().expect(key).iter().map(|c| c.as_u64().expect("count")).collect()
    };
    let (cuts, decodes) = (counts("clips_cut_per_rank"), counts("decodes_per_rank"));
    assert!(cuts.iter().sum::<u64>() > 0, "{last}");
    assert!(cuts.iter().zip(&decodes).all(|(c, d)| c <= d), "{last}");
}

/// A checkpoint resumes in the precision it was trained in: f64 tensors, or bf16 products
/// on f32 tensors, refused under another `--dtype` (or none), naming the one to pass.
#[test]
fn a_resume_in_another_precision_is_refused_naming_the_dtype_to_pass() {
    for (trained, other) in [("f64", None), ("bf16", Some("f32")), ("f32", Some("bf16"))] {
        let dir_tmp = temp(&format!("resume-{trained}"));
        let dir = dir_tmp.path();
        let d = dir.to_str().expect("utf-8");
        stdout(&hetpar(&["train", IN_MEMORY, "--steps", "1", "--dtype", trained, "--out", d]));
        let resume = |dtype: Option<&str>| {
            let mut args = vec!["train", IN_MEMORY, "--steps", "2", "--out", d, "--resume", "auto"];
            args.extend(dtype.iter().flat_map(|o| ["--dtype", *o]));
            hetpar(&args)
        };
        let out = resume(other);
        assert_eq!(out.status.code(), Some(1), "{trained} resumed as {other:?}");
        let err = String::from_utf8(out.stderr).expect("utf-8");
        let ran = other.unwrap_or("f32");
        assert!(
            err.contains(&format!(
                "the checkpoint was trained in {trained} and this run asks for {ran}; continue it with --dtype {trained}"
            )),
            "{err}"
        );
        let text = stdout(&resume(Some(trained)));
        assert!(text.contains("1 of 2 steps done"), "{text}");
    }
}

/// `[data] source = "llava"` through `train`: `path` a directory (its `train.json` and
/// `heldout.json`) or the JSON itself; with the media moved elsewhere the run stops naming
/// the missing file, and `image_root` pointing there trains on the same records (the same
/// losses, bit for bit).
#[test]
fn train_reads_llava_files_by_directory_or_file_with_media_under_image_root() {
    let dir_tmp = temp("llava");
    let dir = dir_tmp.path();
    let data = dir.join("d");
    let d = data.to_str().expect("utf-8");
    stdout(&hetpar(&["data", "synth", "--out", d, "--samples", "40", "--seed", "1"]));
    let train = |out: &str, sets: &[String]| {
        let out = dir.join(out);
        let mut args = vec!["train", "--steps", "2", "--out", out.to_str().expect("utf-8")];
        for s in sets {
            args.extend(["--set", s.as_str()]);
        }
        (hetpar(&args), out)
    };
    let llava = |path: &Path| {
        vec![
            "data.source=\"llava\"".to_string(),
            format!("data.path={:?}", path.display().to_string()),
        ]
    };
    let (run, by_dir) = train("by-dir", &llava(&data));
    let text = stdout(&run);
    assert!(
        text.contains(&format!("data {}: 36 records", data.join("train.json").display())),
        "{text}"
    );
    assert!(
        text.contains(&format!("data {}: 4 records", data.join("heldout.json").display())),
        "{text}"
    );
    let media = dir.join("media");
    std::fs::create_dir_all(&media).expect("media dir");
    for sub in ["images", "audio"] {
        std::fs::rename(data.join(sub), media.join(sub)).expect("move media");
    }
    let (run, _) = train("missing", &llava(&data.join("train.json")));
    assert_eq!(run.status.code(), Some(1));
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert!(err.contains(&format!("missing file {}", data.join("images").display())), "{err}");
    let mut sets = llava(&data.join("train.json"));
    sets.push(format!("data.image_root={:?}", media.display().to_string()));
    let (run, by_file) = train("image-root", &sets);
    stdout(&run);
    // The training steps' lines (not the held-out evaluations' or the checkpoints').
    let steps = |out: &Path| -> Vec<(u64, f64)> {
        metrics(out)
            .iter()
            .filter_map(|v| Some((v["step"].as_u64()?, v.get("loss")?.as_f64()?)))
            .collect()
    };
    let (a, b) = (steps(&by_dir), steps(&by_file));
    assert_eq!(a.len(), 2);
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.0 == y.0 && x.1.to_bits() == y.1.to_bits()),
        "{a:?} {b:?}"
    );
}

#[test]
fn data_synth_writes_a_dataset_and_refuses_a_foreign_directory() {
    let tmp = temp("synth-out");
    let dir = tmp.path().join("set");
    let d = dir.to_str().expect("utf-8 path");
    let text = stdout(&hetpar(&["data", "synth", "--out", d, "--samples", "30", "--seed", "3"]));
    assert!(
        text.starts_with(&format!(
            "wrote 30 samples to {d} (27 for training in train.json, 3 held out in heldout.json; seed 3)\n"
        )),
        "{text}"
    );
    for f in ["train.json", "heldout.json", "synth.json", "tokenizer.json", "images", "audio"] {
        assert!(dir.join(f).exists(), "{f}");
    }
    // Without its synth.json the directory is no longer a dataset hetpar wrote.
    std::fs::remove_file(dir.join("synth.json")).expect("remove");
    let out = hetpar(&["data", "synth", "--out", d, "--samples", "5"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.contains("holds files that are not a synthetic dataset"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    let help = stdout(&hetpar(&["data", "synth", "--help"]));
    assert!(help.contains("Examples:\n  hetpar data synth --out /tmp/d"), "{help}");
}

/// A closed output (`hetpar train | head -1`) stops a training run as a signal does, said
/// on stderr, and ends `check` quietly: neither panics (both did, with a backtrace).
#[test]
fn a_closed_output_stops_a_run_without_a_panic() {
    let tmp = temp("closed-output");
    let out = tmp.path().join("run");
    let o = out.to_str().expect("utf-8");
    let ended = |args: &[&str]| {
        let mut child = command(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("hetpar runs");
        // The reading end closed before the command's first lines.
        drop(child.stdout.take());
        let done = child.wait_with_output().expect("hetpar ends");
        (done.status, String::from_utf8(done.stderr).expect("utf-8"))
    };
    let (status, err) = ended(&["train", IN_MEMORY, "--steps", "3", "--out", o]);
    assert!(!err.contains("panicked"), "{err}");
    assert!(err.contains("note: the output cannot be written ("), "{err}");
    assert!(
        err.contains(&format!(
            "error: stopped by its output closing before the first step began; nothing under {o} was moved or written"
        )),
        "{err}"
    );
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(!out.exists());
    let (status, err) = ended(&["check", IN_MEMORY, "--steps", "1"]);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(status.code(), Some(141), "{err}");
    // Closed after the first checkpoint's line: the run stops after the step under way,
    // with a checkpoint, long before its 50 steps.
    use std::io::BufRead;
    let args = ["train", IN_MEMORY, "--steps", "50", "--save-every", "1", "--out", o];
    let mut child = command(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("hetpar runs");
    let mut lines = std::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first =
        lines.by_ref().map_while(Result::ok).find(|l| l.starts_with("checkpoint after step 1 "));
    assert!(first.is_some(), "no checkpoint line");
    drop(lines);
    let done = child.wait_with_output().expect("hetpar ends");
    let err = String::from_utf8(done.stderr).expect("utf-8");
    assert!(done.status.success(), "{err}");
    assert!(err.contains("note: the output cannot be written ("), "{err}");
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).expect("latest");
    let step: usize = latest.trim().trim_start_matches("step-").parse().expect("a step");
    assert!((2..10).contains(&step), "{latest}");
}

/// A checkpoint trained on in-process tokens has no tokenizer to read records through: its
/// evaluation on a dataset is refused rather than scored on ids it never learned (with a
/// vocabulary large enough for the dataset's tokenizer, it ran and printed a loss).
#[test]
fn eval_refuses_a_checkpoint_of_in_process_tokens() {
    let tmp = temp("eval-in-process");
    let out = tmp.path().join("run");
    let o = out.to_str().expect("utf-8");
    let run = hetpar(&[
        "train",
        IN_MEMORY,
        "--steps",
        "1",
        "--out",
        o,
        "--set",
        "modules.llm.vocab=1024",
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let (_set, dir) = synth_set("eval-in-process-set");
    let ev = hetpar(&["eval", o, "--data", dir.to_str().expect("utf-8")]);
    let err = String::from_utf8(ev.stderr).expect("utf-8");
    assert_eq!(ev.status.code(), Some(1), "{err}");
    assert!(
        err.contains(": the run trained on in-process synthetic tokens (data.source = \"synthetic\"), which no tokenizer spells"),
        "{err}"
    );
}

/// `data synth` never leaves a half-written set where a whole one is expected: a new
/// `--out` is written beside it and renamed into place, an earlier set is replaced from
/// inside its directory with its `synth.json` last. A killed run leaves `--out` as it was
/// and the next one removes what it left (but a live process's); a `--out` holding other
/// files than a set, or a file, is refused, as is a set larger than the disk, before any
/// file is written.
#[test]
fn data_synth_is_whole_or_absent() {
    use std::time::{Duration, Instant};
    let tmp = temp("synth-atomic");
    let dir = tmp.path().join("set");
    let d = dir.to_str().expect("utf-8 path");
    stdout(&hetpar(&["data", "synth", "--out", d, "--samples", "10"]));
    let earlier = std::fs::read(dir.join("train.json")).expect("train.json");
    let begun = |at: &Path, prefix: &str| {
        let mut v: Vec<String> = std::fs::read_dir(at)
            .expect("list")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(prefix))
            .collect();
        v.sort();
        v
    };
    // Long enough to be caught writing (some seconds on one core), killed once it is.
    let killed = |out: &str, at: &Path, prefix: &str| {
        let mut child = command(&["data", "synth", "--out", out, "--samples", "200000"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("hetpar runs");
        let start = Instant::now();
        while begun(at, prefix).is_empty() {
            assert!(start.elapsed() < Duration::from_secs(60), "no set being written");
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        child.kill().expect("kill");
        child.wait().expect("wait");
    };
    killed(d, &dir, ".synth-tmp-");
    assert_eq!(std::fs::read(dir.join("train.json")).expect("train.json"), earlier);
    assert_eq!(begun(&dir, ".synth-tmp-").len(), 1, "the killed run's directory");
    // One named for a process still running is left alone (it may be writing).
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let live = format!(".synth-tmp-{}-{}-1", host.trim(), std::process::id());
    std::fs::create_dir(dir.join(&live)).expect("mkdir");
    let text = stdout(&hetpar(&["data", "synth", "--out", d, "--samples", "12"]));
    assert!(text.starts_with("wrote 12 samples to "), "{text}");
    assert_eq!(begun(&dir, ".synth-tmp-"), [live]);
    let made = std::fs::read_to_string(dir.join("synth.json")).expect("synth.json");
    assert!(made.contains("\"samples\": 12"), "{made}");
    // Other files beside a set would go with it; a file is not a directory.
    std::fs::write(dir.join("notes.txt"), "mine").expect("write");
    let refused = |out: &str, want: &str| {
        let run = hetpar(&["data", "synth", "--out", out, "--samples", "5"]);
        let err = String::from_utf8(run.stderr).expect("utf-8");
        assert!(run.status.code() == Some(1) && err.contains(want), "{out}: {err}");
    };
    refused(d, "holds a synthetic dataset and other files (notes.txt), which replacing");
    let file = tmp.path().join("file");
    std::fs::write(&file, "mine").expect("write");
    refused(file.to_str().expect("utf-8"), "is a regular file, not a directory");
    assert_eq!(std::fs::read_to_string(&file).expect("file"), "mine");
    // A new directory: written beside it; killed, nothing at --out. Then `fresh/.`, the
    // same directory, written whole.
    let fresh = tmp.path().join("fresh");
    let f = fresh.to_str().expect("utf-8 path");
    killed(f, tmp.path(), ".fresh.tmp-");
    assert!(!fresh.exists());
    let text = stdout(&hetpar(&["data", "synth", "--out", &format!("{f}/."), "--samples", "5"]));
    assert!(text.starts_with("wrote 5 samples to "), "{text}");
    assert!(fresh.join("synth.json").is_file() && begun(tmp.path(), ".fresh.tmp-").is_empty());
    // Far past any disk: refused with the numbers, nothing written.
    let other = tmp.path().join("huge");
    let o = other.to_str().expect("utf-8 path");
    let out = hetpar(&["data", "synth", "--out", o, "--samples", "100000000000"]);
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with(
            "error: --samples 100000000000: the synthetic dataset's files would take about "
        ) && err.contains(" free on the disk holding "),
        "{err}"
    );
    assert!(!other.exists());
}

/// A step that fails commits no checkpoint: saving after every step, a run whose second
/// step is not finite stops with an error, and `latest` still names the checkpoint after
/// the first, from which `--resume auto` goes on.
#[test]
fn a_failed_step_commits_no_checkpoint() {
    let tmp = temp("failed-step");
    let out = tmp.path().to_str().expect("utf-8");
    let args = ["train", IN_MEMORY, "--steps", "3", "--save-every", "1", "--out", out];
    // A learning rate that makes step 1 non-finite.
    let sets = ["train.lr=1e30", "train.clip_grad=0", "train.warmup=0"].map(|s| ["--set", s]);
    let run = hetpar(&[&args[..], &sets.concat()].concat());
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(err.contains("error: step 2: ") && err.contains("non-finite"), "{err}");
    let ckpts = tmp.path().join("checkpoints");
    assert_eq!(entries(&ckpts), ["latest", "step-00000001"]);
    let latest = std::fs::read_to_string(ckpts.join("latest")).expect("latest");
    assert_eq!(latest.trim(), "step-00000001");
    // Resumed from it (at the same learning rate, so step 1 fails again).
    let resumed = hetpar(&[&args[..], &["--resume", "auto"], &sets.concat()].concat());
    let text = String::from_utf8(resumed.stdout).expect("utf-8");
    assert!(text.contains("1 of 3 steps done"), "{text}");
}

/// Under `on_nonfinite = "skip"` a skipped step says where its values stopped being finite:
/// on the progress line and in `metrics.jsonl` (`nonfinite_at`: modules, then edges).
#[test]
fn a_skipped_step_names_where_it_went_non_finite() {
    let dir_tmp = temp("skip-where");
    let dir = dir_tmp.path();
    let out = dir.join("run");
    // A learning rate that makes step 1's gradients non-finite, skipped rather than stopped.
    let diverging = |steps: &str, out: &Path, more: &[&str]| {
        let mut args = vec!["train", "examples/in-memory.toml", "--steps", steps, "--out"];
        args.push(out.to_str().expect("utf-8"));
        for set in ["train.lr=1e30", "train.clip_grad=0", "train.warmup=0"]
            .into_iter()
            .chain(["train.on_nonfinite=\"skip\""])
            .chain(more.iter().copied())
        {
            args.extend(["--set", set]);
        }
        hetpar(&args)
    };
    let run = diverging("2", &out, &[]);
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert!(run.status.success(), "{err}");
    assert!(err.contains("(skipped: non-finite in "), "{err}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics");
    let steps: Vec<Value> =
        metrics.lines().map(|l| serde_json::from_str(l).expect("json")).collect();
    assert_eq!(steps[0]["applied"], Value::Bool(true));
    assert!(steps[0].get("nonfinite_at").is_none(), "{}", steps[0]);
    assert_eq!(steps[1]["applied"], Value::Bool(false));
    let at: Vec<&str> = steps[1]["nonfinite_at"]
        .as_array()
        .expect("nonfinite_at")
        .iter()
        .map(|v| v.as_str().expect("a name"))
        .collect();
    assert!(at.contains(&"llm") && at.contains(&"boundary vision -> llm"), "{at:?}");
    // Past `train.max_skips` the run stops with an error (steps 1 and 2 skipped, one allowed).
    let run = diverging("4", &dir.join("stopped"), &["train.max_skips=1"]);
    let err = String::from_utf8(run.stderr).expect("utf-8");
    assert_eq!(run.status.code(), Some(1), "{err}");
    assert!(
        err.contains("2 steps were skipped for non-finite values, more than train.max_skips(1)"),
        "{err}"
    );
    // The step that crossed the limit is in the record and on the terminal too.
    assert_eq!(err.matches("(skipped: non-finite in ").count(), 2, "{err}");
    let metrics =
        std::fs::read_to_string(dir.join("stopped").join("metrics.jsonl")).expect("metrics");
    let applied: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json")["applied"].clone())
        .collect();
    assert_eq!(applied, [true, false, false].map(Value::Bool), "{metrics}");
}

/// A `--timeout` shorter than a step's work: the run stops with an error naming what the
/// missing rank was doing, and where it was computing, that the timeout can be raised.
#[test]
fn a_timeout_shorter_than_the_work_says_to_raise_it() {
    let dir_tmp = temp("short-timeout");
    let dir = dir_tmp.path();
    let out_dir = dir.join("run");
    let args = ["train", IN_MEMORY, "--steps", "3", "--timeout", "0.01", "--out"];
    let out = hetpar(&[&args[..], &[out_dir.to_str().expect("utf-8")]].concat());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    let line = err.lines().find(|l| l.starts_with("error: ")).expect("an error line");
    assert!(line.contains(" timed out after 10ms on rank "), "{err}");
    assert!(
        line.contains(" is computing (not in a communication call)") || line.contains(" is in "),
        "{err}"
    );
    if line.contains(" is computing ") {
        assert!(
            line.ends_with("; if that rank's work takes longer than 0.01 s, raise --timeout"),
            "{err}"
        );
    }
}

/// The one-line error of `hetpar train` on the in-memory example with `sets`, which the
/// memory preflight refuses before anything is allocated (an allocation that fails ends a
/// process without a message).
fn refused_for_memory(name: &str, sets: &[&str]) -> String {
    let dir_tmp = temp(name);
    let dir = dir_tmp.path();
    let out_dir = dir.join("run");
    let mut args = vec!["train", "examples/in-memory.toml", "--steps", "1", "--out"];
    args.push(out_dir.to_str().expect("utf-8"));
    for s in sets {
        args.extend(["--set", s]);
    }
    let out = hetpar(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

/// A model whose weights and moments fit but whose activations cannot is refused too,
/// naming the moment of the schedule it counted: rank 0 keeps both microbatches of its
/// vision replica's images and one of the LLM's (one pipeline stage, the three-phase
/// schedule) for their backward.
#[test]
fn activations_too_large_for_the_machine_are_refused_before_allocating() {
    // About 0.6 GiB of states and 29 TiB of activations: refused on any machine.
    let sets = ["modules.llm.layers=512", "train.seq_len=1048576"];
    let err = refused_for_memory("too-long", &sets);
    assert!(err.starts_with("error: in-memory: on 3 rank(s) in this process its weights, gradients and AdamW moments need about "), "{err}");
    assert!(
        err.contains("GiB more (the most the step's schedule makes these ranks hold at once: rank 0 then keeps 3 forward passes for their backward, 1 of them the LLM's, each 4194304 tokens a rank through up to 512 layers), more than the "),
        "{err}"
    );
    assert!(
        err.contains(" available; use recompute = true on the modules, a shorter seq_len, "),
        "{err}"
    );
    // Every module recomputed: rank 0 keeps its two vision passes' rows (the LLM's one
    // stage passes nothing on) and rebuilds the LLM's activations for a backward.
    let all = [
        "modules.llm.parallel.recompute=true",
        "modules.vision.parallel.recompute=true",
        "modules.audio.parallel.recompute=true",
    ];
    let err = refused_for_memory("too-long-recomputed", &[&sets[..], &all[..]].concat());
    assert!(
        err.contains("rank 0 then keeps 2 forward passes for their backward, and rebuilds llm's activations for a backward), more than the "),
        "{err}"
    );
    assert!(err.contains(" available; use a shorter seq_len, "), "{err}");
}

/// A model whose weights and optimizer state alone cannot fit this machine is refused.
#[test]
fn a_model_too_large_for_the_machine_is_refused_before_allocating() {
    let sets = ["modules.llm.hidden=61440", "modules.llm.ffn=122880", "modules.llm.layers=64"];
    let err = refused_for_memory("too-large", &sets);
    assert!(err.starts_with("error: in-memory: its weights, gradients and AdamW moments on 3 rank(s) in this process need about "), "{err}");
    assert!(err.contains("GiB this machine has available"), "{err}");
}

/// A 16 kHz mono 16-bit WAV of `samples` samples of a tone (the header written by hand).
fn wav(path: &Path, samples: usize) {
    let data = (samples * 2) as u32;
    let mut b = Vec::new();
    b.extend_from_slice(b"RIFF");
    b.extend_from_slice(&(36 + data).to_le_bytes());
    b.extend_from_slice(b"WAVEfmt ");
    b.extend_from_slice(&16u32.to_le_bytes());
    b.extend_from_slice(&1u16.to_le_bytes()); // PCM
    b.extend_from_slice(&1u16.to_le_bytes()); // mono
    b.extend_from_slice(&16_000u32.to_le_bytes());
    b.extend_from_slice(&32_000u32.to_le_bytes());
    b.extend_from_slice(&2u16.to_le_bytes());
    b.extend_from_slice(&16u16.to_le_bytes());
    b.extend_from_slice(b"data");
    b.extend_from_slice(&data.to_le_bytes());
    for i in 0..samples {
        let v = (8000.0 * (i as f64 / 10.0).sin()) as i16;
        b.extend_from_slice(&v.to_le_bytes());
    }
    std::fs::write(path, b).expect("wav");
}

/// `hetpar data check` decodes every item of a config's data before a run: a file that
/// does not decode is listed with its record and the command exits 1, where training would
/// have stopped at the step that reads it; a clip longer than the audio encoder's input is
/// counted as cut.
#[test]
fn data_check_lists_what_does_not_decode_and_counts_cut_clips() {
    let (_tmp, dir) = synth_set("data-check");
    let d = dir.to_str().expect("utf-8");
    let path = format!("data.path={d:?}");
    let args = ["data", "check", "examples/demo.toml", "--set", "data.source=\"llava\"", "--set"];
    let check = || hetpar(&[&args[..], &[path.as_str()]].concat());
    let text = stdout(&check());
    assert!(text.contains("train.json: ") && text.contains("; every one decoded\n"), "{text}");
    assert!(!text.contains("cut to it"), "{text}");
    let records: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("train.json")).expect("json"))
            .expect("records");
    let list = records.as_array().expect("a list");
    let first_with = |key: &str| {
        list.iter()
            .enumerate()
            .find_map(|(i, r)| {
                let p = r.get(key)?;
                let p = p.as_str().or_else(|| p.as_array()?.first()?.as_str())?;
                Some((i, r["id"].as_str().expect("id").to_string(), dir.join(p)))
            })
            .expect("a record with the item")
    };
    let (i, id, image) = first_with("image");
    std::fs::write(&image, b"not an image").expect("write");
    // 2 s against the demo's 128 frames of 10 ms: 0.72 s cut.
    let (_, _, clip) = first_with("audio");
    wav(&clip, 32_000);
    let bad = check();
    assert_eq!(bad.status.code(), Some(1));
    let text = String::from_utf8(bad.stdout).expect("utf-8");
    assert!(
        text.contains(&format!("record {i} (id {id:?}): {}: unreadable image", image.display())),
        "{text}"
    );
    let items = text
        .lines()
        .find_map(|l| l.split_once("/train.json: ")?.1.split_once(" images and "))
        .map(|(images, rest)| {
            let clips = rest.split_once(" clips").expect("clips").0;
            images.parse::<usize>().expect("n") + clips.parse::<usize>().expect("n")
        })
        .unwrap_or_else(|| panic!("{text}"));
    assert!(text.contains(&format!("; {} decoded, 1 did not\n", items - 1)), "{text}");
    assert!(
        text.contains("1 clip longer than the audio encoder's input, cut to it (0.7 s"),
        "{text}"
    );
    let err = String::from_utf8(bad.stderr).expect("utf-8");
    assert!(err.ends_with("error: 1 item did not decode\n"), "{err}");
}
