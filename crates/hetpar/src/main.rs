//! The `hetpar` command line. The only place that prints, reads files and environment
//! variables, and uses `anyhow`; every decision is made by the library crates.

mod alloc;
mod bench_cmd;
mod bench_train;
mod check_cmd;
mod config_load;
mod data_cmd;
mod data_open;
mod eval_cmd;
mod export_cmd;
mod flops;
mod layout_cmd;
mod plan_cmd;
mod plots;
mod preflight;
mod schedule_cmd;
mod tensorboard;
mod threads;
mod train_cmd;

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::{Parser, Subcommand};
use hetpar_layout::ModelGraph;

/// mimalloc keeps freed memory for reuse: with glibc's malloc every large tensor of a step
/// came from fresh pages (a page fault and the kernel's zeroing per 4 KiB), 5-10% of a
/// step's time in `hetpar bench nn` and the demo. Its large blocks are staggered across
/// cache sets (see `alloc.rs`).
#[global_allocator]
static ALLOCATOR: alloc::Staggered = alloc::Staggered;

#[derive(Parser)]
#[command(
    name = "hetpar",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("HETPAR_BUILD"), ")"),
    about = "Heterogeneous parallelism for multimodal LLM training: every module gets its own layout and placement.",
    after_help = "Examples:\n  hetpar train\n  hetpar layout examples/colocated-fanin.toml"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model graph (the built-in demo without a config): a progress bar, metrics.jsonl,
    /// loss.svg, time.svg, checkpoints and the resolved config under --out.
    #[command(
        after_help = "Examples:\n  hetpar train   (the built-in demo on the synthetic LLaVA set: held-out loss and answers)\n  hetpar train --eval-every 50 --set train.lr=2e-3\n  hetpar data synth --out /tmp/d && hetpar train --set data.source=llava --set data.path=/tmp/d\n  hetpar train examples/in-memory.toml --steps 20   (no files: quick)\n  hetpar train examples/colocated-fanin.toml --steps 5\n  hetpar train --dtype f64 --out runs/demo-f64\n  hetpar train --resume auto   (go on from the latest checkpoint under --out)\n  mpirun -n 3 hetpar train --backend mpi   (build with --features mpi)"
    )]
    Train(train_cmd::Args),
    /// Parity: train CONFIG and a reference (default: the same model on one rank) step by
    /// step and compare losses and gradient norms; non-zero exit past tolerance.
    #[command(
        after_help = "Examples:\n  hetpar check examples/colocated-fanin.toml\n  hetpar check examples/two-encoders-islands.toml --dtype f64 --steps 2\n  hetpar check examples/dp3-into-dp2.toml --json"
    )]
    Check(check_cmd::Args),
    /// Show each module's rank grid and each edge's boundary plan (bytes, lower bound, leaders).
    #[command(
        after_help = "Examples:\n  hetpar layout examples/colocated-fanin.toml\n  hetpar layout examples/two-encoders-islands.toml --programs\n  hetpar layout big.toml --programs --rank 0,4095\n  hetpar layout examples/dp3-into-dp2.toml --json"
    )]
    Layout(layout_cmd::Args),
    /// Show and validate the per-rank action timeline of one training step.
    #[command(
        after_help = "Examples:\n  hetpar schedule examples/two-encoders-islands.toml\n  hetpar schedule examples/colocated-cp-sp.toml --svg schedule.svg"
    )]
    Schedule(schedule_cmd::Args),
    /// Rank layouts and placements for a workload: best homogeneous, colocated and
    /// non-colocated, with predicted step time, TFLOPS/GPU, tokens/s and memory, and why.
    #[command(
        after_help = "Examples:\n  hetpar plan examples/workloads/mm-1b-14b-8k.toml\n  hetpar plan examples/workloads/mm-1b-7b-64k.toml --top 3\n  hetpar plan examples/workloads/mm-1b-7b-8k.toml --set workload.seq_len=16384 --set workload.global_batch=16\n  hetpar plan examples/workloads/mm-6b-gptoss120b.toml --gpus 1024 --json\n  hetpar plan examples/workloads/mm-3b-32b-8k.toml --emit-config runs/mm-3b-32b.toml"
    )]
    Plan(plan_cmd::Args),
    /// Measure this machine (matmul, attention, memcpy, collectives) into a hardware spec
    /// for `hetpar plan --hardware local`.
    #[command(after_help = "Example:\n  RAYON_NUM_THREADS=1 hetpar calibrate")]
    Calibrate(plan_cmd::CalibrateArgs),
    /// Benchmarks: `hetpar bench comm`, `nn`, `train`, `executor` and `plans`.
    #[command(
        after_help = "Examples:\n  RAYON_NUM_THREADS=1 hetpar bench nn --only layer\n  hetpar bench comm\n  hetpar bench train examples/colocated-fanin.toml"
    )]
    Bench(bench_cmd::Args),
    /// Datasets: `hetpar data synth --out DIR` writes the synthetic LLaVA-format set;
    /// `hetpar data check [CONFIG]` decodes every image and clip of a config's data.
    #[command(after_help = "Example:\n  hetpar data synth --out /tmp/d --samples 200")]
    Data(data_cmd::Args),
    /// Write a checkpoint as HF-format models: per module model.safetensors (HF names, no
    /// optimizer state) and config.json (Llama or Mixtral, SigLIP vision tower with its
    /// LLaVA projector and preprocessor_config.json, Whisper encoder with its feature
    /// extractor's preprocessor_config.json); for a run on files,
    /// the tokenizer with its chat template and the generation config beside the LLM.
    #[command(
        after_help = "Examples:\n  hetpar export runs/demo --hf /tmp/demo-hf\n  hetpar export runs/demo/checkpoints/step-00000100 --hf /tmp/demo-hf"
    )]
    Export(export_cmd::Args),
    /// Held-out loss and answer accuracy of a checkpoint (greedy decoding of each answer,
    /// scored as exact match), on the layout it was saved under.
    #[command(
        after_help = "Examples:\n  hetpar eval runs/demo   (the run's own held-out records)\n  hetpar data synth --out /tmp/d --seed 1234 && hetpar eval runs/demo --data /tmp/d   (the demo's set)\n  hetpar eval runs/demo/checkpoints/step-00000100 --data /tmp/d/heldout.json --json\n  hetpar eval runs/demo --data /tmp/d --show 10   (the first 10 answers next to the model's)\n  mpirun -n 3 hetpar eval runs/demo --data /tmp/d --backend mpi   (build with --features mpi)"
    )]
    Eval(eval_cmd::Args),
}

