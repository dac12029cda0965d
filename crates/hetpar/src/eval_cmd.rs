//! `hetpar eval CKPT --data DIR`: held-out loss and answer accuracy of a checkpoint, on the
//! layout it was saved under (its own config), one thread per rank, or under mpirun one
//! process per rank (`--backend mpi`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use hetpar_comm::{CommExt, Communicator};
use hetpar_runtime::checkpoint::CONFIG_FILE;
use hetpar_runtime::{EvalReport, NO_TOP, RuntimeError, Trainer};

use crate::data_open::RunData;
use crate::export_cmd::checkpoint_said;
use crate::preflight::{Holds, fits_memory, fits_memory_mpi};
use crate::train_cmd::{describe_eval, dtype, fail_job, open_mpi, run_facts, timeout};

/// Arguments of `hetpar eval`.
#[derive(clap::Args)]
pub struct Args {
    /// A checkpoint directory (`step-NNNNNNNN`), or a run's `--out` directory or its
    /// `checkpoints/` (then the latest committed checkpoint).
    pub ckpt: PathBuf,
    /// The records to evaluate: a `hetpar data synth` directory (its heldout.json) or a
    /// LLaVA JSON file, with its tokenizer.json next to it and media paths relative to it
    /// (media elsewhere: `--set data.image_root=DIR`). Default: the run's own held-out
    /// records, as its config names them (a `synth` source's set in the cache, generated
    /// again where it is gone).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Override a value of the checkpoint's config (repeatable), e.g. `--set
    /// train.global_batch=16` for larger evaluation batches.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// One JSON object on stdout instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also show the first N answers next to the model's: the reference, and what greedy
    /// decoding from the conversation before it (earlier answers as the record has them)
    /// emits, as far as it follows the reference (up to and including its first different
    /// token). With --json, an `answers` list.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub show: usize,
    /// Seconds a rank waits in a communication call before the run fails naming it and what
    /// the ranks it waited for were doing (in which call, or computing: raise it for steps
    /// whose work takes longer).
    #[arg(long, default_value_t = 120.0)]
    pub timeout: f64,
    /// `local` (one thread per rank in this process) or `mpi` (one process per rank under
    /// mpirun, as the checkpoint's layout places them; build with --features mpi).
    #[arg(long, default_value = "local")]
    pub backend: String,
}

/// The text of `ids`, an id the tokenizer has no token for (the LLM's vocabulary may be
/// larger) spelt `[id N]`, and [`NO_TOP`] `[no top token: NaN logits]`: the tokenizer
/// would drop such ids without a word.
fn spell(vocab: &hetpar_data::chat::Vocab, ids: &[u32]) -> String {
    let mut out = String::new();
    for run in ids.chunk_by(|a, b| (*a as usize) < vocab.len() && (*b as usize) < vocab.len()) {
        match run {
            [id] if *id == NO_TOP => out.push_str("[no top token: NaN logits]"),
            [id] if *id as usize >= vocab.len() => out.push_str(&format!("[id {id}]")),
            known => out.push_str(&vocab.decode(known).unwrap_or_else(|_| format!("{known:?}"))),
        }
    }
    out
}

/// A note for each `--set` in `set` whose key only shapes training (the optimizer, the
/// step count, which modules train, recomputation in the backward): an evaluation reads
/// the checkpoint's weights as saved, so such a key changes none of its numbers.
fn training_only(set: &[String]) -> Vec<String> {
    const TRAIN: [&str; 7] =
        ["steps", "lr", "warmup", "min_lr", "weight_decay", "clip_grad", "max_skips"];
    set.iter()
        .filter_map(|s| {
            let key = s.split_once('=').map_or(s.as_str(), |(k, _)| k).trim();
            let module = key.strip_prefix("modules.").and_then(|k| k.rsplit_once('.'));
            let idle = match key.strip_prefix("train.") {
                Some(k) => TRAIN.contains(&k),
                // (An evaluation runs no backward, so recomputing changes nothing.)
                None => module.is_some_and(|(m, k)| {
                    k == "lr" || k == "trainable" || (k == "recompute" && m.ends_with(".parallel"))
                }),
            };
            idle.then(|| {
                format!(
                    "note: --set {key} has no effect on an evaluation: it shapes training, and the checkpoint's weights are evaluated as saved"
                )
            })
        })
        .collect()
}

