//! `hetpar export CKPT --hf DIR`: a checkpoint as HF-format model directories.

use std::path::{Path, PathBuf};

use anyhow::bail;
use hetpar_runtime::checkpoint::latest;
use hetpar_runtime::export::export_hf;

/// Arguments of `hetpar export`.
#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory (`step-NNNNNNNN`), or a run's `--out` directory or its
    /// `checkpoints/` (then the latest committed checkpoint).
    pub ckpt: PathBuf,
    /// Where the HF directories go: one per module, `DIR/<module>/{model.safetensors,
    /// config.json}`.
    #[arg(long, value_name = "DIR")]
    pub hf: PathBuf,
}

/// The checkpoint `path` names.
pub fn checkpoint(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join("manifest.json").is_file() {
        return Ok(path.to_path_buf());
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        if let Some(dir) = latest(&root)? {
            return Ok(dir);
        }
    }
    bail!(
        "{}: no checkpoint there (no manifest.json, no committed checkpoint under it)",
        path.display()
    )
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let ckpt = checkpoint(&a.ckpt)?;
    let done = export_hf(&ckpt, &a.hf)?;
    #[allow(clippy::print_stdout)]
    {
        println!("exported {} to {}:", ckpt.display(), a.hf.display());
        for e in done {
            println!(
                "  {}: {} ({} tensors, {:.2} MiB) and config.json",
                e.module,
                e.architecture,
                e.tensors,
                e.bytes as f64 / (1024.0 * 1024.0)
            );
        }
    }
    Ok(())
}
