//! The data a run reads, from `[data]`: the in-process synthetic source, a LLaVA JSON file
//! (or a `hetpar data synth` directory), or the synth set generated once into the cache.
//! Every process opens it the same way (metadata only); payloads are decoded later by the
//! ranks that run them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use hetpar_data::dataset::{BadData, Fronts};
use hetpar_data::{DataError, Dataset, DatasetSpec, SynthOptions};
use hetpar_layout::config::{DataSource, OnBad};
use hetpar_layout::{ModelGraph, ModuleSpec};
use hetpar_runtime::{RunFacts, Sources};

/// What a run's ranks read.
#[derive(Clone, Debug)]
pub enum RunData {
    /// `source = "synthetic"`: generated in-process, nothing to open.
    Synthetic,
    /// Records from files.
    Files {
        /// The training records.
        train: Arc<Dataset>,
        /// Held-out records, where there are some.
        heldout: Option<Arc<Dataset>>,
    },
}

impl RunData {
    /// Records what this process read into `facts` (`hetpar_runtime::agree`): the SHA-256
    /// of each records file and of the tokenizer, and how many records each kept and left
    /// out. Media files are not read here: a missing or unreadable one is refused when a
    /// rank decodes it.
    pub fn facts(&self, facts: &mut RunFacts) -> anyhow::Result<()> {
        let RunData::Files { train, heldout } = self else {
            facts.set("data.read", "in-process");
            return Ok(());
        };
        let digest = |path: &Path| -> anyhow::Result<String> {
            let (sha, bytes) = hetpar_runtime::checkpoint::sha256(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(format!("{sha} ({bytes} bytes)"))
        };
        facts.set("data.tokenizer", digest(&train.spec().tokenizer)?);
        for (name, ds) in
            std::iter::once(("train", train)).chain(heldout.iter().map(|h| ("heldout", h)))
        {
            facts.set(format!("data.{name}.file"), digest(&ds.spec().path)?);
            facts.set(format!("data.{name}.records"), ds.entries().len());
            let skipped: Vec<&str> = ds.skipped().iter().map(|k| k.id.as_str()).collect();
            facts.set(format!("data.{name}.left_out"), skipped.len());
            facts.set_digest(format!("data.{name}.left_out_ids"), skipped.join("\n").as_bytes());
        }
        Ok(())
    }

    /// The tokenizer the records were read with (`None` for the in-process source).
    pub fn tokenizer(&self) -> Option<&Path> {
        match self {
            RunData::Files { train, .. } => Some(&train.spec().tokenizer),
            RunData::Synthetic => None,
        }
    }

    /// Rank `rank`'s sources.
    pub fn sources(&self, graph: &ModelGraph, rank: usize) -> Sources {
        match self {
            RunData::Synthetic => Sources::synthetic(graph),
            RunData::Files { train, heldout } => {
                Sources::files(graph, rank, train.clone(), heldout.clone())
            }
        }
    }
}

/// The cache directory: `$HETPAR_CACHE`, else `$XDG_CACHE_HOME/hetpar`, else
/// `~/.cache/hetpar`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HETPAR_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("hetpar");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache").join("hetpar"),
        None => PathBuf::from(".hetpar-cache"),
    }
}

/// Where the synth set of `samples` samples seeded by `seed` lies in the cache (generated
/// or not).
pub fn synth_dir(samples: usize, seed: u64) -> PathBuf {
    cache_dir().join(format!(
        "synth-{}-n{samples}-seed{seed}",
        hetpar_data::synth::FORMAT.replace('/', "-")
    ))
}

/// How the name of a synth set being generated in the cache begins.
const TMP_PREFIX: &str = ".tmp-";

/// This machine's name, as its kernel has it (empty where it cannot be read).
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().replace('/', "_"))
        .unwrap_or_default()
}

/// A name for a directory being written, unique to this process and moment: `tag`, the
/// machine's name, the process id and the time in nanoseconds (so [`process_gone`] can tell
/// one left by a process that ended, on a filesystem several machines share).
fn tmp_name(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{tag}{}-{}-{nanos}", host(), std::process::id())
}

