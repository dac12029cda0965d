//! `hetpar bench comm`: bus bandwidth of the collectives next to this machine's memcpy;
//! `hetpar bench nn`: layer and model throughput; `hetpar bench train`, `executor` and
//! `plans` (in `bench_train`).

use std::time::Duration;

use crate::say;
use anyhow::{Context, bail};
use hetpar_comm::bench::{BenchOp, BenchResult, bench, copy_bandwidth, memcpy_bandwidth};
use hetpar_comm::{LocalOptions, launch};

/// Arguments of `hetpar bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Bus bandwidth of all-reduce, all-gather, all-to-all-v and send-recv.
    #[command(
        after_help = "Examples:\n  hetpar bench comm\n  hetpar bench comm --ranks 2,4 --sizes-mib 4\n  mpirun -n 4 hetpar bench comm --backend mpi   (build with --features mpi)"
    )]
    Comm(CommArgs),
    /// Forward+backward throughput of a transformer layer and of the models on one rank.
    #[command(
        after_help = "Examples:\n  RAYON_NUM_THREADS=1 hetpar bench nn\n  hetpar bench nn --dtype f64 --iters 2\n  hetpar bench nn --only layer,vit"
    )]
    Nn(NnArgs),
    /// Step time per rank by kind of action, measured idle next to the schedule's bubble.
    #[command(
        after_help = "Examples:\n  hetpar bench train\n  RAYON_NUM_THREADS=1 hetpar bench train examples/colocated-fanin.toml --steps 8\n  hetpar bench train examples/demo.toml --json"
    )]
    Train(crate::bench_train::TrainArgs),
    /// The executor's own cost: one module through it against a plain loop.
    #[command(after_help = "Examples:\n  RAYON_NUM_THREADS=1 hetpar bench executor")]
    Executor(crate::bench_train::ExecutorArgs),
    /// What a step's boundary plans cost: every rank's, and one rank's own share (what each
    /// rank of a run builds), checked to be its part of every rank's.
    #[command(
        after_help = "Examples:\n  hetpar bench plans\n  hetpar bench plans examples/colocated-fanin.toml --steps 5\n  hetpar bench plans big.toml --ranks 0,1,1000\n  hetpar bench plans huge.toml --shares-only"
    )]
    Plans(crate::bench_train::PlansArgs),
}

