//! Checkpoints (RELIABILITY.md rows 3-5): saved under a colocated layout and resumed under
//! a non-colocated one with bitwise-equal parameters and optimizer state, and the losses of
//! the uninterrupted run; corrupt checkpoints (a flipped byte, a truncated or missing shard,
//! a bad or edited manifest) refused before any tensor is used, naming the file; an uncommitted
//! directory never visible as `latest`.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use candle_core::DType;
use hetpar_comm::{Communicator, LocalOptions, launch};
use hetpar_layout::config::ParallelConfig;
use hetpar_layout::{Config, ModelGraph};
use hetpar_nn::io::read_header;
use hetpar_runtime::checkpoint::{committed, latest};
use hetpar_runtime::testing::{fault_config, fault_graph};
use hetpar_runtime::{RuntimeError, Sources, Trainer};

const STEPS: usize = 4;

/// A ViT and an LLM at tp2, colocated (`islands = false`: both on ranks 0-1, the encoder
/// at dp2) or on islands (encoder on rank 0, LLM on 1-2), with weight decay on.
fn graph(islands: bool) -> ModelGraph {
    let mut g = fault_graph(islands);
    g.train.weight_decay = 0.1;
    g
}

/// A directory of one test's own, removed with its files when the value drops.
fn temp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(&format!("hetpar-ckpt-{name}-")).tempdir().unwrap()
}

/// Trains `g` from `resume` (or from scratch) up to `STEPS`, saving after each step in
/// `save` under `root`; the losses of the steps run, or the first error.
fn train(
    g: &ModelGraph,
    resume: Option<&Path>,
    save: &[usize],
    root: &Path,
) -> Result<Vec<f64>, String> {
    train_as(DType::F32, g, resume, save, root)
}

/// [`train`] with parameters of `dtype`.
fn train_as(
    dtype: DType,
    g: &ModelGraph,
    resume: Option<&Path>,
    save: &[usize],
    root: &Path,
) -> Result<Vec<f64>, String> {
    let sources = Sources::synthetic(g);
    let out = launch(g.world, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
        let mut t = Trainer::new(c, g, dtype, STEPS, &sources)?;
        let start = match resume {
            Some(dir) => t.resume(c, dir)?.manifest.step,
            None => 0,
        };
        let mut losses = Vec::new();
        if save.contains(&start) && resume.is_some() {
            t.save(c, start, root, 0)?;
        }
        for s in start..STEPS {
            losses.push(t.step(c, s)?.report.loss);
            if save.contains(&(s + 1)) {
                t.save(c, s + 1, root, 0)?;
            }
        }
        Ok::<_, RuntimeError>(losses)
    })
    .map_err(|e| e.to_string())?;
    let mut first = None;
    for r in out {
        match r {
            Ok(l) => first = first.or(Some(l)),
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(first.unwrap())
}

/// Every tensor of every file of checkpoint `dir`, as raw bytes by name.
fn tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let (start, entries) = read_header(&p).unwrap();
            for (name, en) in entries {
                let (a, b) = ((start + en.begin) as usize, (start + en.end) as usize);
                out.insert(name, bytes[a..b].to_vec());
            }
        }
    }
    out
}

#[test]
fn a_resume_under_another_layout_continues_bitwise() {
    let root_tmp = temp("layouts");
    let root = root_tmp.path();
    let (a, b) = (graph(false), graph(true));
    let full = train(&a, None, &[2], &root.join("a")).unwrap();
    let saved = root.join("a").join("step-00000002");
    assert_eq!(latest(&root.join("a")).unwrap(), Some(saved.clone()));
    // Under A again: the uninterrupted losses, bit for bit.
    let again = train(&a, Some(&saved), &[], &root.join("a2")).unwrap();
    assert_eq!(again, full[2..].to_vec());
    // Under B (islands): saved again right after loading, every parameter and moment is
    // bitwise what A saved; the losses go on as A's.
    let resumed = train(&b, Some(&saved), &[2], &root.join("b")).unwrap();
    let (x, y) = (tensors(&saved), tensors(&root.join("b").join("step-00000002")));
    assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>());
    assert!(x.keys().any(|k| k.ends_with(":exp_avg_sq")), "the moments are saved");
    for (k, v) in &x {
        assert!(y[k] == *v, "{k} differs after the reshard");
    }
    for (got, want) in resumed.iter().zip(&full[2..]) {
        assert!((got - want).abs() <= 1e-5 * want.abs(), "{resumed:?} vs {full:?}");
    }
}