/// The records an evaluation reads.
struct Records {
    /// The LLaVA JSON file.
    file: PathBuf,
    /// Its tokenizer.
    tokenizer: PathBuf,
    /// What its media paths are relative to.
    media_root: PathBuf,
    /// How the output names them: `--data` as given, else the held-out file.
    shown: PathBuf,
}

impl Records {
    /// `--data`: a directory's heldout.json, or the file itself, with the tokenizer next to
    /// them and media relative to them.
    fn given(data: &Path) -> anyhow::Result<Records> {
        let (file, dir) = if data.is_dir() {
            (data.join("heldout.json"), data.to_path_buf())
        } else {
            // A bare file name's directory is the current one (its parent is the empty
            // path).
            let parent = data.parent().filter(|p| !p.as_os_str().is_empty());
            (data.to_path_buf(), parent.map_or_else(|| PathBuf::from("."), PathBuf::from))
        };
        if !file.is_file() {
            let what = match std::fs::metadata(&file) {
                Ok(m) => {
                    format!("{} is {}", file.display(), hetpar_data::files::describe(m.file_type()))
                }
                Err(_) => format!("no such file as {}", file.display()),
            };
            anyhow::bail!(
                "--data {}: {what} (give a `hetpar data synth` directory, or a LLaVA records file)",
                data.display()
            );
        }
        Ok(Records {
            tokenizer: dir.join("tokenizer.json"),
            media_root: dir,
            shown: data.to_path_buf(),
            file,
        })
    }

    /// The held-out records of the run whose config is `trained`, with its tokenizer and
    /// media.
    fn trained(trained: &hetpar_layout::ModelGraph) -> anyhow::Result<Records> {
        let paths = crate::data_open::paths(trained, &|l| crate::stderr_line(l))?
            .context("the run read no records files")?;
        let Some(file) = paths.heldout else {
            anyhow::bail!(
                "the run had no held-out records (data.heldout, or heldout.json next to data.path {}): give --data",
                paths.json.display()
            );
        };
        Ok(Records {
            shown: file.clone(),
            file,
            tokenizer: paths.tokenizer,
            media_root: paths.media_root,
        })
    }
}

