//! `hetpar plan --emit-config`: a candidate as a config `hetpar train` accepts
//! (INTERFACES.md), validated by [`ModelGraph::from_config`] before it is returned.
//!
//! A homogeneous candidate is written as every module on the LLM's grid (same tp, cp, pp and
//! so dp), which hetpar runs with the three-phase schedule. The synthetic data draws as many
//! items per sample as the workload has on average (`[data] max_items`), or as many as the
//! sequence holds when that is fewer.

use std::collections::BTreeMap;

use hetpar_layout::config::{
    Config, DataConfig, EdgeConfig, ParallelConfig, StrategyName, TrainConfig,
};
use hetpar_layout::{Dtype, ModelGraph};

use crate::candidate::{Candidate, Choice, Kind};
use crate::error::{PlanError, Result};
use crate::workload::Workload;

fn parallel(c: &Choice) -> ParallelConfig {
    ParallelConfig {
        ranks: [c.start, c.end],
        tp: c.tp,
        cp: c.cp,
        pp: c.pp,
        ep: c.ep,
        etp: None,
        sp: c.tp > 1,
        vpp: c.vpp,
        offload: c.offload,
        recompute: false,
    }
}

/// The `max_items` whose synthetic draws (none with probability 1/4, else uniform in
/// `1..=K`: `3(K+1)/8` items per sample on average) match the workload's items per sample,
/// at most what one sequence holds next to a text token.
fn max_items(wl: &Workload) -> usize {
    let mean = wl.encoders.iter().map(|e| e.items_per_sample).fold(0.0, f64::max);
    let k = (8.0 * mean / 3.0 - 1.0).round().max(1.0) as usize;
    let rows: usize = wl.encoders.iter().map(|e| e.seq).sum();
    let fits = (wl.seq_len - 1) / rows.max(1);
    k.min(fits).max(1)
}

/// The config of `c` for workload `wl`.
pub fn config(wl: &Workload, c: &Candidate) -> Result<Config> {
    let mut modules = BTreeMap::new();
    let moe = wl.llm.experts > 0;
    let llm_parallel = ParallelConfig { etp: moe.then_some(1), ..parallel(&c.llm) };
    modules.insert(wl.llm_name.clone(), wl.llm_sizes.with_parallel(llm_parallel));
    let mut edges = Vec::new();
    for (e, ch) in wl.encoders.iter().zip(&c.encoders) {
        let ch = match c.kind {
            Kind::Homogeneous => {
                Choice { tp: c.llm.tp, cp: c.llm.cp, pp: c.llm.pp, vpp: 1, offload: false, ..*ch }
            }
            _ => *ch,
        };
        let s = &e.shape;
        let parallel =
            ParallelConfig { vpp: 1, ep: 1, recompute: ch.recompute > 0, ..parallel(&ch) };
        modules.insert(s.name.clone(), e.sizes.with_parallel(parallel));
        edges.push(EdgeConfig {
            from: s.name.clone(),
            to: wl.llm_name.clone(),
            strategy: StrategyName::Auto,
            stripes: 1,
        });
    }
    let cfg = Config {
        name: format!("{}-{}", wl.name, c.kind.name().replace('_', "-")),
        train: TrainConfig {
            lr: 1e-4,
            dtype: Dtype::Bf16,
            ..TrainConfig::with_sizes(wl.global_batch, c.microbatches, wl.seq_len)
        },
        data: DataConfig { max_items: max_items(wl), ..DataConfig::default() },
        modules,
        edges,
    };
    ModelGraph::from_config(&cfg).map_err(|e| {
        PlanError(format!("the emitted config does not validate: {}: {}", e.field, e.message))
    })?;
    Ok(cfg)
}