/// [`fault_config`]'s model with an MoE LLM of four layers (4 experts, top 2, 2 KV heads),
/// the encoder on `vision` and the LLM on `llm` (`[start, end)`) laid out by `parallel`.
fn moe_graph(
    vision: [usize; 2],
    llm: [usize; 2],
    parallel: impl FnOnce(&mut ParallelConfig),
) -> ModelGraph {
    let mut cfg = Config::from_toml(&fault_config(false)).unwrap();
    cfg.train.weight_decay = 0.1;
    cfg.modules.get_mut("vision").unwrap().parallel.ranks = vision;
    let m = cfg.modules.get_mut("llm").unwrap();
    (m.layers, m.kv_heads, m.experts, m.top_k) = (4, Some(2), Some(4), Some(2));
    m.parallel = ParallelConfig { ranks: llm, tp: 1, ..m.parallel.clone() };
    parallel(&mut m.parallel);
    ModelGraph::from_config(&cfg).unwrap()
}

/// RELIABILITY row 5 for the axes the ViT-and-tp test above leaves out: an MoE checkpoint
/// saved under expert and tensor parallelism with SP reloads under a two-stage pipeline on
/// islands, an interleaved one, context parallelism, and experts that the tensor
/// parallelism around them does not split (etp 1 under tp 2); each saves again right after
/// loading every parameter and moment bitwise as saved, and the losses go on as the
/// uninterrupted run's.
#[test]
fn an_moe_checkpoint_reshards_across_ep_etp_pp_vpp_and_cp() {
    let root_tmp = temp("moe-layouts");
    let root = root_tmp.path();
    let a = moe_graph([0, 4], [0, 4], |p| (p.ep, p.tp, p.sp) = (2, 2, true));
    let full = train(&a, None, &[2], &root.join("a")).unwrap();
    let saved = root.join("a").join("step-00000002");
    let x = tensors(&saved);
    assert!(
        x.keys().any(|k| k.contains("experts.3.w2") && k.ends_with(":exp_avg")),
        "{:?}",
        x.keys()
    );
    for (name, b) in [
        ("pp2-islands", moe_graph([0, 1], [1, 5], |p| p.pp = 2)),
        ("pp2-vpp2", moe_graph([0, 2], [0, 2], |p| (p.pp, p.vpp) = (2, 2))),
        ("cp2-ep2", moe_graph([0, 4], [0, 4], |p| (p.cp, p.ep) = (2, 2))),
        ("tp2-etp1-ep2", moe_graph([0, 4], [0, 4], |p| (p.tp, p.etp, p.ep) = (2, Some(1), 2))),
    ] {
        let resumed = train(&b, Some(&saved), &[2], &root.join(name)).unwrap();
        let y = tensors(&root.join(name).join("step-00000002"));
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "{name}");
        for (k, v) in &x {
            assert!(y[k] == *v, "{name}: {k} differs after the reshard");
        }
        for (got, want) in resumed.iter().zip(&full[2..]) {
            assert!((got - want).abs() <= 1e-5 * want.abs(), "{name}: {resumed:?} vs {full:?}");
        }
    }
}

