//! Checkpoints (SEMANTICS.md section 8): every parameter and both AdamW moments in global
//! coordinates, so a checkpoint loads under any other layout and placement.
//!
//! Layout on disk, under the run's `checkpoints/` directory:
//!
//! ```text
//! step-00000010/manifest.json              what was saved, how, and each file's SHA-256
//! step-00000010/llm.stage0.safetensors     full tensors of one pipeline stage of a module:
//!                                          parameters under their HF names, moments under
//!                                          NAME:exp_avg and NAME:exp_avg_sq
//! latest                                   the name of the newest committed checkpoint
//! ```
//!
//! Commit protocol: rank 0 makes a temporary directory; the first rank of each module's
//! pipeline stage writes its file, taking the stage's slices one tensor at a time (one
//! replica's copy of each), hashing as it writes, and fsyncs it; every rank reports (a
//! job-wide sum of failures) and the writers' hashes reach rank 0, which writes and fsyncs
//! the manifest, renames the directory into place, fsyncs the parent, and replaces `latest`
//! last (write, fsync, rename). A checkpoint without a manifest is never visible under its
//! final name, so a crash at any point leaves the previous one as `latest`.
//!
//! Loading reads only JSON and safetensors: the SHA-256 of every file some rank will read
//! is checked against the manifest (once per machine, by one of the ranks there reading
//! it), and the saved model against the rank's own, before any tensor is used; then each
//! rank reads only its own slices.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use candle_core::{Tensor, Var};
use hetpar_comm::{CommExt, Communicator, ReduceOp};
use hetpar_data::files::{open_regular, read_regular, read_regular_text};
use hetpar_layout::ModelGraph;
use hetpar_nn::Param;
use hetpar_nn::io::{Reader, save_sharded};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::RuntimeError;
use crate::executor::Executor;
use crate::optim::AdamState;

type Result<T> = std::result::Result<T, RuntimeError>;

/// The manifest's format tag: version 2 manifests carry their own SHA-256
/// ([`Manifest::sha256`]).
pub const FORMAT: &str = "hetpar-checkpoint/2";

/// The first format, without the manifest's own checksum: still read (its files are checked
/// as before; an edit to the manifest itself goes unseen).
pub const FORMAT_1: &str = "hetpar-checkpoint/1";

/// The run's resolved config, saved next to the tensors (what `hetpar export` reads).
pub const CONFIG_FILE: &str = "config.toml";

/// A checkpoint's manifest ([`Manifest`]), in its directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// One file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub file: String,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
    /// Its length.
    pub bytes: u64,
    /// The tensors it holds.
    pub tensors: Vec<String>,
}