pub fn run(a: &Args) -> anyhow::Result<()> {
    let ckpt = checkpoint_said(&a.ckpt)?;
    let config = ckpt.join(CONFIG_FILE);
    let text = hetpar_runtime::checkpoint::saved_config(&ckpt)?
        .with_context(|| format!("{}: the checkpoint holds no config", config.display()))?;
    // The saved config's own mistakes (a key an older build wrote, say) at its own lines.
    let name = config.display().to_string();
    let (_, trained) = crate::config_load::load_text(text.clone(), name.clone(), &[])?;
    if trained.data.source == hetpar_layout::config::DataSource::Synthetic {
        anyhow::bail!(
            "{}: the run trained on in-process synthetic tokens (data.source = \"synthetic\"), which no tokenizer spells: records read through a tokenizer would be ids the model never learned; evaluate a run trained on files (data.source = \"synth\" or \"llava\")",
            ckpt.display()
        );
    }
    let records = match &a.data {
        Some(data) => Records::given(data)?,
        None => Records::trained(&trained).context(
            "the run's own held-out records, read without --data (give --data to name them)",
        )?,
    };
    // Each path as a TOML string (Rust's `{:?}` escapes other characters than TOML does).
    let quoted = |p: &Path| toml::Value::String(p.display().to_string()).to_string();
    let f = quoted(&records.file);
    // The checkpoint's own data keys are all replaced (its training split is not opened:
    // the held-out file stands in).
    let ours = [
        "data.source=\"llava\"".to_string(),
        format!("data.path={f}"),
        format!("data.heldout={f}"),
        format!("data.tokenizer={}", quoted(&records.tokenizer)),
        format!("data.image_root={}", quoted(&records.media_root)),
        // Items come from the records: the synthetic source's item count and the synth
        // set's size do not apply.
        "data.max_items=1".to_string(),
        format!("data.samples={}", hetpar_layout::config::DataConfig::SYNTH_SAMPLES),
    ];
    // The data keys are written into the text first, so an error names only the sets the
    // user gave.
    let data_text = crate::config_load::apply(&text, &ours).with_context(|| name.clone())?;
    let (cfg, mut graph) = crate::config_load::load_text(data_text, name.clone(), &a.set)?;
    let manifest = hetpar_runtime::checkpoint::read_manifest(&ckpt, &graph)?;
    let used = crate::data_open::tokenizer_file(&graph);
    let recorded = manifest.tokenizer_sha256.as_deref();
    let changed = crate::data_open::changed_tokenizer(recorded, &trained, used.as_deref())?;
    if let (Some(trained), Some(used)) = (changed, used) {
        anyhow::bail!(
            "{}{}: its tokenizer {} is not the one the checkpoint was trained with ({trained}): the token ids would not mean what the model learned (evaluate records tokenized as in training, or pass --set data.tokenizer=...)",
            if a.data.is_some() { "--data " } else { "the run's held-out records " },
            records.shown.display(),
            used.display(),
        );
    }
    // The precision the checkpoint was trained in, so the numbers are the ones the run
    // found: f64 where its tensors are (checkpoints saved before a config could say
    // `dtype = "f64"` have f64 tensors under an "f32" config), else its config's.
    let dt = dtype((manifest.dtype == "f64").then_some("f64"), &mut graph)?;
    let timeout = timeout(a.timeout)?;
    // This rank's part: the checkpoint's slices, then the held-out batches.
    let evaluate = |c: &dyn Communicator, data: &RunData| {
        let rank = c.global_rank();
        let mut t = Trainer::new(c, &graph, dt, graph.train.steps, &data.sources(&graph, rank))?;
        t.set_machine(crate::train_cmd::files_view());
        let step = t.resume(c, &ckpt)?.manifest.step;
        Ok::<_, RuntimeError>((step, t.evaluate(c)?))
    };
    let (step, report): (usize, EvalReport) = match a.backend.as_str() {
        "local" => {
            crate::threads::size_candle_pool(graph.world);
            // Every rank's weights in this process: refused, as `train` refuses it, where
            // they do not fit (under MPI, per machine below).
            fits_memory(&graph, dt, &(0..graph.world).collect::<Vec<_>>(), Holds::Evaluation)?;
            let run_data = crate::data_open::open(&graph, &|_| {})?;
            let opts = hetpar_comm::LocalOptions { timeout };
            let results = hetpar_comm::launch(graph.world, opts, |c| {
                hetpar_nn::kernels::share_threads(graph.world);
                evaluate(c, &run_data)
            })?;
            // The error that started a failure (a rank's own, such as a clip that does not
            // decode on the audio encoder's rank), not rank 0's report of it.
            match crate::train_cmd::every_rank_or_cause(results, timeout)?.into_iter().next() {
                Some(r) => r,
                None => anyhow::bail!("the checkpoint's layout has no ranks"),
            }
        }
        "mpi" => {
            let world = open_mpi(timeout, &graph)?;
            let rank = world.rank();
            // Every process reads its own records and checkpoint: they must agree, as
            // for training; an error on one ends the job, printed.
            let done = crate::data_open::open(&graph, &|_| {}).and_then(|data| {
                let facts = run_facts(
                    &cfg,
                    graph.train.dtype.name(),
                    graph.train.steps,
                    &data,
                    Some(&ckpt),
                )?;
                hetpar_runtime::agree(world.as_ref(), &facts)?;
                fits_memory_mpi(world.as_ref(), &graph, dt, Holds::Evaluation)?;
                Ok(evaluate(world.as_ref(), &data)?)
            });
            match done {
                Ok(r) if rank == 0 => r,
                Ok(_) => return Ok(()),
                Err(e) => {
                    fail_job(rank, RuntimeError::Model(format!("{e:#}")))?;
                    return Ok(());
                }
            }
        }
        other => anyhow::bail!("{}", crate::unknown_backend(other)),
    };
    for note in training_only(&a.set) {
        crate::stderr_line(&note);
    }
    // The shown answers' text, by the tokenizer the records were read with.
    let shown = &report.answered[..a.show.min(report.answered.len())];
    let vocab = match (shown.is_empty(), graph.data.tokenizer.as_deref()) {
        (false, Some(t)) => Some(
            hetpar_data::chat::Vocab::load(Path::new(t))
                .with_context(|| format!("cannot read the tokenizer {t}"))?,
        ),
        _ => None,
    };
    let text = |ids: &[u32]| vocab.as_ref().map_or_else(|| format!("{ids:?}"), |v| spell(v, ids));
    if a.json {
        let kinds = serde_json::to_value(&report.answers)?;
        let mut out = serde_json::json!({
            "checkpoint": ckpt.display().to_string(),
            "step": step,
            "loss": if report.loss.is_finite() { serde_json::json!(report.loss) } else { serde_json::Value::Null },
            "answer_accuracy": report.accuracy(),
            "token_accuracy": report.correct_tokens as f64 / report.targets.max(1) as f64,
            "targets": report.targets,
            "by_kind": kinds,
        });
        if a.show > 0 {
            let answers: Vec<serde_json::Value> = shown
                .iter()
                .map(|x| {
                    serde_json::json!({
                        "kind": x.kind,
                        "right": x.right(),
                        "expected": text(&x.expected),
                        "greedy": text(x.greedy()),
                        "expected_ids": x.expected,
                        "top_ids": x.model,
                    })
                })
                .collect();
            out["answers"] = answers.into();
        }
        crate::say(&format!("{out}"));
    } else {
        crate::say(&format!(
            "{} after {step} steps on {}: {}",
            ckpt.display(),
            records.shown.display(),
            describe_eval(&report)
        ));
        if !shown.is_empty() {
            crate::say(&format!("the first {} of {} answers:", shown.len(), report.answered.len()));
        }
        for (i, x) in shown.iter().enumerate() {
            let expected = text(&x.expected);
            if x.right() {
                crate::say(&format!("  {}. {}, right: {expected:?}", i + 1, x.kind));
            } else {
                let greedy = text(x.greedy());
                crate::say(&format!(
                    "  {}. {}, wrong: {expected:?}; greedy decoding begins {greedy:?}",
                    i + 1,
                    x.kind
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use hetpar_data::chat::Vocab;
    use hetpar_runtime::NO_TOP;

    use super::{spell, training_only};

    /// The keys that only shape training get a note each, the ones an evaluation reads
    /// (batch size, data, layouts) none.
    #[test]
    fn training_only_keys_are_noted() {
        let set: Vec<String> = [
            "train.lr=1e-3",
            "train.global_batch=16",
            "modules.vision.trainable=false",
            "modules.llm.lr = 2e-4",
            "modules.llm.parallel.tp=2",
            "modules.llm.parallel.recompute=true",
            "train.on_nonfinite=skip",
            "data.image_root=/tmp",
            "train.steps",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let keys: Vec<String> = training_only(&set)
            .iter()
            .map(|n| n.split_whitespace().nth(2).unwrap_or_default().to_string())
            .collect();
        assert_eq!(
            keys,
            [
                "train.lr",
                "modules.vision.trainable",
                "modules.llm.lr",
                "modules.llm.parallel.recompute",
                "train.steps"
            ]
        );
    }

    /// Ids the tokenizer has tokens for read as their text; one it lacks (the LLM's
    /// vocabulary may be larger) and a NaN row's are named, where the tokenizer would drop
    /// them without a word.
    #[test]
    fn ids_without_a_token_are_named_not_dropped() {
        let vocab = Vocab::train(&["two green circles".to_string()], 300).expect("vocab");
        let ids = vocab.ids("two green").expect("ids");
        assert_eq!(spell(&vocab, &ids), "two green");
        let past = vocab.len() as u32 + 7;
        let mut with = ids.clone();
        with.push(past);
        assert_eq!(spell(&vocab, &with), format!("two green[id {past}]"));
        assert_eq!(spell(&vocab, &[NO_TOP]), "[no top token: NaN logits]");
        assert_eq!(spell(&vocab, &[]), "");
    }
}
