//! `hetpar export CKPT --hf DIR`: a checkpoint as HF-format model directories.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hetpar_runtime::checkpoint::latest_noted;
use hetpar_runtime::export::{Tokens, export_hf};

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

/// The checkpoint `path` names: itself (or its `manifest.json`), or the latest committed
/// one under a run's `--out` or its `checkpoints/` (or that directory's `latest`), with a
/// note where that directory's `latest` is missing or names something else than the
/// checkpoint taken (as `--resume auto` says it).
pub fn checkpoint(path: &Path) -> anyhow::Result<(PathBuf, Option<String>)> {
    use hetpar_runtime::checkpoint::MANIFEST_FILE;
    if path.join(MANIFEST_FILE).is_file() {
        return Ok((path.to_path_buf(), None));
    }
    if !path.exists() {
        bail!("{}: no such file or directory", path.display());
    }
    // A checkpoint's manifest, or a checkpoints directory's `latest`, stands for what it
    // belongs to.
    let parent = || path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match path.file_name().and_then(|n| n.to_str()) {
        Some(MANIFEST_FILE | "latest") if path.is_file() => return checkpoint(parent()),
        _ if path.is_file() => bail!(
            "{}: a file, not a checkpoint (give a step-NNNNNNNN directory, a run's --out or its checkpoints/)",
            path.display()
        ),
        _ => {}
    }
    for root in [path.to_path_buf(), path.join("checkpoints")] {
        if let (Some(dir), note) = latest_noted(&root)? {
            return Ok((dir, note));
        }
    }
    bail!(
        "{}: no checkpoint there (no manifest.json, no committed checkpoint under it)",
        path.display()
    )
}

/// [`checkpoint`] for `eval` and `export`: its note on stderr (their stdout may be one JSON
/// object).
pub fn checkpoint_said(path: &Path) -> anyhow::Result<PathBuf> {
    let (dir, note) = checkpoint(path)?;
    if let Some(note) = note {
        crate::stderr_line(&format!("note: {note}"));
    }
    Ok(dir)
}

/// The chat template of `hetpar-data` in the Jinja form HF tokenizers apply: a role marker,
/// the text, `<|end|>` after each turn; `<|assistant|>` opens the reply to generate. The
/// LLaVA files' own role names (`human`, `gpt`) are taken as `user` and `assistant`, as
/// hetpar reads them.
const CHAT_TEMPLATE: &str = "{% for m in messages %}{% set r = m['role'] %}{% if r == 'human' %}{% set r = 'user' %}{% elif r == 'gpt' %}{% set r = 'assistant' %}{% endif %}{{ '<|' + r + '|>' + m['content'] + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}";

/// Copies the run's `tokenizer.json` next to the exported LLM with a `tokenizer_config.json`
/// (special tokens, chat template, length) and a `special_tokens_map.json`.
fn export_tokenizer(ckpt: &Path, hf: &Path, tokenizer: &Path) -> anyhow::Result<PathBuf> {
    let graph = hetpar_runtime::export::checkpoint_graph(ckpt)?;
    let llm = llm_dir(&graph, hf).context("the checkpoint's graph has no LLM")?;
    let dst = llm.join("tokenizer.json");
    std::fs::copy(tokenizer, &dst).with_context(|| {
        format!("cannot copy the run's tokenizer {} to {}", tokenizer.display(), dst.display())
    })?;
    let special: Vec<&str> = hetpar_data::chat::SPECIAL.to_vec();
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": hetpar_data::chat::PAD,
        "eos_token": hetpar_data::chat::END,
        "additional_special_tokens": special,
        "model_max_length": graph.train.seq_len,
        "chat_template": CHAT_TEMPLATE,
    });
    let map = serde_json::json!({
        "pad_token": hetpar_data::chat::PAD,
        "eos_token": hetpar_data::chat::END,
        "additional_special_tokens": special,
    });
    for (name, v) in [("tokenizer_config.json", config), ("special_tokens_map.json", map)] {
        let file = llm.join(name);
        std::fs::write(&file, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("cannot write {}", file.display()))?;
    }
    Ok(dst)
}

/// The exported LLM's directory under `hf`, where `graph` has an LLM.
fn llm_dir(graph: &hetpar_layout::ModelGraph, hf: &Path) -> Option<PathBuf> {
    let llm =
        graph.modules.iter().find(|m| matches!(m.spec, hetpar_layout::ModuleSpec::Llama { .. }));
    llm.map(|m| hf.join(&m.name))
}

/// Removes an earlier export's tokenizer files from the LLM's directory under `hf`, where
/// this checkpoint's run had no tokenizer: they would describe another model's tokens.
fn no_earlier_tokenizer(ckpt: &Path, hf: &Path) -> anyhow::Result<()> {
    let Some(llm) = llm_dir(&hetpar_runtime::export::checkpoint_graph(ckpt)?, hf) else {
        return Ok(());
    };
    let files = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ];
    let mut removed = Vec::new();
    for name in files {
        let file = llm.join(name);
        if std::fs::symlink_metadata(&file).is_ok() {
            std::fs::remove_file(&file)
                .with_context(|| format!("cannot remove {}", file.display()))?;
            removed.push(name);
        }
    }
    if !removed.is_empty() {
        crate::stderr_line(&format!(
            "note: removed an earlier export's {} from {}: this checkpoint's run had no tokenizer",
            removed.join(", "),
            llm.display()
        ));
    }
    Ok(())
}

