//! Every rank of a job runs the same thing. Processes started on several hosts each read
//! their own config file, data and checkpoint, and nothing made them the same: a learning
//! rate set on one host only trained silently apart, a different seed drew a different
//! manifest and ended in a truncated message, a different hidden size in a boundary
//! receive of the wrong length. [`agree`] compares what each rank was started with before
//! any step runs, and refuses a job whose ranks differ, naming the ranks and the first keys
//! that differ (RELIABILITY.md rows 7 and 8, across processes).

use std::collections::BTreeMap;
use std::fmt::Display;

use hetpar_comm::{CommExt, Communicator};
use hetpar_layout::plan::rank_list;
use sha2::{Digest, Sha256};

use crate::RuntimeError;
use crate::checkpoint::hex;

/// What a rank was started with, as `key = value` facts (the resolved config, the dtype and
/// steps, digests of the data files and the checkpoint it resumes from).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunFacts {
    facts: BTreeMap<String, String>,
}

impl RunFacts {
    /// No facts yet.
    pub fn new() -> RunFacts {
        RunFacts::default()
    }

    /// Records `key = value` (a later value for the same key replaces the earlier one).
    pub fn set(&mut self, key: impl Into<String>, value: impl Display) {
        self.facts.insert(key.into(), value.to_string());
    }

    /// Records `key` as the SHA-256 of `bytes` (for values too long to compare whole).
    pub fn set_digest(&mut self, key: impl Into<String>, bytes: &[u8]) {
        self.set(key, format!("sha256 {}", hex(&Sha256::digest(bytes))));
    }

    /// The facts, one `key = value` line each, in key order.
    pub fn text(&self) -> String {
        self.facts.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
    }

    /// SHA-256 of [`RunFacts::text`], in hex.
    pub fn digest(&self) -> String {
        hex(&Sha256::digest(self.text().as_bytes()))
    }

    fn parse(text: &str) -> BTreeMap<&str, &str> {
        text.lines().filter_map(|l| l.split_once(" = ")).collect()
    }
}

/// How many groups of differing ranks a refusal describes, and keys per group.
const GROUPS_SHOWN: usize = 3;
const KEYS_SHOWN: usize = 2;

/// Compares `facts` over every member of `c` (the world): `Ok` when every rank holds the
/// same facts, else the same [`RuntimeError::Disagree`] on every rank. One all-gather of 32
/// bytes per rank when they agree; when they do not, every rank's facts are gathered to say
/// which keys differ.
pub fn agree(c: &dyn Communicator, facts: &RunFacts) -> Result<(), RuntimeError> {
    let text = facts.text();
    let n = c.size();
    let digest = Sha256::digest(text.as_bytes());
    let mut all = vec![0u8; 32 * n];
    c.all_gather_v_bytes(&digest, &mut all, &vec![32; n])?;
    let digests: Vec<&[u8]> = all.chunks(32).collect();
    if digests.iter().all(|d| *d == digests[0]) {
        return Ok(());
    }
    let texts: Vec<String> = c
        .all_gather_any(text.as_bytes())?
        .iter()
        .map(|t| String::from_utf8_lossy(t).into_owned())
        .collect();
    Err(RuntimeError::Disagree(describe(&texts)))
}