#[derive(clap::Args)]
struct NnArgs {
    /// Element type: f32, f64, or bf16 (bf16 products in the linear layers and the attention
    /// core, f32 weights).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Timed iterations per measurement (the best is reported, after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// Run only these measurements (comma-separated): layer, moe-layer, model, moe-model,
    /// vit, linear (the linear layer's forward product alone, then its backward's two, by
    /// row count), attention (the attention core alone, forward and backward, on the rows'
    /// shapes), adamw (the optimizer update alone). Default: all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// The measurements of `bench nn`, in order.
const NN_BENCHES: [&str; 8] =
    ["layer", "moe-layer", "model", "moe-model", "vit", "linear", "attention", "adamw"];
/// Whether measurement `name` is a row of the forward+backward table (the others print a
/// line of their own).
fn table_row(name: &str) -> bool {
    !matches!(name, "adamw" | "linear" | "attention")
}
/// Parameters of the `adamw` measurement.
const ADAMW_PARAMS: usize = 1 << 22;

#[derive(clap::Args)]
struct CommArgs {
    /// `local` (threads of this process) or `mpi` (one process per rank, under mpirun).
    #[arg(long, default_value = "local")]
    backend: String,
    /// World sizes to measure (local backend; MPI measures the mpirun world).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    ranks: Vec<usize>,
    /// Message sizes in MiB.
    #[arg(long, value_delimiter = ',', default_value = "4,64")]
    sizes_mib: Vec<usize>,
    /// Timed calls per measurement (after one warm-up call).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

fn gbs(bytes_per_s: f64) -> f64 {
    bytes_per_s / 1e9
}

fn line(r: &BenchResult, backend: &str) -> String {
    // A size the ranks do not divide is rounded down to a multiple of them: its fraction
    // of a MiB is shown, not cut off.
    let mib = match r.bytes % (1 << 20) {
        0 => (r.bytes >> 20).to_string(),
        _ => format!("{:.3}", r.bytes as f64 / f64::from(1u32 << 20)),
    };
    format!(
        "{backend:<7} {:<13} {:>5} {mib:>6} MiB {:>11.3} ms {:>10.2} {:>10.2}",
        r.op.name(),
        r.ranks,
        r.seconds * 1e3,
        gbs(r.algbw),
        gbs(r.busbw)
    )
}

pub fn run(args: &Args) -> anyhow::Result<()> {
    let a = match &args.what {
        What::Comm(a) => a,
        What::Nn(a) => return run_nn(a),
        What::Train(a) => return crate::bench_train::run_train(a),
        What::Executor(a) => return crate::bench_train::run_executor(a),
        What::Plans(a) => return crate::bench_train::run_plans(a),
    };
    if a.iters == 0 || a.sizes_mib.is_empty() || a.sizes_mib.contains(&0) {
        bail!(
            "--iters and every --sizes-mib must be at least 1 (got iters {}, sizes {:?})",
            a.iters,
            a.sizes_mib
        );
    }
    let local = a.backend == "local";
    if local && a.ranks.iter().any(|&r| r < 2) {
        bail!(
            "--ranks must be at least 2 (got {:?}): one rank's collectives move no bytes between ranks",
            a.ranks
        );
    }
    // Each rank holds a message and a result buffer (the local backend's ranks all in this
    // process, and its copy measurements two threads' worth; an MPI rank its own): refused
    // where they cannot fit, before anything runs.
    let (most_mib, most_ranks) =
        (*a.sizes_mib.iter().max().expect("not empty"), *a.ranks.iter().max().unwrap_or(&1));
    let ranks_here = if local { most_ranks.max(2) } else { 1 };
    let need = 2.0 * most_mib as f64 * ranks_here as f64 * (1u64 << 20) as f64;
    if let Some(available) = crate::meminfo_bytes("MemAvailable")
        && need > available
    {
        bail!(
            "--sizes-mib {most_mib} on {ranks_here} rank(s) in this process needs {:.1} GiB \
             (a message and a result buffer each), {:.1} GiB are available",
            need / (1u64 << 30) as f64,
            available / (1u64 << 30) as f64
        );
    }
    let sizes: Vec<usize> = a.sizes_mib.iter().map(|m| m << 20).collect();
    let header = format!(
        "{:<7} {:<13} {:>5} {:>10} {:>14} {:>10} {:>10}",
        "backend", "op", "ranks", "size", "time/call", "algbw GB/s", "busbw GB/s"
    );
    match a.backend.as_str() {
        "local" => {
            let memcpy = memcpy_bandwidth(256 << 20, 5);
            say(&format!(
                "memcpy, one thread, 256 MiB: {:.2} GB/s (the ceiling for moving bytes between threads)",
                gbs(memcpy)
            ));
            for &size in &sizes {
                let rate = |threads, streamed| gbs(copy_bandwidth(size, threads, 5, streamed));
                say(&format!(
                    "copies of {} MiB, GB/s per thread, one / two at once: memcpy {:.2} / {:.2}, \
                     as the local backend copies {:.2} / {:.2}",
                    size >> 20,
                    rate(1, false),
                    rate(2, false),
                    rate(1, true),
                    rate(2, true)
                ));
            }
            say(&header);
            for &n in &a.ranks {
                let opts = LocalOptions { timeout: Duration::from_secs(600) };
                for &size in &sizes {
                    for op in BenchOp::ALL {
                        let out = launch(n, opts, |c| bench(c, op, size, a.iters))
                            .context("local world")?;
                        let r = out
                            .into_iter()
                            .next()
                            .expect("one rank at least")
                            .context("benchmark")?;
                        say(&line(&r, "local"));
                    }
                }
            }
            Ok(())
        }
        "mpi" => run_mpi(&sizes, a.iters, &header),
        other => bail!("{}", crate::unknown_backend(other)),
    }
}

#[cfg(feature = "mpi")]
fn run_mpi(sizes: &[usize], iters: usize, header: &str) -> anyhow::Result<()> {
    use hetpar_comm::Communicator;
    use hetpar_comm::mpi::{MpiOptions, abort_on_panic, init};
    let opts = MpiOptions {
        timeout: Duration::from_secs(600),
        on_fatal: Box::new(|e| crate::stderr_line(&format!("error: {e}"))),
    };
    let world = init(opts)?;
    #[allow(clippy::print_stderr)]
    abort_on_panic(world.rank(), |l| eprint!("{l}"));
    let lead = world.rank() == 0;
    if lead {
        let memcpy = memcpy_bandwidth(256 << 20, 5);
        say(&format!("memcpy, one thread, 256 MiB: {:.2} GB/s", gbs(memcpy)));
        say(header);
    }
    for &size in sizes {
        for op in BenchOp::ALL {
            let r = bench(&world, op, size, iters)?;
            if lead {
                say(&line(&r, "mpi"));
            }
        }
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &[usize], _: usize, _: &str) -> anyhow::Result<()> {
    bail!(
        "this hetpar was built without MPI: rebuild with `cargo build --release --features mpi` and run under mpirun"
    )
}

fn run_nn(a: &NnArgs) -> anyhow::Result<()> {
    if a.iters == 0 {
        bail!(
            "--iters must be at least 1 (each measurement keeps the best of its timed iterations)"
        );
    }
    use candle_core::DType;
    use hetpar_nn::bench::{
        ATTENTION_SHAPES, LINEAR_ROWS, NnBench, attention_seconds, bench_adamw, bench_llama,
        bench_llama_layer, bench_vit, bf16_peak_gflops, linear_backward_gflops, linear_gflops,
        matmul_peak_gflops,
    };
    use hetpar_nn::kernels::linear::Matmul;
    use hetpar_nn::layers::attention::CpMode;
    use hetpar_nn::models::llama::LlamaConfig;
    use hetpar_nn::models::vit::VitConfig;

    let (dtype, matmul) = match a.dtype.as_str() {
        "f32" => (DType::F32, Matmul::Native),
        "f64" => (DType::F64, Matmul::Native),
        // f32 parameters and activations, bf16 products in the linear layers and attention.
        "bf16" => (DType::F32, Matmul::Bf16),
        other => bail!("--dtype {other:?}: use f32, f64 or bf16"),
    };
    if let Some(bad) = a.only.iter().find(|o| !NN_BENCHES.contains(&o.as_str())) {
        bail!("--only {bad:?}: choose from {}", NN_BENCHES.join(", "));
    }
    let wanted = |name: &str| a.only.is_empty() || a.only.iter().any(|o| o == name);
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all cores".into());
    // The reference rate: the best of many square matmuls (one measurement is noisy on a
    // shared machine).
    let peak = match matmul {
        Matmul::Native => matmul_peak_gflops(10 * a.iters.max(1), dtype)?,
        Matmul::Bf16 => {
            let kernel = hetpar_nn::kernels::bf16::kernel();
            let f32 = matmul_peak_gflops(10 * a.iters.max(1), DType::F32)?;
            say(&format!(
                "bf16 products ({kernel}), f32 weights and activations; f32 matmul: {f32:.1} GFLOP/s"
            ));
            bf16_peak_gflops(10 * a.iters.max(1))
        }
    };
    say(&format!(
        "matmul (best of 512^3 and 1024^3) {}: {peak:.1} GFLOP/s (threads: {threads})",
        a.dtype
    ));
    say(&format!(
        "kernels on this CPU: gemm's {} products, the fused kernels' loops on the {} path",
        hetpar_nn::kernels::gemm::path(),
        hetpar_nn::kernels::simd::path()
    ));
    if NN_BENCHES.iter().any(|n| wanted(n) && table_row(n)) {
        say(&format!(
            "{:<58} {:>10} {:>12} {:>12} {:>9}",
            "what (forward+backward)", "time", "tokens/s", "GFLOP/s", "of matmul"
        ));
    }
    let llama = LlamaConfig {
        vocab: 4096,
        hidden: 512,
        layers: 4,
        heads: 8,
        kv_heads: 2,
        ffn: 1408,
        experts: 0,
        top_k: 2,
        rms_eps: 1e-5,
        rope_theta: 10_000.0,
        aux_coef: 0.01,
        cp_mode: CpMode::AllGather,
    };
    let moe = LlamaConfig { experts: 8, ffn: 704, ..llama };
    let vit = VitConfig {
        image_size: 224,
        patch_size: 16,
        hidden: 384,
        layers: 4,
        heads: 6,
        ffn: 1536,
        out_hidden: 512,
        ln_eps: 1e-6,
        cp_mode: CpMode::AllGather,
    };
    let iters = a.iters;
    let show = |r: NnBench| {
        say(&format!(
            "{:<58} {:>8.1}ms {:>12.0} {:>12.2} {:>8.0}%",
            r.name,
            r.seconds * 1e3,
            r.tokens_per_s(),
            r.gflops(),
            100.0 * r.gflops() / peak
        ))
    };
    let runs: Vec<anyhow::Result<NnBench>> = launch(1, LocalOptions::default(), |c| {
        let run = |name: &str| match name {
            "layer" => bench_llama_layer(c, llama, 1, 512, iters, dtype, matmul),
            "moe-layer" => bench_llama_layer(c, moe, 1, 512, iters, dtype, matmul),
            "model" => bench_llama(c, llama, 2, 256, iters, dtype, matmul),
            "moe-model" => bench_llama(c, moe, 2, 256, iters, dtype, matmul),
            _ => bench_vit(c, vit, 4, iters, dtype, matmul),
        };
        NN_BENCHES
            .iter()
            .filter(|n| wanted(n) && table_row(n))
            .map(|n| run(n).map_err(anyhow::Error::from))
            .collect::<Vec<_>>()
    })
    .context("local world")?
    .pop()
    .expect("one rank");
    for r in runs {
        show(r?);
    }
    if wanted("linear") {
        // The bench MoE's expert weight (704 x 512): the forward product alone, no autograd,
        // then its backward's two products (an expert's backward is three such pairs, `w2`'s
        // on the transposed shape).
        let (inner, out) = (moe.hidden, moe.ffn);
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        for &rows in &LINEAR_ROWS {
            let (dims, n) = ((rows, inner, out), 20 * iters.max(1));
            let y = linear_gflops(dims, n, dtype, matmul)?;
            let (dx, dw) = linear_backward_gflops(dims, n, dtype, matmul)?;
            forward.push(format!("{rows}: {y:.1}"));
            backward.push(format!("{rows}: {dx:.1}/{dw:.1}"));
        }
        say(&format!(
            "linear forward x @ w^T (w {out} x {inner}) {}, GFLOP/s by rows: {}",
            a.dtype,
            forward.join(", ")
        ));
        say(&format!(
            "linear backward dx = dy w, dw = dy^T x (w {out} x {inner}) {}, GFLOP/s by rows \
             (dx/dw): {}",
            a.dtype,
            backward.join(", ")
        ));
    }
    if wanted("attention") {
        // The rows' attention cores alone, forward and backward (under bf16 the products
        // round to bf16, as in the rows' layers; the softmax stays f32).
        let times = ATTENTION_SHAPES
            .iter()
            .map(|&shape| {
                let t = attention_seconds(shape, 10 * iters.max(1), dtype, matmul)?;
                Ok(format!("{shape} {:.2}", t * 1e3))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        say(&format!(
            "attention core forward+backward {}, ms by shape: {}",
            a.dtype,
            times.join(", ")
        ));
    }
    if wanted("adamw") {
        let (fused, composed) = bench_adamw(ADAMW_PARAMS, 3 * iters.max(1), dtype)?;
        // Memory traffic per parameter of the one pass: weights, gradient and both moments
        // read, weights and both moments written: 7 elements.
        let bytes = 7.0 * ADAMW_PARAMS as f64 * dtype.size_in_bytes() as f64;
        say(&format!(
            "adamw update of {ADAMW_PARAMS} {} parameters: {:.2} ms in place ({:.1} GB/s), {:.2} ms as element-wise tensor ops",
            format!("{dtype:?}").to_lowercase(),
            fused * 1e3,
            bytes / fused / 1e9,
            composed * 1e3
        ));
    }
    Ok(())
}
