//! `hetpar data synth`: writes the synthetic LLaVA-format dataset.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;

use anyhow::Context;
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
}

#[derive(clap::Args)]
struct SynthArgs {
    /// Directory to write (created if absent; an earlier synthetic dataset there is
    /// replaced, any other content refused).
    #[arg(long)]
    out: PathBuf,
    /// Samples in all; a tenth of them (at least one) are held out.
    #[arg(long, default_value_t = 1000)]
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
    }
}

fn synth(a: &SynthArgs) -> anyhow::Result<()> {
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
    let summary =
        hetpar_data::synth::generate(&a.out, &opts, &mut |done| bar.set_position(done as u64))
            .with_context(|| format!("writing the synthetic dataset to {}", a.out.display()))?;
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