/// How a module was laid out when saved (for the message a resume prints).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// Module name.
    pub module: String,
    /// `[start, end)` of its ranks.
    pub ranks: [usize; 2],
    /// Its layout, `tp2 cp1 dp2 pp1` and the like.
    pub layout: String,
    /// AdamW updates applied to it (0 for a frozen module).
    pub adam_steps: u64,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT`].
    pub format: String,
    /// Run name.
    pub name: String,
    /// Steps completed: a resume runs step `step` next (the data position and the
    /// learning-rate schedule follow from it).
    pub step: usize,
    /// Steps skipped for non-finite gradients so far.
    pub skipped: usize,
    /// Steps of the learning-rate schedule the run followed (its total).
    pub schedule_steps: usize,
    /// Element type of the tensors.
    pub dtype: String,
    /// Each module's layout when saved.
    pub modules: Vec<SavedLayout>,
    /// Model sizes of each module as the config gave them (`kind hidden layers heads ffn`),
    /// which a resume must match.
    pub model: BTreeMap<String, String>,
    /// The files.
    pub files: Vec<FileEntry>,
    /// SHA-256 of the tokenizer file the run's data read, hex: a resume or an evaluation
    /// with another tokenizer is refused even where the file at the same path was
    /// replaced. Absent for in-process tokens and in checkpoints saved before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer_sha256: Option<String>,
    /// SHA-256 of this manifest as `save_checkpoint` writes it (pretty JSON) with this field
    /// empty, hex: an edit to the manifest, not only to the files it lists, is refused.
    #[serde(default)]
    pub sha256: String,
}

impl Manifest {
    /// The manifest's own checksum ([`Manifest::sha256`]).
    fn own_sha256(&self) -> std::result::Result<String, serde_json::Error> {
        let blank = Manifest { sha256: String::new(), ..self.clone() };
        Ok(hex(&Sha256::digest(serde_json::to_vec_pretty(&blank)?)))
    }
}

/// The manifest's name of a tensor type (`f32`, `f64`).
fn tensor_type(dtype: candle_core::DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

/// `bytes` in lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a resume loaded.
#[derive(Clone, Debug, PartialEq)]
pub struct Loaded {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Bytes this rank read.
    pub bytes_read: u64,
    /// Bytes of checkpoint files this rank hashed for the others on its machine and itself.
    pub bytes_checked: u64,
}

fn io(path: &Path, e: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Model(format!("checkpoint {}: {e}", path.display()))
}

/// The checkpoint directory name of `step` steps done.
pub fn dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

/// What a resume must match: each module's kind and sizes.
fn model_of(graph: &ModelGraph) -> BTreeMap<String, String> {
    graph
        .modules
        .iter()
        .map(|m| {
            let d = m.dims;
            (
                m.name.clone(),
                format!("{:?} {} {} {} {}", m.spec, d.hidden, d.layers, d.heads, d.ffn),
            )
        })
        .collect()
}

/// How module `name`'s sizes in the checkpoint (`saved`) and the config differ, each as
/// [`model_of`] writes them: field by field where both read as the same kind, else whole.
fn model_difference(name: &str, saved: &str, config: &str) -> String {
    let said = match (labeled(saved), labeled(config)) {
        (Some((ka, a)), Some((kb, b))) if ka == kb && a.len() == b.len() => a
            .iter()
            .zip(&b)
            .filter(|(x, y)| x != y)
            .map(|((k, x), (_, y))| format!("{k} {x} in the checkpoint, {y} in the config"))
            .collect(),
        _ => vec![format!("{saved} in the checkpoint, {config} in the config")],
    };
    format!("{name}: {}", said.join(", "))
}

/// A module's sizes as [`model_of`] writes them (`Llama { vocab: 256, top_k: 0 } 96 4 6
/// 192`): its kind, then each value by name, the spec's fields before hidden, layers,
/// heads and ffn.
fn labeled(sizes: &str) -> Option<(&str, Vec<(&str, &str)>)> {
    let (kind, rest) = sizes.split_once(" { ")?;
    let (fields, dims) = rest.split_once(" } ")?;
    let mut out: Vec<(&str, &str)> =
        fields.split(", ").map(|f| f.split_once(": ")).collect::<Option<_>>()?;
    let dims: Vec<&str> = dims.split(' ').collect();
    if dims.len() != 4 {
        return None;
    }
    out.extend(["hidden", "layers", "heads", "ffn"].into_iter().zip(dims));
    Some((kind, out))
}

fn layout_name(l: &hetpar_layout::ModuleLayout) -> String {
    format!("tp{} cp{} dp{} pp{} ep{}", l.tp(), l.cp(), l.dp(), l.pp(), l.ep())
}

/// A moment tensor of `p` as a parameter with `p`'s shard spec (for gathering and naming).
fn moment(p: &Param, suffix: &str, t: &Tensor) -> Result<Param> {
    Ok(Param {
        name: format!("{}:{suffix}", p.name),
        var: Var::from_tensor(t)?,
        spec: p.spec.clone(),
        sink: Default::default(),
    })
}

/// SHA-256 of a file, hex, and its length; a regular file only (a device in its place
/// would never end, a FIFO never answer).
pub fn sha256(path: &Path) -> Result<(String, u64)> {
    let mut f = open_regular(path).map_err(|e| io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| io(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex(&h.finalize()), n))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io(dir, e))
}

/// Rank 0's failure (`failed`, its message; `None` elsewhere and on success) as the same
/// error on every rank of `world`, so whichever rank reports first says why.
fn rank0_outcome(world: &dyn Communicator, path: &Path, failed: Option<String>) -> Result<()> {
    let text = failed.unwrap_or_default().into_bytes();
    let mut len = [text.len() as i64];
    world.broadcast(&mut len, 0)?;
    if len[0] == 0 {
        return Ok(());
    }
    let mut bytes = if world.rank() == 0 { text } else { vec![0u8; len[0] as usize] };
    world.broadcast_bytes(&mut bytes, 0)?;
    Err(io(path, String::from_utf8_lossy(&bytes)))
}