/// A checkpoint of another model is refused naming the module and the sizes that differ,
/// before any file is read.
#[test]
fn a_checkpoint_of_another_model_is_refused_naming_the_sizes() {
    let root_tmp = temp("model");
    let root = root_tmp.path();
    train(&graph(false), None, &[1], root).unwrap();
    let saved = root.join("step-00000001");
    let other = |edit: &dyn Fn(&mut hetpar_layout::config::ModuleConfig)| {
        let mut cfg = Config::from_toml(&fault_config(false)).unwrap();
        edit(cfg.modules.get_mut("llm").unwrap());
        let g = ModelGraph::from_config(&cfg).unwrap();
        hetpar_runtime::checkpoint::read_manifest(&saved, &g).unwrap_err().to_string()
    };
    let e = other(&|m| (m.layers, m.ffn) = (3, 64));
    assert!(
        e.ends_with("saved for another model: llm: layers 2 in the checkpoint, 3 in the config, ffn 48 in the checkpoint, 64 in the config"),
        "{e}"
    );
    let e = other(&|m| (m.kv_heads, m.vocab) = (Some(2), Some(128)));
    assert!(
        e.ends_with("saved for another model: llm: vocab 64 in the checkpoint, 128 in the config, kv_heads 4 in the checkpoint, 2 in the config"),
        "{e}"
    );
}

#[test]
fn a_resume_in_another_precision_is_refused() {
    let root_tmp = temp("precision");
    let root = root_tmp.path();
    let g = graph(false);
    train_as(DType::F64, &g, None, &[1], &root.join("f64")).unwrap();
    let saved = root.join("f64").join("step-00000001");
    let e = train(&g, Some(&saved), &[], &root.join("f32")).unwrap_err();
    assert!(
        e.contains("manifest.json")
            && e.contains("holds f64 tensors and this run's parameters are f32"),
        "{e}"
    );
    // In its own precision it resumes.
    assert_eq!(train_as(DType::F64, &g, Some(&saved), &[], &root.join("again")).unwrap().len(), 3);
}

/// An edit that breaks a checkpoint directory.
type Breaks = Box<dyn Fn(&Path)>;

/// Flips a bit of a byte near the end of `path` (inside the last tensor's data).
fn flip_byte(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let at = b.len() - 10;
    b[at] ^= 0x40;
    std::fs::write(path, b).unwrap();
}

/// A copy of checkpoint `dir` at `to`.
fn copy_of(dir: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to.to_path_buf()
}

/// Rewrites `dir/manifest.json` through `edit` (as JSON values).
fn edit_manifest(dir: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut m);
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// Makes a manifest of the first format, as a build before the manifest's own checksum
/// wrote it: that format, no `sha256` field.
fn first_format(m: &mut serde_json::Value) {
    m["format"] = "hetpar-checkpoint/1".into();
    m.as_object_mut().unwrap().remove("sha256");
}

#[test]
fn corrupt_checkpoints_are_refused_naming_the_file() {
    let root_tmp = temp("corrupt");
    let root = root_tmp.path();
    let g = graph(false);
    train(&g, None, &[2], root).unwrap();
    let good = root.join("step-00000002");
    const SHARD: &str = "llm.stage0.safetensors";
    let cases: Vec<(&str, Breaks, &str)> = vec![
        (
            "flipped byte",
            Box::new(|d: &Path| flip_byte(&d.join(SHARD))),
            "llm.stage0.safetensors: SHA-256",
        ),
        (
            "truncated shard",
            Box::new(|d: &Path| {
                let p = d.join(SHARD);
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
            }),
            "llm.stage0.safetensors: 133324 bytes, the manifest says 266648: the file is corrupt",
        ),
        (
            "missing shard",
            Box::new(|d: &Path| std::fs::remove_file(d.join(SHARD)).unwrap()),
            "llm.stage0.safetensors",
        ),
        (
            "bad manifest",
            Box::new(|d: &Path| std::fs::write(d.join("manifest.json"), "{\"format\": 1").unwrap()),
            "manifest.json: not a valid manifest",
        ),
        (
            "edited manifest",
            // Still valid JSON, one step further: the data position and the learning-rate
            // schedule would shift by a step.
            Box::new(|d: &Path| edit_manifest(d, |m| m["step"] = 3.into())),
            "manifest.json: its content hashes to SHA-256",
        ),
        (
            "edited manifest declaring the first format",
            // An edit that would otherwise go unchecked: the first format had no checksum
            // of its own, and this one still carries the second's.
            Box::new(|d: &Path| {
                edit_manifest(d, |m| {
                    m["format"] = "hetpar-checkpoint/1".into();
                    m["step"] = 3.into();
                })
            }),
            "manifest.json: it says format \"hetpar-checkpoint/1\" but carries \"hetpar-checkpoint/2\"'s own SHA-256",
        ),
        (
            "module missing from a first-format manifest",
            // Format 1 has no checksum of its own; what it says is still checked.
            Box::new(|d: &Path| {
                edit_manifest(d, |m| {
                    first_format(m);
                    m["modules"].as_array_mut().unwrap().remove(0);
                })
            }),
            "manifest.json: its modules are [vision], the config's [llm, vision]",
        ),
        (
            "file outside the checkpoint",
            Box::new(|d: &Path| {
                edit_manifest(d, |m| {
                    first_format(m);
                    m["files"][0]["file"] = "../step-00000002/config.toml".into();
                })
            }),
            "is not a name inside the checkpoint",
        ),
    ];
    for (what, break_it, want) in cases {
        let dir = copy_of(&good, &root.join(format!("broken-{}", what.replace(' ', "-"))));
        break_it(&dir);
        let e = train(&g, Some(&dir), &[], &root.join("none")).unwrap_err();
        assert!(e.contains(want), "{what}: {e}");
    }
}

