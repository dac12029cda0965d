//! Names the build: the git commit the binary was built from (`HETPAR_BUILD`, "unknown"
//! outside a git checkout), for `hetpar --version` and for the processes of an MPI job to
//! check they run the same program.

// A build script speaks to cargo on stdout.
#![allow(clippy::print_stdout)]

use std::path::Path;
use std::process::Command;

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
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let build = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=HETPAR_BUILD={build}");
    // A commit, checkout or reset moves HEAD and appends to its log.
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/logs/HEAD");
    } else {
        println!("cargo:rerun-if-changed=build.rs");
    }
}
