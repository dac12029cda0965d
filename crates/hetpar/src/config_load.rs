//! Reading a config: a file or the built-in demo, with `--set KEY=VALUE` overrides applied
//! before validation, so a set value is checked like one written in the file.

use std::path::Path;

use anyhow::{Context, bail};
use hetpar_data::files::read_capped_text;
use hetpar_layout::{Config, ModelGraph};

/// The built-in demo's config.
pub const DEMO: &str = include_str!("../../../examples/demo.toml");

/// The most bytes a config, workload or hardware file may hold: far above any real one (a
/// planner's 16,384-rank config is 1.2 KB), so that a device named in a file's place is
/// refused rather than read into memory.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The config at `path` (the demo when `None`) with `sets` applied, and its graph.
pub fn load(path: Option<&Path>, sets: &[String]) -> anyhow::Result<(Config, ModelGraph)> {
    let (text, name) = match path {
        Some(p) => (
            read_capped_text(p, MAX_CONFIG_BYTES)
                .with_context(|| format!("cannot read config {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (DEMO.to_string(), "the built-in demo".to_string()),
    };
    // A planner workload given to a training command: said as such, not as its first
    // unknown table.
    if let Ok(t) = toml::from_str::<toml::Table>(&text)
        && t.contains_key("workload")
        && !t.contains_key("train")
    {
        bail!(
            "{name}: a planner workload ([workload]), where this command takes a training config ([train], see examples/); `hetpar plan {name} --emit-config FILE` writes one from it"
        );
    }
    load_text(text, name, sets)
}

/// The config `text` (called `name` in errors) with `sets` applied, and its graph.
pub fn load_text(
    text: String,
    name: String,
    sets: &[String],
) -> anyhow::Result<(Config, ModelGraph)> {
    let (cfg, name) = parse_with_sets(&text, &name, sets, |t| {
        Config::from_toml(t).map_err(|e| (e.field, e.message))
    })?;
    let graph = ModelGraph::from_config(&cfg).with_context(|| name)?;
    Ok((cfg, graph))
}

/// The keys `graph`'s config gives that change nothing in how it trains, each with why, for
/// the commands to print as notes: a key that looks like it does something and silently
/// does not is a setting its writer believes in. (Keys that cannot apply at all, such as
/// `ep` on a dense LLM, are refused instead; these are ones a config template or a
/// `--set` may leave behind.)
pub fn idle_keys(graph: &ModelGraph) -> Vec<String> {
    let mut idle = Vec::new();
    let pipes = hetpar_schedule::PipelineGraph::from_model(graph);
    for (i, m) in graph.modules.iter().enumerate() {
        let key = |k: &str| format!("modules.{}.{k}", m.name);
        if let hetpar_layout::ModuleSpec::Llama { experts: 0, top_k: k @ 1.., .. } = m.spec {
            idle.push(format!(
                "{} = {k} has no effect: the LLM is dense (experts = 0)",
                key("top_k")
            ));
        }
        if m.layout.sp() && m.layout.tp() == 1 {
            idle.push(format!(
                "{} = true has no effect at tp 1 (sequence parallelism splits inside tp)",
                key("parallel.sp")
            ));
        }
        if !m.trainable {
            if let Some(lr) = m.lr {
                idle.push(format!(
                    "{} = {lr} has no effect: the module is frozen (trainable = false)",
                    key("lr")
                ));
            }
            if m.recompute && !pipes.has_backward(i) {
                idle.push(format!(
                    "{} = true has no effect: the module is frozen and nothing trainable feeds it, so it runs no backward",
                    key("parallel.recompute")
                ));
            }
        }
    }
    let t = &graph.train;
    if t.on_nonfinite == hetpar_layout::config::OnNonFinite::Stop
        && t.max_skips != hetpar_layout::config::DEFAULT_MAX_SKIPS
    {
        idle.push(format!(
            "train.max_skips = {} has no effect: train.on_nonfinite is \"stop\" (\"skip\" skips)",
            t.max_skips
        ));
    }
    idle
}

/// `text` (called `name`) with `sets` applied, read by `parse` (whose error is where, then
/// what), and the name errors about it go by (`name with --set ...`). A line number in an
/// error is the file's own: where the file alone is refused its error stands as it is, and
/// where only the sets make it fail the error names the table but no line, since the text
/// it would count in has the sets written into it.
pub fn parse_with_sets<T>(
    text: &str,
    name: &str,
    sets: &[String],
    parse: impl Fn(&str) -> Result<T, (String, String)>,
) -> anyhow::Result<(T, String)> {
    let fail = |name: &str, (at, what): (String, String)| match at.as_str() {
        "" => anyhow::anyhow!("{name}: {what}"),
        at => anyhow::anyhow!("{name}: {at}: {what}"),
    };
    if sets.is_empty() {
        return parse(text).map(|t| (t, name.to_string())).map_err(|e| fail(name, e));
    }
    let set = apply(text, sets).with_context(|| name.to_string())?;
    let with = format!("{name} with --set {}", sets.join(" --set "));
    match parse(&set) {
        Ok(t) => Ok((t, with)),
        Err((at, what)) => match parse(text) {
            // The file's own mistake, at its own line.
            Err(own) if own.1 == what => Err(fail(name, own)),
            _ => Err(fail(&with, (without_line(&at).to_string(), what))),
        },
    }
}

/// `at` without the line number `hetpar_layout::config::parse_toml` puts first (`line 33,
/// in [workload]` -> `in [workload]`).
fn without_line(at: &str) -> &str {
    let Some(rest) = at.strip_prefix("line ") else { return at };
    let rest = rest.trim_start_matches(|c: char| c.is_ascii_digit());
    rest.strip_prefix(", ").unwrap_or(rest)
}

/// `text` with each `KEY=VALUE` set: `KEY` a dotted path (`train.lr`,
/// `modules.llm.parallel.tp`), `VALUE` a TOML value (`1e-4`, `true`, `[0, 4]`, `"skip"`)
/// or, when it does not parse as one, a string (`skip`). Configs and planner workloads
/// alike.
/// Whether `value` is written as a TOML number: a sign, digits (with `_`), then a fraction
/// and an exponent, each optional. `2024-05` or `1.2.3` are not (they are strings).
fn looks_like_a_number(value: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit() || c == b'_');
    let unsigned = value.strip_prefix(['+', '-']).unwrap_or(value);
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((m, e)) => (m, Some(e.strip_prefix(['+', '-']).unwrap_or(e))),
        None => (unsigned, None),
    };
    let whole = match mantissa.split_once('.') {
        Some((i, f)) => digits(i) && digits(f),
        None => digits(mantissa),
    };
    whole && exponent.is_none_or(digits)
}

pub fn apply(text: &str, sets: &[String]) -> anyhow::Result<String> {
    let mut root: toml::Table = toml::from_str(text).context("not valid TOML")?;
    for s in sets {
        let Some((key, value)) = s.split_once('=') else {
            bail!("--set {s:?}: write KEY=VALUE, e.g. --set train.lr=1e-4");
        };
        let path: Vec<&str> = key.trim().split('.').collect();
        if path.iter().any(|p| p.is_empty()) {
            bail!("--set {s:?}: {key:?} is not a dotted key such as train.lr");
        }
        let value = value.trim();
        let value = match toml::from_str::<toml::Table>(&format!("v = {value}")) {
            Ok(mut t) => t.remove("v").expect("the key just parsed"),
            // A bare word is a string; what opens an array, a table or a quoted string,
            // or is written as a number (one too large for TOML, say), and does not parse
            // is a mistake, not a string.
            Err(e) if value.starts_with(['[', '{', '"', '\'']) || looks_like_a_number(value) => {
                bail!(
                    "--set {s:?}: {value} is not a TOML value ({})",
                    e.message().trim_end_matches('\n')
                )
            }
            Err(_) => toml::Value::String(value.to_string()),
        };
        // A module's field set under a name the file has no module of is a misspelt
        // module, not a new one (which needs its whole table).
        if let [first, module, _, ..] = path.as_slice()
            && *first == "modules"
            && let Some(toml::Value::Table(modules)) = root.get("modules")
            && !modules.contains_key(*module)
        {
            let names: Vec<&str> = modules.keys().map(String::as_str).collect();
            bail!(
                "--set {s:?}: the config has no module {module:?} (its modules: {}); a new module needs its table in the file",
                names.join(", ")
            );
        }
        let (last, tables) = path.split_last().expect("at least one part");
        let mut at = &mut root;
        let mut i = 0;
        while i < tables.len() {
            let entry = at
                .entry(tables[i].to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            let here = path[..=i].join(".");
            at = match entry {
                toml::Value::Table(t) => t,
                // An array of tables (`[[edges]]`): the next part is an element's index.
                toml::Value::Array(array) => {
                    let len = array.len();
                    let Some(k) = tables.get(i + 1).and_then(|p| p.parse::<usize>().ok()) else {
                        if array.iter().all(toml::Value::is_table) {
                            bail!(
                                "--set {s:?}: {here} is an array of tables: set a key of one element, as {here}.0.KEY"
                            )
                        }
                        bail!("--set {s:?}: {here} is an array: set it whole, as {here}=[...]")
                    };
                    i += 1;
                    match array.get_mut(k) {
                        Some(toml::Value::Table(t)) => t,
                        Some(_) => bail!("--set {s:?}: {here}.{k} is a value, not a table"),
                        None => bail!("--set {s:?}: {here} has {len} elements, numbered from 0"),
                    }
                }
                _ => bail!("--set {s:?}: {here} is a value, not a table"),
            };
            i += 1;
        }
        at.insert(last.to_string(), value);
    }
    toml::to_string(&root).context("the config with --set does not serialize")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::{DEMO, idle_keys, load, load_text};

    /// `[[edges]]` elements are set by index; an index past them, or the array itself, is
    /// refused naming it.
    #[test]
    fn an_edge_is_set_by_its_index() {
        let set = |s: &str| load(None, &[s.to_string()]);
        let (_, g) = set("edges.0.strategy=gather").unwrap();
        let gather = hetpar_layout::Strategy::Gather;
        assert!(g.edges[0].strategy == gather && g.edges[1].strategy != gather);
        for (bad, want) in [
            ("edges.2.strategy=gather", "edges has 2 elements, numbered from 0"),
            (
                "edges.strategy=gather",
                "edges is an array of tables: set a key of one element, as edges.0.KEY",
            ),
            ("edges.0=1", "edges is an array of tables: set a key of one element"),
            (
                "modules.llm.parallel.ranks.0=1",
                "ranks is an array: set it whole, as modules.llm.parallel.ranks=[...]",
            ),
        ] {
            let e = format!("{:#}", set(bad).unwrap_err());
            assert!(e.contains(want), "{e}");
        }
    }

    /// Keys that change nothing are named with why; the demo and keys that do act are not.
    #[test]
    fn keys_given_to_no_effect_are_named() {
        let idle = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            idle_keys(&load(None, &sets).unwrap().1)
        };
        assert_eq!(idle(&[]), Vec::<String>::new());
        let frozen = ["modules.vision.trainable=false", "modules.vision.lr=1e-4"];
        let named = idle(
            &[
                &frozen[..],
                &[
                    "modules.vision.parallel.recompute=true",
                    "modules.vision.parallel.sp=true",
                    "modules.llm.top_k=2",
                    "train.max_skips=3",
                ],
            ]
            .concat(),
        );
        let keys: Vec<&str> = named.iter().map(|n| n.split(' ').next().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "modules.llm.top_k",
                "modules.vision.parallel.sp",
                "modules.vision.lr",
                "modules.vision.parallel.recompute",
                "train.max_skips"
            ],
            "{named:?}"
        );
        // Each acts here: top_k on a MoE LLM, max_skips under skip, a trainable module's
        // lr, sp at tp 2, recompute on a frozen LLM a trainable encoder feeds.
        let acting = [
            "modules.llm.experts=4",
            "modules.llm.top_k=2",
            "train.on_nonfinite=skip",
            "train.max_skips=3",
            "modules.audio.lr=1e-4",
            "modules.llm.trainable=false",
            "modules.llm.parallel.recompute=true",
        ];
        assert_eq!(idle(&acting), Vec::<String>::new());
        assert_eq!(idle(&frozen).len(), 1);
    }

    #[test]
    fn sets_override_what_the_file_says_and_are_validated_alike() {
        let sets = ["train.lr=1e-4", "modules.audio.trainable=false", "train.on_nonfinite=skip"]
            .map(String::from);
        let (cfg, g) = load(None, &sets).unwrap();
        assert_eq!((g.train.lr, cfg.modules["audio"].trainable), (1e-4, Some(false)));
        assert_eq!(g.train.on_nonfinite, hetpar_layout::OnNonFinite::Skip);
        let tp = ["modules.llm.parallel.tp=3".to_string()];
        let e = format!("{:#}", load(None, &tp).unwrap_err());
        assert!(e.contains("with --set modules.llm.parallel.tp=3"), "{e}");
        assert!(e.contains("modules.llm.parallel"), "{e}");
        for bad in ["train.lr", "train..lr=1", "name.x=1"] {
            let e = format!("{:#}", load(None, &[bad.to_string()]).unwrap_err());
            assert!(e.contains("--set"), "{bad}: {e}");
        }
        let unknown = format!("{:#}", load(None, &["train.lrr=1".to_string()]).unwrap_err());
        assert!(unknown.contains("unknown field `lrr`"), "{unknown}");
        // The key the set adds is on no line of the file: the error names its table only.
        assert!(unknown.contains("with --set train.lrr=1: in [train]: unknown field"), "{unknown}");
        // A misspelt module is named with the file's modules; a value that opens an array
        // and does not close it is no string.
        let typo = format!("{:#}", load(None, &["modules.llmm.parallel.tp=2".into()]).unwrap_err());
        assert!(
            typo.ends_with("the config has no module \"llmm\" (its modules: audio, llm, vision); a new module needs its table in the file"),
            "{typo}"
        );
        let open =
            format!("{:#}", load(None, &["modules.llm.parallel.ranks=[0,4".into()]).unwrap_err());
        assert!(open.contains("[0,4 is not a TOML value (unclosed array"), "{open}");
        // Nor is a number too large for TOML; a path that starts with a digit is a string.
        let big = "train.steps=9223372036854775808".to_string();
        let big = format!("{:#}", load(None, &[big]).unwrap_err());
        assert!(
            big.ends_with("9223372036854775808 is not a TOML value (u64 value was too large)"),
            "{big}"
        );
        for string in ["data.path=2026/train.json", "name=2024-05", "name=1.2.3"] {
            let text = match load(None, &[string.to_string()]) {
                Ok(_) => String::new(),
                Err(e) => format!("{e:#}"),
            };
            assert!(!text.contains("is not a TOML value"), "{string}: {text}");
        }
        for number in ["1_0", "-2.5e-3", "+7", "3E4"] {
            assert!(super::looks_like_a_number(number), "{number}");
        }
    }

    /// A mistake of the file's own is reported at its line in the file, as without sets,
    /// though the sets are written into the text that is read.
    #[test]
    fn a_files_own_mistake_keeps_its_line_under_sets() {
        let bad = DEMO.replacen("\n[train]\n", "\n[train]\nlrr = 1\n", 1);
        let line = bad.lines().position(|l| l == "lrr = 1").unwrap() + 1;
        let plain = format!("{:#}", load_text(bad.clone(), "f.toml".into(), &[]).unwrap_err());
        let sets = ["train.lr=1e-4".to_string(), "name=\"x\"".to_string()];
        let set = format!("{:#}", load_text(bad, "f.toml".into(), &sets).unwrap_err());
        assert!(
            plain.starts_with(&format!("f.toml: line {line}, in [train]: unknown field `lrr`")),
            "{plain}"
        );
        assert_eq!(set, plain);
        assert!(DEMO.contains("name = \"demo\""));
    }
}