/// Ranks naming one machine check each file once among them (not each rank every file it
/// reads; ranks on different machines, or naming none, each check theirs): a good
/// checkpoint loads, and a corrupt file is refused on every rank with the file's name,
/// including ranks that did not hash it.
#[test]
fn ranks_on_one_machine_share_the_check_and_all_refuse_a_corrupt_file() {
    let root_tmp = temp("machine");
    let root = root_tmp.path();
    let g = graph(false);
    train(&g, None, &[2], root).unwrap();
    let good = root.join("step-00000002");
    let broken = copy_of(&good, &root.join("broken"));
    flip_byte(&broken.join("llm.stage0.safetensors"));
    let sources = Sources::synthetic(&g);
    // Hashed bytes on each rank, with every rank on `machine(rank)`.
    let resume = |dir: &Path, machine: &(dyn Fn(usize) -> String + Sync)| {
        launch(g.world, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
            let mut t = Trainer::new(c, &g, DType::F32, STEPS, &sources).unwrap();
            t.set_machine(machine(c.rank()));
            t.resume(c, dir).map(|l| (l.manifest.step, l.bytes_checked)).map_err(|e| e.to_string())
        })
        .unwrap()
    };
    let files: u64 = ["llm.stage0.safetensors", "vision.stage0.safetensors"]
        .iter()
        .map(|f| std::fs::metadata(good.join(f)).unwrap().len())
        .sum();
    // Both ranks read both files (the LLM at tp 2, the encoder at dp 2): on one machine
    // each file is hashed once; on two, or unnamed, once per rank.
    let one: Vec<(usize, u64)> =
        resume(&good, &|_| "one".into()).into_iter().map(Result::unwrap).collect();
    assert!(one.iter().all(|l| l.0 == 2));
    assert_eq!(one.iter().map(|l| l.1).sum::<u64>(), files);
    assert!(one.iter().all(|l| l.1 > 0), "{one:?}: the hashing is shared out");
    let per_rank = |r: usize| format!("host {r}");
    let unnamed = |_: usize| String::new();
    let machines: [&(dyn Fn(usize) -> String + Sync); 2] = [&per_rank, &unnamed];
    for machine in machines {
        let each: Vec<u64> = resume(&good, machine).into_iter().map(|l| l.unwrap().1).collect();
        assert_eq!(each, vec![files; 2]);
    }
    for refused in resume(&broken, &|_| "one".into()) {
        let refused = refused.unwrap_err();
        assert!(refused.contains("llm.stage0.safetensors: SHA-256"), "{refused}");
    }
}

