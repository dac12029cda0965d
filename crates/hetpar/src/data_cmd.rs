//! `hetpar data synth`: writes the synthetic LLaVA-format dataset. `hetpar data check`:
//! opens a config's data as training would and decodes every image and clip, so a file
//! that would stop a run mid-way is found before it starts.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::bail;
use hetpar_data::Dataset;
use hetpar_data::SynthOptions;
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(clap::Subcommand)]
enum DataCommand {
    /// Write the synthetic multimodal dataset in LLaVA format: PNG images of coloured shapes,
    /// 16 kHz WAV clips of tones and chirps, conversations that ask about them, a held-out
    /// split, and a BPE tokenizer.json trained on it. The same seed gives the same bytes.
    #[command(
        after_help = "Examples:\n  hetpar data synth --out /tmp/d\n  hetpar data synth --out /tmp/d --samples 200 --seed 7"
    )]
    Synth(SynthArgs),
    /// Open a config's data as `hetpar train` does (records checked, encoded and counted,
    /// the skip policy applied) and decode every image and clip of every usable record
    /// into its encoder's input, on every core: a file that does not decode, which would
    /// otherwise stop a run at the step that reads it, is listed with its record, and
    /// clips longer than the audio encoder's frames (cut to them) are counted. Exits 1 if
    /// any item does not decode.
    #[command(
        after_help = "Examples:\n  hetpar data check my-run.toml\n  hetpar data check --set data.source=llava --set data.path=/data/llava/train.json"
    )]
    Check(CheckArgs),
}