/// Checks that every rank of `world` sees `root` as rank 0 does, before a run whose
/// checkpoints go there: a checkpoint's files are written by several ranks into the
/// directory rank 0 creates and are hashed and committed by rank 0, and a resume reads them
/// on every rank, so `root` must be on a filesystem every process mounts. Rank 0 writes a
/// probe file holding a fresh token and every rank reads it back; ranks that cannot are
/// named in the same error on every rank. Every rank of `world` calls it.
pub fn check_shared(world: &dyn Communicator, root: &Path) -> Result<()> {
    let me = world.global_rank();
    let mut token = [0i64];
    let mut failed = None;
    if me == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        // Fresh per job: a probe left by another job (or host) does not pass.
        token[0] = ((nanos as i64) ^ (i64::from(std::process::id()) << 32)) & i64::MAX;
        let probe = root.join(format!(".shared-{}", token[0]));
        let wrote = std::fs::create_dir_all(root).and_then(|()| {
            let mut f = File::create(&probe)?;
            f.write_all(token[0].to_string().as_bytes())?;
            f.sync_all()
        });
        if let Err(e) = wrote {
            failed = Some(format!("rank 0 cannot write there: {e}"));
        }
    }
    rank0_outcome(world, root, failed)?;
    world.broadcast(&mut token, 0)?;
    let probe = root.join(format!(".shared-{}", token[0]));
    let seen = std::fs::read_to_string(&probe).is_ok_and(|t| t == token[0].to_string());
    let mut blind = vec![0i64; world.size()];
    world.all_gather(&[i64::from(!seen)], &mut blind)?;
    if me == 0 {
        // Every rank has read it: the gather above is the last use.
        let _ = std::fs::remove_file(&probe);
    }
    let blind: Vec<usize> = (0..blind.len()).filter(|&r| blind[r] != 0).collect();
    if blind.is_empty() {
        return Ok(());
    }
    Err(io(
        root,
        format!(
            "rank 0 wrote a file there and rank(s) {} do not see it: checkpoints need a directory every process mounts (a shared filesystem); point --out at one",
            hetpar_layout::plan::rank_list(&blind)
        ),
    ))
}

/// Where and how to save.
#[derive(Clone, Copy, Debug)]
pub struct SaveAt<'a> {
    /// `OUT/checkpoints`.
    pub root: &'a Path,
    /// Steps done.
    pub step: usize,
    /// Steps of the run's learning-rate schedule.
    pub schedule_steps: usize,
    /// Newest checkpoints kept (0: all).
    pub keep: usize,
    /// The run's resolved config (TOML), saved as [`CONFIG_FILE`].
    pub config: Option<&'a str>,
    /// SHA-256 of the tokenizer the run's data read ([`Manifest::tokenizer_sha256`]).
    pub tokenizer_sha256: Option<&'a str>,
}

/// A committed checkpoint, as every rank learns of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    /// The committed directory.
    pub dir: PathBuf,
    /// Tensor files written (one per module and pipeline stage).
    pub files: usize,
    /// Their bytes together.
    pub bytes: u64,
}