#[test]
fn an_uncommitted_checkpoint_is_never_latest() {
    let root_tmp = temp("partial");
    let root = root_tmp.path();
    let g = graph(false);
    train(&g, None, &[1], root).unwrap();
    // A run killed while writing step 3: its temporary directory, shards but no manifest.
    let tmp = root.join(".tmp-step-00000003");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("llm.stage0.safetensors"), b"partial").unwrap();
    assert_eq!(latest(root).unwrap(), Some(root.join("step-00000001")));
    assert_eq!(committed(root).unwrap().iter().map(|c| c.0).collect::<Vec<_>>(), vec![1]);
    // The next save of that step replaces the leftovers and commits.
    let resumed = train(&g, Some(&root.join("step-00000001")), &[3], root).unwrap();
    assert_eq!(resumed.len(), STEPS - 1);
    assert_eq!(latest(root).unwrap(), Some(root.join("step-00000003")));
    assert!(!tmp.exists());
    // `latest` lost or dangling (a crash between the rename and the pointer): the newest
    // committed checkpoint is taken.
    std::fs::write(root.join("latest"), "step-00000009").unwrap();
    assert_eq!(latest(root).unwrap(), Some(root.join("step-00000003")));
    // Said where the pointer names something else: a step without a manifest, or a path
    // out of the directory (another run's checkpoint is not this run's latest).
    let (taken, note) = hetpar_runtime::checkpoint::latest_noted(root).unwrap();
    assert_eq!(taken, Some(root.join("step-00000003")));
    let note = note.expect("a note");
    assert!(
        note.ends_with(&format!(
            "latest names \"step-00000009\", which is not a committed checkpoint (no manifest.json); the newest committed one is {}",
            root.join("step-00000003").display()
        )),
        "{note}"
    );
    std::fs::write(root.join("latest"), "../other/checkpoints/step-00000001").unwrap();
    let (taken, note) = hetpar_runtime::checkpoint::latest_noted(root).unwrap();
    assert_eq!(taken, Some(root.join("step-00000003")));
    assert!(
        note.expect("a note").contains("which is not the name of a checkpoint in this directory")
    );
    std::fs::write(root.join("latest"), "step-00000003\n").unwrap();
    assert_eq!(hetpar_runtime::checkpoint::latest_noted(root).unwrap().1, None);
    std::fs::remove_file(root.join("latest")).unwrap();
    assert_eq!(latest(root).unwrap(), Some(root.join("step-00000003")));
}

/// Checkpoints need a directory every process mounts: a rank whose `OUT` is another
/// directory (as on a host that does not mount rank 0's) is named on every rank before the
/// run; where every rank sees rank 0's directory the probe passes and leaves nothing.
#[test]
fn a_checkpoint_directory_not_every_rank_sees_is_refused() {
    let shared_tmp = temp("shared");
    let shared = shared_tmp.path();
    let own_tmp = temp("own");
    let own = own_tmp.path();
    let opts = || LocalOptions { timeout: Duration::from_secs(20) };
    let ok = launch(3, opts(), |c| hetpar_runtime::checkpoint::check_shared(c, shared)).unwrap();
    assert!(ok.iter().all(Result::is_ok), "{ok:?}");
    assert_eq!(std::fs::read_dir(shared).unwrap().count(), 0, "the probe stays behind");
    let apart = launch(4, opts(), |c| {
        let root = if c.rank() == 2 { &own } else { &shared };
        hetpar_runtime::checkpoint::check_shared(c, root).map_err(|e| e.to_string())
    })
    .unwrap();
    for got in apart {
        let e = got.unwrap_err();
        assert!(
            e.contains(
                "rank(s) 2 do not see it: checkpoints need a directory every process mounts"
            ),
            "{e}"
        );
    }
    // Where rank 0 cannot write, every rank says why (here: a file where a directory goes).
    let file = own.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let blocked = launch(3, opts(), |c| {
        hetpar_runtime::checkpoint::check_shared(c, &file.join("checkpoints"))
            .map_err(|e| e.to_string())
    })
    .unwrap();
    for got in blocked {
        let e = got.unwrap_err();
        assert!(e.contains("rank 0 cannot write there: Not a directory"), "{e}");
    }
}
