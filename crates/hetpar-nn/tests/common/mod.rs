//! Shared helpers of the equivalence tests: deterministic inputs, token placement under
//! CP and SP, reassembly of sharded activations.

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use hetpar_layout::ModuleLayout;
use hetpar_layout::ownership::SeqSplit;
use hetpar_nn::Init;
use hetpar_nn::layers::attention::CpPositions;
use hetpar_nn::testing::{RankReport, rel_err};

/// The tolerance the issue sets: relative 1e-5 in f32, 1e-10 in f64.
pub fn tolerance(dtype: DType) -> f64 {
    if dtype == DType::F64 { 1e-10 } else { 1e-5 }
}

/// A deterministic global tensor.
pub fn global(name: &str, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| Init::Normal(1.0).value(99, name, i as u64)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor").to_dtype(dtype).expect("dtype")
}

/// Sequence positions this rank holds (its CP chunks, cut again over tp under SP).
pub fn local_positions(layout: &ModuleLayout, rank: usize, seq: usize) -> Vec<usize> {
    let c = layout.coords(rank).expect("rank");
    SeqSplit::new(seq, layout).owned(c.cp_idx, c.tp_idx).into_iter().flatten().collect()
}

/// The CP positions attention needs (whole CP chunks, SP ignored).
pub fn cp_positions(layout: &ModuleLayout, rank: usize, seq: usize) -> CpPositions {
    CpPositions::sequence(layout, seq, layout.coords(rank).expect("rank").cp_idx)
}

/// Rows of `t` `[b, seq, ...]` at `positions` along dim 1.
pub fn at_positions(t: &Tensor, positions: &[usize]) -> Tensor {
    let idx = Tensor::from_vec(
        positions.iter().map(|&p| p as u32).collect::<Vec<_>>(),
        positions.len(),
        &Device::Cpu,
    )
    .expect("idx");
    t.index_select(&idx, 1).expect("select").contiguous().expect("contiguous")
}

/// Reassembles `key` (`[b, local_seq, width]` per rank) into `[b, seq, width]` by position;
/// positions held by several ranks (tp replicas) must agree within `tol`.
pub fn by_position(
    reports: &[RankReport],
    layout: &ModuleLayout,
    key: &str,
    b: usize,
    seq: usize,
    width: usize,
    tol: f64,
) -> Vec<f64> {
    let mut out: Vec<Option<Vec<f64>>> = vec![None; b * seq];
    for r in reports {
        let pos = local_positions(layout, r.rank, seq);
        let v = &r.values[key];
        for bi in 0..b {
            for (i, &p) in pos.iter().enumerate() {
                let row =
                    v[(bi * pos.len() + i) * width..(bi * pos.len() + i + 1) * width].to_vec();
                match &out[bi * seq + p] {
                    Some(prev) => assert!(
                        rel_err(&row, prev) <= tol.max(rel_err(prev, prev)),
                        "{key}: replicas of position {p} differ"
                    ),
                    None => out[bi * seq + p] = Some(row),
                }
            }
        }
    }
    out.into_iter().flat_map(|r| r.expect("every position has a holder")).collect()
}