#[derive(clap::Args)]
struct CheckArgs {
    /// The training config (default: the built-in demo).
    config: Option<PathBuf>,
    /// Override a config value before validation (repeatable), as for `hetpar train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

#[derive(clap::Args)]
struct SynthArgs {
    /// Directory to write (created if absent; an earlier synthetic dataset there is
    /// replaced, any other content refused). A new directory is written beside it and
    /// renamed into place when complete; an earlier set is replaced from inside it, its
    /// synth.json last; so an interrupted run leaves no half-written set.
    #[arg(long)]
    out: PathBuf,
    /// Samples in all, at least 2; a tenth of them (at least one) are held out.
    #[arg(long, default_value_t = hetpar_layout::config::DataConfig::SYNTH_SAMPLES)]
    samples: usize,
    /// Seed of every draw.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Most images per sample (each sample draws 0 to this many).
    #[arg(long, default_value_t = 2)]
    max_images: usize,
    /// Most audio clips per sample.
    #[arg(long, default_value_t = 1)]
    max_clips: usize,
    /// Image side in pixels.
    #[arg(long, default_value_t = 64)]
    image_size: u32,
    /// Most tokens of the BPE trained on the training split (tokenizer.json).
    #[arg(long, default_value_t = 512)]
    vocab_size: usize,
}

pub(crate) fn run(args: &Args) -> anyhow::Result<()> {
    match &args.command {
        DataCommand::Synth(a) => synth(a),
        DataCommand::Check(a) => check(a),
    }
}

/// How many failures are listed one by one.
const LISTED: usize = 10;

fn check(a: &CheckArgs) -> anyhow::Result<()> {
    let (_, graph) = crate::config_load::load(a.config.as_deref(), &a.set)?;
    let data = crate::data_open::open(&graph, &|l| println!("{l}"))?;
    let crate::data_open::RunData::Files { train, heldout } = data else {
        println!("source = \"synthetic\" draws its samples in memory: there are no files to check");
        return Ok(());
    };
    let mut failed = 0;
    for ds in std::iter::once(&train).chain(heldout.as_ref()) {
        failed += decode_all(ds)?;
    }
    if failed > 0 {
        bail!("{failed} item{} did not decode", if failed == 1 { "" } else { "s" });
    }
    Ok(())
}

/// Decodes every item of `ds`'s usable records on every core, prints what it found, and
/// returns how many items failed.
fn decode_all(ds: &Dataset) -> anyhow::Result<usize> {
    let items: Vec<(usize, usize)> = ds
        .entries()
        .iter()
        .enumerate()
        .flat_map(|(e, entry)| (0..entry.encoded.items.len()).map(move |k| (e, k)))
        .collect();
    let path = ds.spec().path.display().to_string();
    let bar = ProgressBar::new(items.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} items, {eta} left")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = std::time::Instant::now();
    let next = AtomicUsize::new(0);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    // Each thread's (item index, error) and (item index, samples cut), then in item order.
    let (mut errors, mut cuts) = (Vec::new(), Vec::new());
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..cores.min(items.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let (mut errors, mut cuts) = (Vec::new(), Vec::new());
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(e, k)) = items.get(i) else { break };
                        match ds.decode(e, k) {
                            Ok(d) if d.cut > 0 => cuts.push((i, d.cut)),
                            Ok(_) => {}
                            Err(err) => errors.push((i, err)),
                        }
                        bar.inc(1);
                    }
                    (errors, cuts)
                })
            })
            .collect();
        for t in threads {
            let (e, c) = t.join().unwrap_or_default();
            errors.extend(e);
            cuts.extend(c);
        }
    });
    bar.finish_and_clear();
    errors.sort_by_key(|(i, _)| *i);
    cuts.sort_by_key(|(i, _)| *i);
    let kinds = |kind: hetpar_data::chat::Kind| {
        items.iter().filter(|&&(e, k)| ds.entries()[e].encoded.items[k].kind == kind).count()
    };
    let outcome = match errors.len() {
        0 => "every one decoded".to_string(),
        n => format!("{} decoded, {n} did not", items.len() - n),
    };
    println!(
        "{path}: {} images and {} clips of {} records read in {:.1} s; {outcome}",
        kinds(hetpar_data::chat::Kind::Image),
        kinds(hetpar_data::chat::Kind::Audio),
        ds.entries().len(),
        start.elapsed().as_secs_f64(),
    );
    for (_, err) in errors.iter().take(LISTED) {
        println!("  {err}");
    }
    if errors.len() > LISTED {
        println!("  ... and {} more", errors.len() - LISTED);
    }
    if let Some(&(i, first)) = cuts.first() {
        let (e, _) = items[i];
        let entry = &ds.entries()[e];
        let rate = f64::from(hetpar_data::mel::SAMPLE_RATE);
        println!(
            "  {} clip{} longer than the audio encoder's input, cut to it ({:.1} s of audio left out in all; first: record {} id {:?}, {:.1} s cut)",
            cuts.len(),
            if cuts.len() == 1 { "" } else { "s" },
            cuts.iter().map(|&(_, c)| c as f64).sum::<f64>() / rate,
            entry.index,
            entry.record.id,
            first as f64 / rate
        );
    }
    Ok(errors.len())
}

fn synth(a: &SynthArgs) -> anyhow::Result<()> {
    // One sample would leave an empty heldout.json, which a run reading the set refuses.
    if a.samples < 2 {
        anyhow::bail!(
            "--samples {}: a set to train on needs at least 2 samples (a tenth of them, at least one, is held out)",
            a.samples
        );
    }
    let opts = SynthOptions {
        seed: a.seed,
        max_images: a.max_images,
        max_clips: a.max_clips,
        image_size: a.image_size,
        vocab_size: a.vocab_size,
        ..SynthOptions::with_samples(a.samples)
    };
    let bar = ProgressBar::new(a.samples as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} samples, {eta} left")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    crate::data_open::synth_fits(&opts, &a.out, "--samples")?;
    let summary =
        crate::data_open::synth_into(&a.out, &opts, &mut |done| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    println!(
        "wrote {} samples to {} ({} for training in train.json, {} held out in heldout.json; seed {})",
        a.samples,
        a.out.display(),
        summary.train,
        summary.heldout,
        a.seed
    );
    println!(
        "{} images ({} samples with several), {} audio clips, {} text-only samples; tokenizer.json with {} tokens; {:.1} MiB",
        summary.images,
        summary.multi_image,
        summary.clips,
        summary.text_only,
        summary.vocab,
        summary.bytes as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}