/// A `/proc/meminfo` field (`MemTotal`, `MemAvailable`) in bytes; `None` where the file or
/// the field cannot be read.
pub(crate) fn meminfo_bytes(field: &str) -> Option<f64> {
    proc_kib_field("/proc/meminfo", field)
}

/// Bytes free to an unprivileged writer on the filesystem that holds `path` (or would: the
/// nearest of its ancestors that exists); `None` where the system does not say.
pub(crate) fn free_disk_bytes(path: &Path) -> Option<u64> {
    let mut at = path;
    while !at.as_os_str().is_empty() && !at.exists() {
        at = at.parent()?;
    }
    let at = if at.as_os_str().is_empty() { Path::new(".") } else { at };
    let stats = rustix::fs::statvfs(at).ok()?;
    Some(stats.f_bavail.saturating_mul(stats.f_frsize))
}

/// The most memory this process has had resident (`VmHWM` of `/proc/self/status`) in
/// bytes; `None` where the system does not say.
pub(crate) fn process_peak_bytes() -> Option<f64> {
    proc_kib_field("/proc/self/status", "VmHWM")
}

/// A `Field: N kB` line of a `/proc` file, in bytes.
fn proc_kib_field(path: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.split(':').next() == Some(field))?;
    line.split_whitespace().nth(1)?.parse::<f64>().ok().map(|kib| kib * 1024.0)
}

/// Reads and validates a config file with `--set` overrides; errors name the file. Keys
/// given to no effect are noted on stderr (stdout may be one JSON object).
pub(crate) fn load_graph(path: &Path, sets: &[String]) -> anyhow::Result<ModelGraph> {
    let graph = config_load::load(Some(path), sets)?.1;
    for idle in config_load::idle_keys(&graph) {
        stderr_line(&format!("note: {idle}"));
    }
    Ok(graph)
}

fn run(cli: Cli) -> anyhow::Result<()> {
    // The commands that print a report and run no ranks: a closed output ends them. (A
    // training job keeps SIGPIPE ignored: under MPI a peer's closed socket must be an
    // error the job reports, not a silent death.)
    if matches!(
        cli.command,
        Command::Layout(_)
            | Command::Schedule(_)
            | Command::Plan(_)
            | Command::Calibrate(_)
            | Command::Data(_)
            | Command::Export(_)
    ) {
        quiet_on_closed_output();
    }
    match cli.command {
        Command::Train(args) => train_cmd::run(&args),
        Command::Check(args) => check_cmd::run(&args),
        Command::Layout(args) => layout_cmd::run(&args),
        Command::Schedule(args) => schedule_cmd::run(&args),
        Command::Plan(args) => plan_cmd::run(&args),
        Command::Calibrate(args) => plan_cmd::calibrate(&args),
        Command::Bench(args) => bench_cmd::run(&args),
        Command::Data(args) => data_cmd::run(&args),
        Command::Export(args) => export_cmd::run(&args),
        Command::Eval(args) => eval_cmd::run(&args),
    }
}