/// Whether the process that named `name` ([`tmp_name`] with `tag`) ran on this machine and
/// has ended.
fn process_gone(name: &str, tag: &str) -> bool {
    let Some(rest) = name.strip_prefix(tag) else { return false };
    let mut parts = rest.rsplitn(3, '-');
    let (_nanos, pid, machine) = (parts.next(), parts.next(), parts.next());
    machine == Some(host().as_str())
        && pid
            .and_then(|p| p.parse::<u32>().ok())
            .is_some_and(|p| !Path::new(&format!("/proc/{p}")).exists())
}

/// Removes the directories under `dir` whose names begin with `tag` and whose process
/// ([`tmp_name`]) has ended on this machine: what interrupted writes left.
fn clear_leftovers(dir: &Path, tag: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if process_gone(&name, tag) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Refuses a synth set that `opts` describe when its files would not fit on the disk
/// holding `dir` or its records in the memory available, with the numbers, before anything
/// is written; `samples` names where the sample count came from (`--samples`,
/// `data.samples`).
pub fn synth_fits(opts: &SynthOptions, dir: &Path, samples: &str) -> anyhow::Result<()> {
    let need = hetpar_data::synth::footprint(opts)?;
    let size = |b: u64| crate::human(usize::try_from(b).unwrap_or(usize::MAX));
    if let Some(free) = crate::free_disk_bytes(dir)
        && need.disk > free
    {
        bail!(
            "{samples} {}: the synthetic dataset's files would take about {} (from its first samples), more than the {} free on the disk holding {}; give fewer samples or another place",
            opts.samples,
            size(need.disk),
            size(free),
            dir.display()
        );
    }
    if let Some(available) = crate::meminfo_bytes("MemAvailable")
        && need.memory as f64 > available
    {
        bail!(
            "{samples} {}: generating the synthetic dataset holds its records in memory, about {}, more than the {} this machine has available; give fewer samples",
            opts.samples,
            size(need.memory),
            size(available as u64)
        );
    }
    Ok(())
}

/// Writes the synth set `opts` describe to `out` so that an interruption never leaves a
/// half-written set where a whole one is expected. A new `out` is written beside it and
/// renamed into place. An existing one (empty, or an earlier set alone: anything else is
/// refused first) is written inside it and swapped in entry by entry, its `synth.json` (the
/// mark of a whole set, which the next run replaces) last; so `out` itself, a mount point
/// or the working directory, stays. What interrupted writes left is removed first.
pub fn synth_into(
    out: &Path,
    opts: &SynthOptions,
    progress: &mut dyn FnMut(usize),
) -> anyhow::Result<hetpar_data::SynthSummary> {
    use hetpar_data::synth::{SET_ENTRIES, TMP_PREFIX as IN_SET, check_target, generate};
    check_target(out)?;
    let writing = || format!("writing the synthetic dataset to {}", out.display());
    let generated = |tmp: &Path, progress: &mut dyn FnMut(usize)| {
        generate(tmp, opts, progress).map_err(|e| {
            let _ = std::fs::remove_dir_all(tmp);
            anyhow::Error::from(e).context(writing())
        })
    };
    if out.is_dir() {
        clear_leftovers(out, IN_SET);
        let tmp = out.join(tmp_name(IN_SET));
        let summary = generated(&tmp, progress)?;
        // The earlier set's entries into the new one's directory, which goes at the end.
        let earlier = tmp.join(".earlier");
        let swap = || -> std::io::Result<()> {
            std::fs::create_dir(&earlier)?;
            for name in &SET_ENTRIES[1..] {
                if std::fs::symlink_metadata(out.join(name)).is_ok() {
                    std::fs::rename(out.join(name), earlier.join(name))?;
                }
            }
            for name in SET_ENTRIES[1..].iter().chain(&SET_ENTRIES[..1]) {
                std::fs::rename(tmp.join(name), out.join(name))?;
            }
            Ok(())
        };
        swap().with_context(|| {
            format!(
                "cannot move the new set into {} (what it holds now is incomplete: run again to replace it)",
                out.display()
            )
        })?;
        let _ = std::fs::remove_dir_all(&tmp);
        return Ok(summary);
    }
    // `dir/.` and `./dir` as the directory they name, for its parent and name.
    let whole = std::path::absolute(out).with_context(writing)?;
    let (Some(parent), Some(name)) = (whole.parent(), whole.file_name()) else {
        bail!("{}: give a directory to write the dataset into", out.display());
    };
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tag = format!(".{}.tmp-", name.to_string_lossy());
    clear_leftovers(parent, &tag);
    let tmp = parent.join(tmp_name(&tag));
    let summary = generated(&tmp, progress)?;
    if let Err(e) = std::fs::rename(&tmp, &whole) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("cannot move the new set into {}", out.display()));
    }
    Ok(summary)
}

