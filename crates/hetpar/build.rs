//! Names the build: the git commit the binary was built from (`HETPAR_BUILD`, "unknown"
//! outside a git checkout of hetpar), with `+` and 12 hex digits of a SHA-256 of the
//! uncommitted changes to what the program is built from when there are any (the sources,
//! manifests, lock file and built-in examples: each changed tracked file and each untracked
//! `.rs` or `.toml` file there, by name and content; `+unknown` where git cannot say), for
//! `hetpar --version` and for the processes of an MPI job to check they run the same
//! program: two hosts on one commit with different local edits differ, and identical trees
//! name alike whatever git's configuration.

// A build script speaks to cargo on stdout.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

/// What the program is built from, relative to the repository's root.
const SOURCES: [&str; 4] = ["crates", "Cargo.toml", "Cargo.lock", "examples"];

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| o.stdout)
    };
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).trim().to_string();
    // Only a checkout of hetpar itself names the build (not an enclosing repository of a
    // vendored or packaged copy).
    let top = git(&["rev-parse", "--show-toplevel"]).map(text);
    let ours =
        top.is_some_and(|t| std::fs::canonicalize(t).ok() == std::fs::canonicalize(&root).ok());
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).map(text).filter(|_| ours);
    let build = match commit {
        None => "unknown".to_string(),
        Some(commit) => match edits(&git, &root) {
            Some(None) => commit,
            Some(Some(hash)) => format!("{commit}+{hash}"),
            None => format!("{commit}+unknown"),
        },
    };
    println!("cargo:rustc-env=HETPAR_BUILD={build}");
    // A commit, checkout or reset moves HEAD and appends to its log; an edit anywhere in
    // the sources changes the name too.
    match git(&["rev-parse", "--absolute-git-dir"]).map(text).filter(|_| ours) {
        Some(dir) => {
            println!("cargo:rerun-if-changed={dir}/HEAD");
            println!("cargo:rerun-if-changed={dir}/logs/HEAD");
            println!("cargo:rerun-if-changed={dir}/index");
            for path in SOURCES {
                println!("cargo:rerun-if-changed={}", root.join(path).display());
            }
        }
        None => println!("cargo:rerun-if-changed=build.rs"),
    }
}

/// 12 hex digits of a SHA-256 over the uncommitted changes to `SOURCES` (`Some(None)` when
/// there are none, `None` when git cannot list them): every changed tracked file and every
/// untracked `.rs` or `.toml` file, by its name and content (or a mark where it was
/// deleted), each length-prefixed.
fn edits(git: &dyn Fn(&[&str]) -> Option<Vec<u8>>, root: &Path) -> Option<Option<String>> {
    let list = |args: &[&str]| -> Option<Vec<String>> {
        let out = git(&[args, &["--"][..], &SOURCES].concat())?;
        Some(
            out.split(|&b| b == 0)
                .filter(|n| !n.is_empty())
                .map(|n| String::from_utf8_lossy(n).into_owned())
                .collect(),
        )
    };
    let mut names = list(&["diff", "HEAD", "--name-only", "-z", "--no-renames"])?;
    let untracked = list(&["ls-files", "--others", "--exclude-standard", "-z"])?;
    names.extend(untracked.into_iter().filter(|n| n.ends_with(".rs") || n.ends_with(".toml")));
    if names.is_empty() {
        return Some(None);
    }
    names.sort();
    names.dedup();
    let mut h = Sha256::new();
    for name in &names {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        match std::fs::read(root.join(name)) {
            Ok(bytes) => {
                h.update((bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
            Err(_) => h.update(u64::MAX.to_le_bytes()),
        }
    }
    Some(Some(h.finalize()[..6].iter().map(|b| format!("{b:02x}")).collect()))
}