/// Ends the process quietly when what it prints to is closed (`hetpar plan ... | head`),
/// as command-line tools do: Rust ignores SIGPIPE, so the next print would panic.
#[allow(unsafe_code)]
fn quiet_on_closed_output() {
    // SAFETY: restoring a signal's default action, before the command starts any thread.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    // Freed pages stay for the next step's tensors, unless the environment set mimalloc's
    // purge delay (see `alloc.rs`).
    alloc::keep_freed_pages();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return bad_usage(&e),
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the chain of contexts joined by ": ".
            stderr_line(&format!("error: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

/// A command line clap refuses: one line (its reason, and where to look) and exit 2; help
/// and version requests print as clap prints them.
fn bad_usage(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    // The reason is what clap writes before its usage, on one line, with its tips (a
    // similar subcommand or flag: "did you mean").
    let text = e.render().to_string();
    let reason: Vec<&str> = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more"))
        // Of the tips, the "did you mean" ones (not "to pass '--x' as a value, use '--'").
        .filter(|l| !l.is_empty() && (!l.starts_with("tip:") || l.contains(" similar ")))
        .collect();
    // The (sub)command whose help to point at: the leading words that name one.
    let mut cmd = <Cli as clap::CommandFactory>::command();
    let mut words = Vec::new();
    for a in std::env::args_os().skip(1) {
        let Some(sub) = a.to_str().and_then(|a| cmd.find_subcommand(a)).cloned() else { break };
        words.push(sub.get_name().to_string());
        cmd = sub;
    }
    let help: String = words.iter().map(|w| format!(" {w}")).collect();
    let mut line = String::new();
    for part in reason {
        let gap = match (line.is_empty(), part.starts_with("tip:")) {
            (true, _) => "",
            (false, true) => "; ",
            (false, false) => " ",
        };
        line += gap;
        line += part;
    }
    stderr_line(&format!("{line} (see hetpar{help} --help)"));
    ExitCode::from(2)
}

/// Refuses a count of steps (`--steps`, `--warmup`) past the most a config's `train.steps`
/// may say (the run would otherwise fail allocating its records of them).
pub(crate) fn steps_flag(flag: &str, steps: usize) -> anyhow::Result<()> {
    hetpar_layout::graph::at_most(flag, "", steps, hetpar_layout::graph::MAX_SIZE)?;
    Ok(())
}

/// The refusal of a `--backend` that training and its commands do not run on.
pub(crate) fn unknown_backend(name: &str) -> String {
    match name {
        "nccl" => "--backend \"nccl\": the NCCL backend is built (feature nccl) and run by its GPU conformance check, not yet by training; use local or mpi".to_string(),
        other => format!("--backend {other:?}: use local or mpi"),
    }
}

/// `1.5 KiB`, `384 B`, `2.00 MiB`.
pub(crate) fn human(bytes: usize) -> String {
    let b = bytes as f64;
    if bytes < 1024 {
        format!("{bytes} B")
    } else if b < 1024.0 * 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else if b < 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    } else {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    }
}

/// Writes `line` and its newline to stderr in one write: ranks under mpirun share the
/// stream, and a line written in pieces (as `eprintln!` writes its arguments) can take
/// another rank's line inside it. Every error line of the binary goes through here. A
/// closed stderr loses the line (there is nowhere left to say so).
pub(crate) fn stderr_line(line: &str) {
    use std::io::Write;
    let whole = format!("{line}\n");
    let _ = std::io::stderr().lock().write_all(whole.as_bytes());
}

/// Set by the commands that stop on their own when their output closes (`hetpar train`:
/// after its step, with a checkpoint); the others end there (see [`say`]).
static STOPS_ON_CLOSED_OUTPUT: AtomicBool = AtomicBool::new(false);
/// Set by [`say`] when stdout can no longer be written, in a command that stops on its own.
static OUTPUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Makes a closed stdout stop this command through [`output_closed`] rather than end it.
pub(crate) fn stop_when_output_closes() {
    STOPS_ON_CLOSED_OUTPUT.store(true, Ordering::SeqCst);
}

/// Whether stdout closed in a command that asked to stop on it.
pub(crate) fn output_closed() -> bool {
    OUTPUT_CLOSED.load(Ordering::SeqCst)
}

/// A line of a command's report on stdout. Where stdout cannot be written (`hetpar train |
/// head -1` once `head` has its line, a full disk), a command that asked
/// ([`stop_when_output_closes`]) is told through [`output_closed`] and said so once on
/// stderr; any other ends the process: quietly on a closed pipe (exit 141, as SIGPIPE would
/// end it), else with the error (exit 1). Printing never panics.
pub(crate) fn say(line: &str) {
    use std::io::Write;
    let Err(e) = writeln!(std::io::stdout().lock(), "{line}") else { return };
    if STOPS_ON_CLOSED_OUTPUT.load(Ordering::SeqCst) {
        if !OUTPUT_CLOSED.swap(true, Ordering::SeqCst) {
            stderr_line(&format!(
                "note: the output cannot be written ({e}): the run stops as a signal would stop it (after the step under way, with a checkpoint to continue from with --resume auto; before its first step, with nothing written)"
            ));
        }
        return;
    }
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    stderr_line(&format!("error: cannot write the output: {e}"));
    std::process::exit(1);
}