/// The run's tokenizer and its end and padding ids; `None` when the run trained on
/// in-process synthetic tokens, which have no tokenizer. Refused where the file at the
/// run's tokenizer path is not the one the checkpoint recorded (the exported ids would not
/// mean what the model learned), as `eval` and a resume refuse it.
fn run_tokenizer(ckpt: &Path) -> anyhow::Result<Option<(PathBuf, Tokens)>> {
    let graph = hetpar_runtime::export::checkpoint_graph(ckpt)?;
    let Some(paths) = crate::data_open::paths(&graph, &|_| {})? else { return Ok(None) };
    let manifest = hetpar_runtime::checkpoint::read_manifest(ckpt, &graph)?;
    let recorded = manifest.tokenizer_sha256.as_deref();
    let used = Some(paths.tokenizer.as_path());
    if let Some(trained) = crate::data_open::changed_tokenizer(recorded, &graph, used)? {
        bail!(
            "the run's tokenizer {} is not the one the checkpoint was trained with ({trained}): the exported model's token ids would not mean what it learned (put the training tokenizer back at that path)",
            paths.tokenizer.display()
        );
    }
    let vocab = hetpar_data::chat::Vocab::load(&paths.tokenizer)?;
    let id = |s: &str| {
        vocab.id(s).with_context(|| {
            format!("the run's tokenizer {} has no {s} token", paths.tokenizer.display())
        })
    };
    let tokens = Tokens { eos: id(hetpar_data::chat::END)?, pad: id(hetpar_data::chat::PAD)? };
    Ok(Some((paths.tokenizer, tokens)))
}

/// The files an export writes into a module's directory (with the temporary name the model
/// is written under, which an interrupted export leaves).
const EXPORT_FILES: [&str; 8] = [
    "model.safetensors",
    ".model.safetensors.tmp",
    "config.json",
    "preprocessor_config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Refuses `hf` where it holds what an export of `ckpt`'s modules would not write (a
/// dataset, another run's modules): the model's files would land among them, or over them.
/// An earlier export of the same modules is written over; a repository's README.md,
/// .gitattributes and .git may sit beside them.
fn check_target(ckpt: &Path, hf: &Path) -> anyhow::Result<()> {
    if std::fs::symlink_metadata(hf).is_ok() && !hf.is_dir() {
        bail!("--hf {}: not a directory; give a directory to export into", hf.display());
    }
    let Ok(entries) = std::fs::read_dir(hf) else { return Ok(()) };
    let graph = hetpar_runtime::export::checkpoint_graph(ckpt)?;
    let mut foreign = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let module = graph.modules.iter().any(|m| m.name == name);
        // What a model repository keeps beside its models.
        if !module && ["README.md", ".gitattributes", ".git"].contains(&name.as_str()) {
            continue;
        }
        match std::fs::read_dir(e.path()) {
            Ok(files) if module && e.file_type().is_ok_and(|t| t.is_dir()) => {
                for f in files.flatten() {
                    let file = f.file_name().to_string_lossy().into_owned();
                    if !EXPORT_FILES.contains(&file.as_str()) {
                        foreign.push(format!("{name}/{file}"));
                    }
                }
            }
            _ => foreign.push(name),
        }
    }
    if foreign.is_empty() {
        return Ok(());
    }
    foreign.sort();
    let more = match foreign.len() {
        n if n > 3 => format!(" and {} more", n - 3),
        _ => String::new(),
    };
    bail!(
        "--hf {}: holds what an export of this checkpoint's modules ({}) does not write: {}{more}; give an empty or new directory (an earlier export of the same modules is written over)",
        hf.display(),
        graph.modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>().join(", "),
        foreign.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
    );
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let ckpt = checkpoint_said(&a.ckpt)?;
    check_target(&ckpt, &a.hf)?;
    let run = run_tokenizer(&ckpt)?;
    let done = export_hf(&ckpt, &a.hf, run.as_ref().map(|r| r.1))?;
    let tokenizer = match &run {
        Some((path, _)) => Some(export_tokenizer(&ckpt, &a.hf, path)?),
        None => {
            no_earlier_tokenizer(&ckpt, &a.hf)?;
            None
        }
    };
    #[allow(clippy::print_stdout)]
    {
        println!("exported {} to {}:", ckpt.display(), a.hf.display());
        for e in done {
            println!(
                "  {}: {} ({} tensors, {:.2} MiB) and {}",
                e.module,
                e.architecture,
                e.tensors,
                e.bytes as f64 / (1024.0 * 1024.0),
                e.configs.join(", ")
            );
        }
        match tokenizer {
            Some(t) => println!(
                "  tokenizer: {} with tokenizer_config.json (chat template) and special_tokens_map.json",
                t.display()
            ),
            None => println!("  no tokenizer: the run trained on in-process synthetic tokens"),
        }
    }
    Ok(())
}