/// The synth set of `samples` samples seeded by `seed` under the cache, generated if it is
/// not there yet (into a temporary directory renamed into place, so an interrupted or
/// concurrent generation never leaves a half-written set). `say` reports what it did.
pub fn synth_cache(samples: usize, seed: u64, say: &dyn Fn(&str)) -> anyhow::Result<PathBuf> {
    let root = cache_dir();
    let dir = synth_dir(samples, seed);
    let name = dir.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    if dir.join("synth.json").is_file() {
        return Ok(dir);
    }
    say(&format!("generating the synthetic dataset ({samples} samples) into {}", dir.display()));
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    // Unique per machine, process and moment (processes of one job on several hosts may
    // share the cache); this machine's ended processes' leftovers go first.
    let tag = format!("{TMP_PREFIX}{name}-");
    clear_leftovers(&root, &tag);
    let tmp = root.join(tmp_name(&tag));
    // Left by generations killed before their rename (or running now, on another host
    // sharing the cache, so they are named rather than removed).
    let left: Vec<String> = std::fs::read_dir(&root)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(TMP_PREFIX))
                .collect()
        })
        .unwrap_or_default();
    if !left.is_empty() {
        say(&format!(
            "  note: {} holds {} unfinished generation{} ({}...): left by interrupted runs unless one is running now; delete them when none is",
            root.display(),
            left.len(),
            if left.len() == 1 { "" } else { "s" },
            TMP_PREFIX
        ));
    }
    let opts = SynthOptions { seed, ..SynthOptions::with_samples(samples) };
    synth_fits(&opts, &root, "data.samples")?;
    let start = std::time::Instant::now();
    let summary = hetpar_data::synth::generate(&tmp, &opts, &mut |_| {})
        .with_context(|| format!("writing the synthetic dataset to {}", tmp.display()))?;
    if std::fs::rename(&tmp, &dir).is_err() {
        // Another process finished first: keep its copy (the same bytes).
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("synth.json").is_file() {
            bail!("cannot move the synthetic dataset into {}", dir.display());
        }
    }
    say(&format!(
        "  {} training and {} held-out samples, {} images, {} clips, {:.1} MiB in {:.1} s",
        summary.train,
        summary.heldout,
        summary.images,
        summary.clips,
        summary.bytes as f64 / (1024.0 * 1024.0),
        start.elapsed().as_secs_f64()
    ));
    Ok(dir)
}

/// Where a run's files are.
pub struct Paths {
    /// The training records.
    pub json: PathBuf,
    /// The held-out records, where there are some.
    pub heldout: Option<PathBuf>,
    /// The tokenizer.
    pub tokenizer: PathBuf,
    /// What media paths are relative to.
    pub media_root: PathBuf,
}

/// The tokenizer file `graph`'s data reads, where it is there (`None` for the in-process
/// source); nothing is generated.
pub fn tokenizer_file(graph: &ModelGraph) -> Option<PathBuf> {
    let path = match graph.data.source {
        DataSource::Synthetic => return None,
        DataSource::Synth => synth_dir(graph.data.samples, graph.train.seed).join("tokenizer.json"),
        DataSource::Llava => paths(graph, &|_| {}).ok()??.tokenizer,
    };
    path.is_file().then_some(path)
}