/// Saves `exec`'s state after `at.step` steps under `at.root`, every rank of the job
/// calling it; returns the committed directory and what its writers wrote.
pub fn save_checkpoint(
    world: &dyn Communicator,
    graph: &ModelGraph,
    exec: &Executor,
    at: SaveAt<'_>,
) -> Result<Saved> {
    let (step, root) = (at.step, at.root);
    let me = world.global_rank();
    let name = dir_name(step);
    let tmp = root.join(format!(".tmp-{name}"));
    let done = root.join(&name);
    let mut failed = None;
    if me == 0 {
        let made =
            std::fs::create_dir_all(root).and_then(|()| match std::fs::remove_dir_all(&tmp) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => std::fs::create_dir_all(&tmp),
            });
        if let Err(e) = made {
            failed = Some(format!("rank 0 could not create the directory: {e}"));
        }
    }
    rank0_outcome(world, &tmp, failed)?;
    // Each stage of each module: its first rank writes the full tensors, streaming them
    // from the stage's ranks, and hashes the file as it writes it.
    let mut mine: Result<()> = Ok(());
    let mut wrote: Vec<FileEntry> = Vec::new();
    for (i, s) in exec.stages().iter().enumerate() {
        let params = s.params();
        let state = exec.state(i);
        let mut all: Vec<Param> = Vec::new();
        if !state.m.is_empty() {
            for (k, p) in params.iter().enumerate() {
                all.push(moment(p, "exp_avg", &state.m[k])?);
                all.push(moment(p, "exp_avg_sq", &state.v[k])?);
            }
        }
        let mut refs: Vec<&Param> = params.clone();
        refs.extend(all.iter());
        let file = format!("{}.stage{}.safetensors", s.ctx().layout.name(), s.ctx().coords.pp_idx);
        let comm = s.ctx().stage.comm().map(|c| c.as_ref());
        match save_sharded(comm, &refs, &tmp.join(&file)) {
            Ok(Some(w)) => {
                wrote.push(FileEntry {
                    file,
                    sha256: w.sha256,
                    bytes: w.bytes,
                    tensors: w.tensors,
                });
            }
            Ok(None) => {}
            // A member that stops talking ends the save here.
            Err(e @ hetpar_nn::NnError::Comm(_)) => return Err(e.into()),
            // The others are the same on every member (a plan), or the writer's own.
            Err(e) => {
                if mine.is_ok() {
                    mine = Err(e.into());
                }
            }
        }
    }
    // Every rank reports.
    let mut failed = [if mine.is_err() { 1.0 } else { 0.0 }];
    world.all_reduce(&mut failed, ReduceOp::Sum)?;
    mine?;
    if failed[0] > 0.0 {
        return Err(io(&tmp, format!("{} rank(s) failed to write their files", failed[0])));
    }
    // What each writer wrote, for rank 0's manifest.
    let text = serde_json::to_vec(&wrote).map_err(|e| io(&tmp, e))?;
    let mut files = Vec::new();
    for t in world.all_gather_any(&text)? {
        let theirs: Vec<FileEntry> = serde_json::from_slice(&t).map_err(|e| io(&tmp, e))?;
        files.extend(theirs);
    }
    // Updates applied per module, from the ranks that hold it.
    let mut adam: Vec<f64> = vec![0.0; graph.modules.len()];
    for (i, s) in exec.stages().iter().enumerate() {
        adam[s.module()] = exec.state(i).steps as f64;
    }
    world.all_reduce(&mut adam, ReduceOp::Max)?;
    let written =
        Saved { dir: done.clone(), files: files.len(), bytes: files.iter().map(|f| f.bytes).sum() };
    let committed = if me == 0 {
        let adam: Vec<u64> = adam.iter().map(|&x| x as u64).collect();
        commit(graph, exec, at, &adam, files, &tmp, &done)
    } else {
        Ok(())
    };
    // Every rank returns once rank 0 has committed, or with why it could not.
    let why = committed.as_ref().err().map(|e| format!("rank 0 could not commit it: {e}"));
    let shared = rank0_outcome(world, &done, why);
    committed?;
    shared?;
    Ok(written)
}

