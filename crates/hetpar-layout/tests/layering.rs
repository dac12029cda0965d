//! The crate's modules depend on each other one way (ARCHITECTURE.md): the vocabulary
//! (`axis`, `edge`, `error`) first, then layouts, config, the graph, manifests, geometry,
//! plans and reports. This reads every source file's `crate::` paths (comments aside) and
//! fails on a cycle, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module of a source file: `src/plan/exact.rs` -> `plan`.
fn module_of(path: &Path, src: &Path) -> String {
    let rel = path.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a component");
    first.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).expect("readable") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn ident(s: &str) -> String {
    s.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect()
}

/// Modules named after `crate::` outside comments, grouped imports (`crate::{a::X, b}`)
/// included.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let code: String =
        text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    let mut out = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(inner.split(',').map(ident).filter(|n| !n.is_empty()));
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                out.insert(name);
            }
        }
    }
    out
}

#[test]
fn grouped_imports_are_read() {
    let refs = crate_refs(
        "use crate::{graph::ModelGraph,\n    plan::Op};\nuse crate::edge::Strategy; // crate::manifest\n",
    );
    assert_eq!(refs.into_iter().collect::<Vec<_>>(), ["edge", "graph", "plan"]);
}

#[test]
fn modules_depend_on_each_other_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let m = module_of(f, &src);
        if m == "lib" {
            continue;
        }
        let text = std::fs::read_to_string(f).expect("readable");
        let entry = deps.entry(m.clone()).or_default();
        entry.extend(crate_refs(&text).into_iter().filter(|d| *d != m));
    }
    assert!(deps.len() >= 10, "found modules {:?}", deps.keys());
    // Depth-first search for a back edge.
    fn visit(
        m: &str,
        deps: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(m) {
            Some(2) => return None,
            Some(1) => {
                let i = path.iter().position(|p| p == m).expect("on the path");
                let mut cycle = path[i..].to_vec();
                cycle.push(m.to_string());
                return Some(cycle);
            }
            _ => {}
        }
        state.insert(m.to_string(), 1);
        path.push(m.to_string());
        for d in deps.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, deps, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in deps.keys() {
        if let Some(cycle) = visit(m, &deps, &mut state, &mut Vec::new()) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
    // The vocabulary imports nothing of the crate.
    for vocab in ["axis", "edge", "error"] {
        assert!(deps[vocab].is_empty(), "{vocab} depends on {:?}", deps[vocab]);
    }
}