/// Where the tokenizer `used` holds other bytes than the one a checkpoint's run read, whose
/// token ids do not mean the same: what the checkpoint's was (the file its saved config
/// `trained` names, with the SHA-256 its manifest `recorded` where it recorded one), to name
/// in the refusal. The recorded SHA-256 catches a tokenizer replaced at the same path; a
/// checkpoint saved before it was kept is compared with the file its config names. `None`
/// where they are the same or either is unknown (in-process tokens, an older checkpoint
/// whose file is no longer there).
pub fn changed_tokenizer(
    recorded: Option<&str>,
    trained: &ModelGraph,
    used: Option<&Path>,
) -> anyhow::Result<Option<String>> {
    let Some(used) = used else { return Ok(None) };
    let digest = |p: &Path| {
        if !p.is_file() {
            anyhow::bail!(
                "the tokenizer {} is not there (a checkpoint records its tokenizer's path and SHA-256, not the file: put the run's tokenizer back at that path)",
                p.display()
            );
        }
        Ok(hetpar_runtime::checkpoint::sha256(p)?.0)
    };
    let named = tokenizer_file(trained);
    if let Some(saved) = recorded {
        let now = digest(used)?;
        let file = named.map_or_else(|| "its data's tokenizer".into(), |p| p.display().to_string());
        let short = |sha: &str| sha.chars().take(16).collect::<String>();
        return Ok((now != saved).then(|| {
            format!(
                "{file}, SHA-256 {}... when saved; this one's is {}...",
                short(saved),
                short(&now)
            )
        }));
    }
    let Some(named) = named else { return Ok(None) };
    Ok((digest(&named)? != digest(used)?).then(|| named.display().to_string()))
}

/// The files `graph`'s data reads (`None` for the in-process source); the synth set is
/// generated into the cache if it is not there.
pub fn paths(graph: &ModelGraph, say: &dyn Fn(&str)) -> anyhow::Result<Option<Paths>> {
    let data = &graph.data;
    let (json, heldout) = match data.source {
        DataSource::Synthetic => return Ok(None),
        DataSource::Synth => {
            let dir = synth_cache(data.samples, graph.train.seed, say)?;
            (dir.join("train.json"), Some(dir.join("heldout.json")))
        }
        DataSource::Llava => {
            let path = PathBuf::from(data.path.as_deref().expect("validated: llava has a path"));
            // Named before the files found next to it (the tokenizer, the held-out set),
            // whose absence would otherwise be the first thing said.
            if !path.exists() {
                anyhow::bail!(
                    "data.path {}: no such file or directory (a LLaVA records file, or a directory holding train.json)",
                    path.display()
                );
            }
            if path.is_dir() {
                let (train, held) = (path.join("train.json"), path.join("heldout.json"));
                if !train.is_file() {
                    anyhow::bail!(
                        "data.path {}: a directory without train.json (a `hetpar data synth` directory holds train.json, heldout.json and tokenizer.json; or name the records file)",
                        path.display()
                    );
                }
                (train, held.is_file().then_some(held))
            } else {
                let held = path.with_file_name("heldout.json");
                let held = (held != path && held.is_file()).then_some(held);
                (path, held)
            }
        }
    };
    let heldout = data.heldout.as_ref().map(PathBuf::from).or(heldout);
    let dir = json.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf);
    let tokenizer =
        data.tokenizer.as_ref().map_or_else(|| dir.join("tokenizer.json"), PathBuf::from);
    let media_root = data.image_root.as_ref().map_or(dir, PathBuf::from);
    Ok(Some(Paths { json, heldout, tokenizer, media_root }))
}

/// The manifest of training step `step` of a run of `graph`, for the commands that plan a
/// step without training it (`layout`, `schedule`): the synthetic source's draw, or the
/// records the run draws from its data (opened as a run opens them, a synth set generated
/// into the cache first, `say` hearing what was opened; nothing decoded). With it, what it
/// was drawn from, for the command's output. Data that cannot be opened here (a cluster's
/// path, planned on a laptop) leaves the synthetic draw, and the phrase says why.
pub fn step_manifest(
    graph: &ModelGraph,
    step: u64,
    say: &dyn Fn(&str),
) -> anyhow::Result<(hetpar_layout::BatchManifest, String)> {
    let synthetic = |why: String| (hetpar_layout::BatchManifest::synthetic(graph, step), why);
    match open(graph, say) {
        Ok(RunData::Synthetic) => Ok(synthetic("items drawn by the synthetic source".into())),
        Err(e) => Ok(synthetic(format!(
            "items drawn by the synthetic source, not the config's data, which did not open here: {e:#}"
        ))),
        Ok(RunData::Files { train, .. }) => {
            let path = train.spec().path.display().to_string();
            let at = usize::try_from(step).with_context(|| format!("--step {step}"))?;
            let m = hetpar_runtime::data::train_manifest(graph, &train, at)
                .map_err(|e| anyhow::anyhow!("{path}: step {step}: {e}"))?;
            let n = train.entries().len();
            Ok((m, format!("items of the records the run draws ({n} in {path})")))
        }
    }
}