/// Rank 0's part: the config, the manifest of the writers' `files`, rename, `latest`,
/// pruning.
fn commit(
    graph: &ModelGraph,
    exec: &Executor,
    at: SaveAt<'_>,
    adam: &[u64],
    mut files: Vec<FileEntry>,
    tmp: &Path,
    done: &Path,
) -> Result<()> {
    let (step, root, keep) = (at.step, at.root, at.keep);
    // Each file as long as its writer wrote it, here too (the files' bytes were hashed as
    // they were written: rank 0 does not read them again).
    for f in &files {
        let path = tmp.join(&f.file);
        let len = std::fs::metadata(&path).map_err(|e| io(&path, e))?.len();
        if len != f.bytes {
            return Err(io(
                &path,
                format!("{len} bytes here, its writer wrote {}: is --out shared?", f.bytes),
            ));
        }
    }
    if let Some(text) = at.config {
        let path = tmp.join(CONFIG_FILE);
        File::create(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
            .map_err(|e| io(&path, e))?;
        let (sha256, bytes) = sha256(&path)?;
        files.push(FileEntry { file: CONFIG_FILE.into(), sha256, bytes, tensors: Vec::new() });
    }
    files.sort_by(|a, b| a.file.cmp(&b.file));
    let manifest = Manifest {
        format: FORMAT.into(),
        name: graph.name.clone(),
        step,
        skipped: exec.skipped(),
        schedule_steps: at.schedule_steps,
        dtype: exec.stages().first().map(|s| tensor_type(s.dtype())).unwrap_or_default(),
        modules: graph
            .modules
            .iter()
            .zip(adam)
            .map(|(m, &adam_steps)| {
                let span = m.layout.span();
                SavedLayout {
                    module: m.name.clone(),
                    ranks: [span.start, span.end],
                    layout: layout_name(&m.layout),
                    adam_steps,
                }
            })
            .collect(),
        model: model_of(graph),
        files,
        tokenizer_sha256: at.tokenizer_sha256.map(str::to_owned),
        sha256: String::new(),
    };
    let path = tmp.join(MANIFEST_FILE);
    let sha256 = manifest.own_sha256().map_err(|e| io(&path, e))?;
    let manifest = Manifest { sha256, ..manifest };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| io(&path, e))?;
    File::create(&path)
        .and_then(|mut f| f.write_all(&text).and_then(|()| f.sync_all()))
        .map_err(|e| io(&path, e))?;
    fsync_dir(tmp)?;
    if done.exists() {
        std::fs::remove_dir_all(done).map_err(|e| io(done, e))?;
    }
    std::fs::rename(tmp, done).map_err(|e| io(done, e))?;
    fsync_dir(root)?;
    let latest = root.join("latest");
    let staged = root.join(".latest.tmp");
    let name = dir_name(step);
    File::create(&staged)
        .and_then(|mut f| f.write_all(name.as_bytes()).and_then(|()| f.sync_all()))
        .map_err(|e| io(&staged, e))?;
    std::fs::rename(&staged, &latest).map_err(|e| io(&latest, e))?;
    fsync_dir(root)?;
    if keep > 0 {
        let mut all = committed(root)?;
        all.sort();
        let drop = all.len().saturating_sub(keep);
        for (s, dir) in all.into_iter().take(drop) {
            if s != step {
                std::fs::remove_dir_all(&dir).map_err(|e| io(&dir, e))?;
            }
        }
    }
    Ok(())
}