/// What differs between ranks' facts (`texts`, by rank), against rank 0's.
fn describe(texts: &[String]) -> String {
    // Ranks grouped by identical facts, in order of their first rank.
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (r, t) in texts.iter().enumerate() {
        match groups.iter_mut().find(|(first, _)| texts[*first] == *t) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((r, vec![r])),
        }
    }
    let base = RunFacts::parse(&texts[0]);
    let absent = "(absent)";
    let parts: Vec<String> = groups
        .iter()
        .skip(1)
        .take(GROUPS_SHOWN)
        .map(|(first, ranks)| {
            let theirs = RunFacts::parse(&texts[*first]);
            let mut keys: Vec<&str> = base.keys().chain(theirs.keys()).copied().collect();
            keys.sort_unstable();
            keys.dedup();
            keys.retain(|k| base.get(k) != theirs.get(k));
            let shown: Vec<String> = keys
                .iter()
                .take(KEYS_SHOWN)
                .map(|k| {
                    format!(
                        "{k} = {} where rank 0 has {}",
                        theirs.get(k).unwrap_or(&absent),
                        base.get(k).unwrap_or(&absent)
                    )
                })
                .collect();
            let more = match keys.len().saturating_sub(KEYS_SHOWN) {
                0 => String::new(),
                k => format!(" (and {k} more)"),
            };
            let who = if ranks.len() == 1 {
                format!("rank {} has", ranks[0])
            } else {
                format!("ranks {} have", rank_list(ranks))
            };
            format!("{who} {}{more}", shown.join(", "))
        })
        .collect();
    let more = match groups.len().saturating_sub(1 + GROUPS_SHOWN) {
        0 => String::new(),
        k => format!("; and {k} more groups of ranks"),
    };
    format!(
        "the ranks were started with different runs: {}{more}; start every rank with the same build, config (after --set), command-line flags, data files and checkpoint",
        parts.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn ranks_agree_or_all_refuse_alike() {
        let opts = || hetpar_comm::LocalOptions { timeout: Duration::from_secs(20) };
        let same = hetpar_comm::launch(3, opts(), |c| {
            let mut f = RunFacts::new();
            f.set("train.lr", "0.003");
            agree(c, &f)
        })
        .expect("launch");
        assert!(same.iter().all(Result::is_ok), "{same:?}");
        let apart = hetpar_comm::launch(3, opts(), |c| {
            let mut f = RunFacts::new();
            f.set("train.lr", if c.rank() == 1 { "0.01" } else { "0.003" });
            agree(c, &f).map_err(|e| e.to_string())
        })
        .expect("launch");
        let want = "the ranks were started with different runs: rank 1 has train.lr = 0.01 where rank 0 has 0.003; \
                    start every rank with the same build, config (after --set), command-line flags, data files and checkpoint";
        for got in apart {
            assert_eq!(got, Err(want.to_string()));
        }
    }

    fn facts(pairs: &[(&str, &str)]) -> String {
        let mut f = RunFacts::new();
        for (k, v) in pairs {
            f.set(*k, v);
        }
        f.text()
    }

    #[test]
    fn names_the_ranks_and_the_keys_that_differ() {
        let a = facts(&[("train.lr", "0.003"), ("train.seed", "1234")]);
        let b = facts(&[("train.lr", "0.01"), ("train.seed", "1234")]);
        let c = facts(&[("train.seed", "1234"), ("data.train.sha256", "ab")]);
        let got = describe(&[a.clone(), a.clone(), b.clone(), b, c, a]);
        assert_eq!(
            got,
            "the ranks were started with different runs: ranks 2-3 have train.lr = 0.01 where rank 0 has 0.003; \
             rank 4 has data.train.sha256 = ab where rank 0 has (absent), train.lr = (absent) where rank 0 has 0.003; \
             start every rank with the same build, config (after --set), command-line flags, data files and checkpoint"
        );
    }

    #[test]
    fn counts_what_it_leaves_out() {
        let base: Vec<(String, String)> =
            (0..5).map(|k| (format!("k{k}"), "0".to_string())).collect();
        let mut texts =
            vec![facts(&base.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>())];
        for r in 1..=5 {
            let v = r.to_string();
            let pairs: Vec<(&str, &str)> =
                base.iter().map(|(k, _)| (k.as_str(), v.as_str())).collect();
            texts.push(facts(&pairs));
        }
        let got = describe(&texts);
        assert!(
            got.contains(
                "rank 1 has k0 = 1 where rank 0 has 0, k1 = 1 where rank 0 has 0 (and 3 more)"
            ),
            "{got}"
        );
        assert!(got.contains("rank 3 has"), "{got}");
        assert!(!got.contains("rank 4 has"), "{got}");
        assert!(got.contains("; and 2 more groups of ranks;"), "{got}");
    }
}