/// Opens `graph`'s data; `say` reports what was opened and skipped (the lead passes a
/// printer, the other processes a no-op).
pub fn open(graph: &ModelGraph, say: &dyn Fn(&str)) -> anyhow::Result<RunData> {
    let Some(Paths { json, heldout, tokenizer, media_root }) = paths(graph, say)? else {
        return Ok(RunData::Synthetic);
    };
    let data = &graph.data;
    let spec = DatasetSpec {
        path: json,
        media_root,
        tokenizer,
        seq_len: graph.train.seq_len,
        vocab: llm_vocab(graph),
        fronts: fronts(graph),
        on_bad: match data.on_bad {
            OnBad::Error => BadData::Error,
            OnBad::Skip => BadData::Skip,
        },
    };
    let one = |spec: DatasetSpec| -> anyhow::Result<Arc<Dataset>> {
        let path = spec.path.clone();
        // Every kind of data error but a bad option names its file first. The synth set is
        // hetpar's own, generated whole: a file of it missing or unreadable is the cache's
        // damage (a file deleted, a disk filled), which its generation repairs.
        let damaged = |e: &DataError| {
            data.source == DataSource::Synth
                && match e {
                    DataError::Io { .. } | DataError::Format { .. } => true,
                    DataError::Record { message, .. } => {
                        message.starts_with(hetpar_data::dataset::MISSING)
                    }
                    _ => false,
                }
        };
        let ds = Dataset::open(spec).map_err(|e| match e {
            DataError::Options(_) => anyhow::anyhow!("data {}: {e}", path.display()),
            e if damaged(&e) => anyhow::anyhow!(
                "data {e}; the synth set in the cache is damaged: delete {} and the next run generates it again",
                path.parent().unwrap_or(&path).display()
            ),
            e => anyhow::anyhow!("data {e}"),
        })?;
        let skipped = ds.skipped();
        // Records cut at seq_len (at the end, never through an item's rows): counted, so
        // that answers shortened by it are not a surprise.
        let cut: Vec<&hetpar_data::dataset::Entry> =
            ds.entries().iter().filter(|e| e.encoded.truncated > 0).collect();
        let cut = match cut.first() {
            None => String::new(),
            Some(first) => format!(
                ", {} cut at seq_len {} ({} tokens past it; first: record {} id {:?}, {} of {} tokens kept)",
                cut.len(),
                graph.train.seq_len,
                cut.iter().map(|e| e.encoded.truncated).sum::<usize>(),
                first.index,
                first.record.id,
                first.encoded.length - first.encoded.truncated,
                first.encoded.length
            ),
        };
        say(&format!(
            "data {}: {} records{cut}{}",
            path.display(),
            ds.entries().len(),
            if skipped.is_empty() {
                String::new()
            } else {
                let first = &skipped[0];
                format!(
                    ", {} left out by data.on_bad = \"skip\" (first: record {} id {:?}: {})",
                    skipped.len(),
                    first.index,
                    first.id,
                    first.reason
                )
            }
        ));
        Ok(Arc::new(ds))
    };
    let train = one(spec.clone())?;
    let heldout = match heldout {
        Some(path) => Some(one(DatasetSpec { path, ..spec })?),
        None => None,
    };
    Ok(RunData::Files { train, heldout })
}

fn llm_vocab(graph: &ModelGraph) -> usize {
    graph
        .modules
        .iter()
        .find_map(|m| match m.spec {
            ModuleSpec::Llama { vocab, .. } => Some(vocab),
            _ => None,
        })
        .unwrap_or(0)
}

/// The front ends of the graph's encoders.
fn fronts(graph: &ModelGraph) -> Fronts {
    let mut f = Fronts::default();
    for m in &graph.modules {
        let rows = m.rows_per_item().unwrap_or(0);
        match m.spec {
            ModuleSpec::Vit { image_size, .. } => f.image = Some((image_size as u32, rows)),
            ModuleSpec::Audio { n_mels, frames } => f.audio = Some((n_mels, frames, rows)),
            ModuleSpec::Llama { .. } => {}
        }
    }
    f
}