/// Committed checkpoints under `root` (directories with a manifest), by step.
pub fn committed(root: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let Ok(rd) = std::fs::read_dir(root) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if let Some(s) = n.strip_prefix("step-").and_then(|s| s.parse::<usize>().ok())
            && e.path().join(MANIFEST_FILE).is_file()
        {
            out.push((s, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// The checkpoint to resume under `root`: the one `latest` names, or, where `latest` is
/// missing or names a directory without a manifest (a crash between committing a step and
/// moving `latest`, or while replacing a step), the newest committed one; `None` when
/// there is none.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    Ok(latest_noted(root)?.0)
}

/// [`latest`], with a note where `latest` names something else than the checkpoint taken:
/// a directory that is not a committed checkpoint (a crash while committing, or a manifest
/// removed since), or a path that is not a checkpoint's name in `root` (only a
/// `step-NNNNNNNN` there is taken); or where it is missing beside committed checkpoints.
pub fn latest_noted(root: &Path) -> Result<(Option<PathBuf>, Option<String>)> {
    let path = root.join("latest");
    // What `latest` says where it names no committed checkpoint: the name, or why none.
    let named = match read_regular(&path) {
        Ok(bytes) => {
            // A name that is not UTF-8 is no checkpoint's (theirs are `step-NNNNNNNN`).
            let name = String::from_utf8_lossy(&bytes).trim().to_string();
            let plain = name.starts_with("step-") && !name.contains(['/', '\\']);
            let dir = root.join(&name);
            if plain && dir.join(MANIFEST_FILE).is_file() {
                return Ok((Some(dir), None));
            }
            Some((format!("names {name:?}"), plain))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        // A directory, a device or a FIFO in its place.
        Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => Some((format!("is {e}"), false)),
        Err(e) => return Err(io(&path, e)),
    };
    let newest = committed(root)?.pop().map(|c| c.1);
    let note = match named {
        None => newest.as_ref().map(|d| {
            format!(
                "{} is missing (removed, or a crash before it was written); the newest committed checkpoint is {}",
                path.display(),
                d.display()
            )
        }),
        Some((says, plain)) => {
            let why = if plain {
                ", which is not a committed checkpoint (no manifest.json)"
            } else if says.starts_with("names") {
                ", which is not the name of a checkpoint in this directory"
            } else {
                ""
            };
            let then = match &newest {
                Some(d) => format!("the newest committed one is {}", d.display()),
                None => "and no other is committed".to_string(),
            };
            Some(format!("{} {says}{why}; {then}", path.display()))
        }
    };
    Ok((newest, note))
}

/// Reads `dir/manifest.json` and checks what it says of itself: its format, its own
/// checksum, its counts and that its file names stay inside the checkpoint.
fn parse_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    let text = read_regular(&path).map_err(|e| io(&path, e))?;
    let m: Manifest = serde_json::from_slice(&text)
        .map_err(|e| io(&path, format!("not a valid manifest: {e}")))?;
    if m.format == FORMAT {
        let own = m.own_sha256().map_err(|e| io(&path, e))?;
        if m.sha256 != own {
            return Err(io(
                &path,
                format!(
                    "its content hashes to SHA-256 {own}, the manifest says {:?}: it was edited or is corrupt",
                    m.sha256
                ),
            ));
        }
    } else if m.format != FORMAT_1 {
        return Err(io(
            &path,
            format!("format {:?}, this hetpar reads {FORMAT:?} and {FORMAT_1:?}", m.format),
        ));
    } else if !m.sha256.is_empty() {
        // The first format had no checksum of its own: one that carries it is a second-
        // format manifest whose format was edited, which would leave its content unchecked.
        return Err(io(
            &path,
            format!(
                "it says format {FORMAT_1:?} but carries {FORMAT:?}'s own SHA-256: its format was edited or is corrupt"
            ),
        ));
    }
    if m.skipped > m.step {
        return Err(io(&path, format!("{} steps skipped of {} done", m.skipped, m.step)));
    }
    for f in &m.files {
        if f.file.is_empty() || f.file.contains(['/', '\\']) || f.file.starts_with('.') {
            return Err(io(
                &path,
                format!("file {:?} is not a name inside the checkpoint", f.file),
            ));
        }
    }
    Ok(m)
}

/// The run's config as checkpoint `dir` saved it (TOML text), checked against the
/// manifest's SHA-256 before anything reads it: an edited or damaged config would otherwise
/// train, evaluate or export another model's settings under the checkpoint's name.
/// `None` where the checkpoint holds no config and its manifest lists none.
pub fn saved_config(dir: &Path) -> Result<Option<String>> {
    let m = parse_manifest(dir)?;
    let path = dir.join(CONFIG_FILE);
    let Some(entry) = m.files.iter().find(|f| f.file == CONFIG_FILE) else {
        // A manifest that lists no config (an older checkpoint's): the file as it is.
        return match read_regular_text(&path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path, e)),
        };
    };
    // A regular file, of the size the manifest says, before it is read at all (a device
    // would never end); then read once: the text returned is the text hashed.
    let mut file = open_regular(&path).map_err(|e| io(&path, e))?;
    let len = file.metadata().map_err(|e| io(&path, e))?.len();
    let mut text = Vec::new();
    if len == entry.bytes {
        file.read_to_end(&mut text).map_err(|e| io(&path, e))?;
    }
    let hash = hex(&Sha256::digest(&text));
    let differs = if len != entry.bytes || text.len() as u64 != len {
        format!("{len} bytes where the manifest says {}", entry.bytes)
    } else if hash != entry.sha256 {
        format!("SHA-256 {hash} where the manifest says {}", entry.sha256)
    } else {
        return String::from_utf8(text).map(Some).map_err(|e| io(&path, e));
    };
    Err(io(&path, format!("{differs}: it was edited or is corrupt")))
}

/// Reads and checks `dir/manifest.json`: its format, its own checksum, that its counts,
/// modules and file names are consistent, that a `step-N` directory holds step N, and that
/// it describes `graph`'s model.
pub fn read_manifest(dir: &Path, graph: &ModelGraph) -> Result<Manifest> {
    let m = parse_manifest(dir)?;
    let path = dir.join(MANIFEST_FILE);
    // A `step-N` directory is taken for step N where checkpoints are listed (`--resume
    // auto`, `--keep`, moving a later branch aside): its manifest must say the same.
    let named = dir.file_name().and_then(|n| n.to_str()?.strip_prefix("step-")?.parse().ok());
    if let Some(named) = named.filter(|&n: &usize| n != m.step) {
        return Err(io(
            &path,
            format!(
                "it is the checkpoint after step {}, but its directory is named for step {named}: rename the directory {} (checkpoints are listed by their directories' names)",
                m.step,
                dir_name(m.step)
            ),
        ));
    }
    let saved: Vec<&str> = m.modules.iter().map(|s| s.module.as_str()).collect();
    let mut config: Vec<&str> = graph.modules.iter().map(|g| g.name.as_str()).collect();
    let mut sorted = saved.clone();
    sorted.sort_unstable();
    config.sort_unstable();
    if sorted != config {
        return Err(io(
            &path,
            format!("its modules are [{}], the config's [{}]", saved.join(", "), config.join(", ")),
        ));
    }
    let want = model_of(graph);
    if m.model != want {
        let differ: Vec<String> = want
            .iter()
            .filter(|(k, v)| m.model.get(*k) != Some(v))
            .map(|(k, v)| match m.model.get(k) {
                Some(saved) => model_difference(k, saved, v),
                None => format!("{k}: no sizes in the checkpoint"),
            })
            .collect();
        return Err(io(&path, format!("saved for another model: {}", differ.join("; "))));
    }
    Ok(m)
}

/// Checks every file some rank of `world` needs (`need`, this rank's) against the
/// manifest's SHA-256, before anything is loaded, reading each file once per machine: the
/// ranks reporting the same `machine` (a boot id; empty: unknown, a machine of its own) see
/// one filesystem, so the files their ranks need are shared out among those ranks, each
/// hashed by one of them. A failure anywhere fails every rank, each naming the file (and
/// the rank that found it). Returns the bytes this rank hashed.
fn verify(
    world: &dyn Communicator,
    dir: &Path,
    need: &BTreeMap<&str, &FileEntry>,
    machine: &str,
) -> Result<u64> {
    #[derive(Serialize, Deserialize)]
    struct Needs {
        machine: String,
        files: Vec<String>,
    }
    let me = world.rank();
    let mine = Needs {
        machine: if machine.is_empty() { format!("rank {me}") } else { machine.to_string() },
        files: need.keys().map(|f| f.to_string()).collect(),
    };
    let text = serde_json::to_vec(&mine).map_err(|e| io(dir, e))?;
    let all: Vec<Needs> = world
        .all_gather_any(&text)?
        .iter()
        .map(|t| serde_json::from_slice(t).map_err(|e| io(dir, e)))
        .collect::<Result<_>>()?;
    // The files of this machine's ranks, each with the ranks here that need it; the k-th
    // file goes to the (k mod n)-th of those, so the reading is spread over them.
    let mut here: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (r, n) in all.iter().enumerate().filter(|(_, n)| n.machine == all[me].machine) {
        for f in &n.files {
            here.entry(f.as_str()).or_default().push(r);
        }
    }
    let (mut bad, mut checked): (Option<String>, u64) = (None, 0);
    for (k, (name, ranks)) in here.iter().enumerate() {
        if ranks[k % ranks.len()] != me || bad.is_some() {
            continue;
        }
        let f = need[name];
        let path = dir.join(name);
        // A file of another length than the manifest's is corrupt without hashing it (a
        // device in its place would never end).
        let size = std::fs::metadata(&path).map(|m| (m.len(), m.is_file()));
        if let Ok((n, true)) = size
            && n != f.bytes
        {
            let why = format!("{n} bytes, the manifest says {}: the file is corrupt", f.bytes);
            bad = Some(io(&path, why).to_string());
            continue;
        }
        bad = match sha256(&path) {
            Ok((h, n)) if h == f.sha256 && n == f.bytes => {
                checked += n;
                None
            }
            Ok((h, n)) => Some(
                io(
                    &path,
                    format!(
                        "SHA-256 {h} over {n} bytes, the manifest says {} over {}: the file is corrupt",
                        f.sha256, f.bytes
                    ),
                )
                .to_string(),
            ),
            Err(e) => Some(e.to_string()),
        };
    }
    // Every rank agrees before anything is loaded: the first failure, by rank, everywhere.
    let found = world.all_gather_any(bad.unwrap_or_default().as_bytes())?;
    match found.iter().position(|t| !t.is_empty()) {
        None => Ok(checked),
        Some(r) => {
            let why = String::from_utf8_lossy(&found[r]).into_owned();
            Err(RuntimeError::Model(if r == me {
                why
            } else {
                format!("{why} (found by rank {r})")
            }))
        }
    }
}

/// Loads checkpoint `dir` into `exec` (every rank of the job calls it): parameters and
/// moments of this rank's slices under its own layout. Every file some rank reads is
/// checked against the manifest's SHA-256 first, once per machine (see [`verify`]; this
/// rank's `machine`, empty where unknown).
pub fn load_checkpoint(
    world: &dyn Communicator,
    graph: &ModelGraph,
    exec: &mut Executor,
    dir: &Path,
    machine: &str,
) -> Result<Loaded> {
    let manifest = read_manifest(dir, graph)?;
    // A resume continues in the precision it was saved in: converting the tensors would
    // not reproduce the run (RELIABILITY.md rows 1 and 5).
    if let Some(s) = exec.stages().first() {
        let ours = tensor_type(s.dtype());
        if !manifest.dtype.is_empty() && manifest.dtype != ours {
            return Err(io(
                &dir.join(MANIFEST_FILE),
                format!(
                    "the checkpoint holds {} tensors and this run's parameters are {ours}: \
                     a checkpoint loads in the precision it was saved in",
                    manifest.dtype
                ),
            ));
        }
    }
    let mut where_: BTreeMap<&str, &FileEntry> = BTreeMap::new();
    for f in &manifest.files {
        for t in &f.tensors {
            where_.insert(t.as_str(), f);
        }
    }
    // The files this rank needs, verified before any tensor is read.
    let mut need: BTreeMap<&str, &FileEntry> = BTreeMap::new();
    for s in exec.stages() {
        for p in s.params() {
            let f = where_.get(p.name.as_str()).ok_or_else(|| {
                io(dir, format!("no tensor {} in any file of the manifest", p.name))
            })?;
            need.insert(f.file.as_str(), f);
        }
    }
    let checked = verify(world, dir, &need, machine)?;
    let adam: BTreeMap<&str, u64> =
        manifest.modules.iter().map(|m| (m.module.as_str(), m.adam_steps)).collect();
    let mut read = 0;
    // Each file's header read once, however many tensors come from it.
    let mut open: BTreeMap<&str, Reader> = BTreeMap::new();
    for i in 0..exec.stages().len() {
        let s = &exec.stages()[i];
        let module = s.ctx().layout.name().to_string();
        let params = s.params();
        let trains = !exec.state(i).m.is_empty() || params.is_empty();
        let steps = adam
            .get(module.as_str())
            .copied()
            .ok_or_else(|| io(&dir.join(MANIFEST_FILE), format!("no entry for module {module}")))?;
        let mut state = AdamState { m: Vec::new(), v: Vec::new(), steps };
        // A module saved frozen (no update, no moments in its files) that trains now, as
        // when a run unfreezes it: its moments start at zero, as a fresh run's do.
        let mut fresh = false;
        for (j, p) in params.iter().enumerate() {
            let file = where_[p.name.as_str()].file.as_str();
            let path = dir.join(file);
            let reader = match open.entry(file) {
                std::collections::btree_map::Entry::Occupied(r) => r.into_mut(),
                std::collections::btree_map::Entry::Vacant(v) => v.insert(Reader::open(&path)?),
            };
            let dtype = p.tensor().dtype();
            let (t, n) = reader.slice(&p.name, &p.spec, dtype)?;
            p.var.set(&t)?;
            read += n;
            fresh |= j == 0 && trains && steps == 0 && !reader.has(&format!("{}:exp_avg", p.name));
            if trains && !fresh {
                for (suffix, into) in [("exp_avg", &mut state.m), ("exp_avg_sq", &mut state.v)] {
                    let key = format!("{}:{suffix}", p.name);
                    let (t, n) = reader.slice(&key, &p.spec, dtype).map_err(|e| {
                        io(&path, format!("{e} (the optimizer state of a trainable module)"))
                    })?;
                    into.push(t);
                    read += n;
                }
            }
        }
        if trains && !fresh {
            exec.restore_state(i, state)?;
        }
    }
    exec.set_skipped(manifest.skipped);
    Ok(Loaded { dir: dir.to_path_buf(), manifest, bytes_read: read, bytes_checked: checked })
}
