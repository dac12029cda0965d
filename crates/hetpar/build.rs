//! Names the build: the git commit the binary was built from (`HETPAR_BUILD`, "unknown"
//! outside a git checkout), with `+` and 12 hex digits of a SHA-256 of the uncommitted
//! changes to what the program is built from when there are any (the sources, manifests,
//! lock file and built-in examples: tracked files' diff, untracked files' names and
//! contents), for `hetpar --version` and for the processes of an MPI job to check they run
//! the same program: two hosts on one commit with different local edits differ.

// A build script speaks to cargo on stdout.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

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
    // What the program is built from.
    const SOURCES: [&str; 4] = ["crates", "Cargo.toml", "Cargo.lock", "examples"];
    let build = match git(&["rev-parse", "--short=12", "HEAD"]).map(text) {
        None => "unknown".to_string(),
        Some(commit) => {
            let mut edits = Sha256::new();
            let mut edited = false;
            if let Some(diff) = git(&[&["diff", "HEAD", "--binary", "--"][..], &SOURCES].concat()) {
                edited |= !diff.is_empty();
                edits.update(&diff);
            }
            let others =
                git(&[&["ls-files", "--others", "--exclude-standard", "-z", "--"][..], &SOURCES]
                    .concat());
            for name in others.iter().flat_map(|o| o.split(|&b| b == 0)).filter(|n| !n.is_empty()) {
                edited = true;
                edits.update(name);
                edits.update(
                    std::fs::read(root.join(String::from_utf8_lossy(name).as_ref()))
                        .unwrap_or_default(),
                );
            }
            if edited {
                let digest: String =
                    edits.finalize()[..6].iter().map(|b| format!("{b:02x}")).collect();
                format!("{commit}+{digest}")
            } else {
                commit
            }
        }
    };
    println!("cargo:rustc-env=HETPAR_BUILD={build}");
    // A commit, checkout or reset moves HEAD and appends to its log; an edit anywhere in
    // the sources changes the name too.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]).map(text) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/logs/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
        for path in SOURCES {
            println!("cargo:rerun-if-changed={}", root.join(path).display());
        }
    } else {
        println!("cargo:rerun-if-changed=build.rs");
    }
}
