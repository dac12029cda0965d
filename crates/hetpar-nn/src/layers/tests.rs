//! Over `tp`, each block as one node (its collectives inside the node) against the same
//! layers composed node by node: the output, the input's gradient and every parameter's
//! gradient, equal value for value (candle's store turns a `-0` gradient into `0`), with and
//! without SP, alone and as a pre-norm layer's half, in f32, f64 and f32 with bf16 products.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use hetpar_comm::{LocalOptions, launch};
use hetpar_layout::{LayoutSpec, ModuleLayout, Span};

use super::attention::{Attention, AttentionSpec, CpMode, CpPositions};
use super::linear::Build;
use super::mlp::{GeluMlp, SwiGlu};
use super::norm::{LayerNorm, Norm, RmsNorm};
use crate::error::Result;
use crate::kernels::linear::Matmul;
use crate::params::{HasParams, Param};
use crate::{Init, ParallelCtx};

const B: usize = 2;
const S: usize = 12;
const H: usize = 16;
const TP: usize = 2;

/// Named values: the output, the input's gradient, each parameter's gradient.
type Pass = Vec<(String, Vec<f64>)>;

fn global(name: &str, shape: &[usize], dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|i| Init::Normal(1.0).value(7, name, i as u64)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// One forward of `run` on `x` and a backward of `sum(y * probe)`.
fn pass(
    x: &Var,
    probe: &Tensor,
    params: &[&Param],
    run: impl Fn(&Tensor) -> Result<Tensor>,
) -> Pass {
    let y = run(x.as_tensor()).unwrap();
    let store = (&y * probe).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![("out".into(), values(&y))];
    out.push(("x grad".into(), values(store.get(x.as_tensor()).unwrap())));
    for p in params {
        // A detached key bias gets none, on both paths.
        match p.take_grad(&store).unwrap() {
            Some(g) => out.push((p.name.clone(), values(&g))),
            None => out.push((format!("{} (no gradient)", p.name), Vec::new())),
        }
    }
    out
}

/// Runs `body` (which builds a block and gives its fused and its composed pass on the input,
/// a probe of `out` features and the rank's positions) on every rank of a tp 2 layout, with
/// and without SP, and asserts the passes agree.
fn agree(
    what: &str,
    out: usize,
    body: impl Fn(&Build, &Var, &Tensor, &CpPositions) -> [Pass; 2] + Sync,
) {
    agree_on(what, &[(TP, 1, false), (TP, 1, true)], out, body);
}

/// [`agree`] on layouts of `(tp, cp, sp)`: each cp rank holds its own `S / cp` positions'
/// rows (the same on its tp ranks, split along the sequence under SP).
fn agree_on(
    what: &str,
    layouts: &[(usize, usize, bool)],
    out: usize,
    body: impl Fn(&Build, &Var, &Tensor, &CpPositions) -> [Pass; 2] + Sync,
) {
    for (dtype, how) in
        [(DType::F32, Matmul::Native), (DType::F64, Matmul::Native), (DType::F32, Matmul::Bf16)]
    {
        for &(tp, cp, sp) in layouts {
            let spec = LayoutSpec { tp, cp, sp, ..LayoutSpec::default() };
            let layout = ModuleLayout::new("m", Span::new(0, tp * cp), spec).unwrap();
            let runs = launch(tp * cp, LocalOptions { timeout: Duration::from_secs(30) }, |c| {
                let ctx = ParallelCtx::new(c, &layout).unwrap();
                let at = CpPositions::sequence(&layout, S, ctx.cp.rank);
                let (i, s) = (ctx.cp.rank, S / cp);
                let shard = |t: Tensor| {
                    if sp { t.chunk(tp, 1).unwrap()[ctx.tp.rank].clone() } else { t }
                };
                let x = global(&format!("x{i}"), &[B, s, H], dtype);
                let x = Var::from_tensor(&shard(x)).unwrap();
                let probe = shard(global(&format!("probe{i}"), &[B, s, out], dtype));
                body(&Build::new(ctx.clone(), 3, dtype).with_matmul(how), &x, &probe, &at)
            })
            .unwrap();
            for (rank, [fused, composed]) in runs.iter().enumerate() {
                assert_eq!(fused.len(), composed.len());
                for ((name, f), (other, c)) in fused.iter().zip(composed) {
                    assert_eq!(name, other, "{what} {dtype:?} {how:?} tp {tp} cp {cp} rank {rank}");
                    let differ = f.iter().zip(c).filter(|(a, b)| a != b).count();
                    assert!(
                        differ == 0 && f.len() == c.len(),
                        "{what} {dtype:?} {how:?} tp {tp} cp {cp} sp {sp} rank {rank}: {name}: {differ} of {} differ",
                        f.len()
                    );
                }
            }
        }
    }
}

/// The two passes of a block alone (`residual` false) or as `x + block(norm(x))`.
fn both<M: HasParams, N: Norm + HasParams>(
    (block, norm, residual): (&M, &N, bool),
    (x, probe): (&Var, &Tensor),
    fused: impl Fn(&Tensor, Option<&N>) -> Result<Tensor>,
    composed: impl Fn(&Tensor) -> Result<Tensor>,
) -> [Pass; 2] {
    let mut params = block.params();
    if residual {
        params.extend(norm.params());
    }
    let one = pass(x, probe, &params, |x| fused(x, residual.then_some(norm)));
    let apart = pass(x, probe, &params, |x| {
        if residual { Ok((x + composed(&norm.normalize(x)?)?)?) } else { composed(x) }
    });
    [one, apart]
}

fn attention_spec(llama: bool) -> AttentionSpec {
    AttentionSpec {
        hidden: H,
        heads: 4,
        kv_heads: if llama { 2 } else { 4 },
        causal: llama,
        rope_theta: llama.then_some(10_000.0),
        bias: !llama,
        key_bias: !llama,
        cp_mode: CpMode::AllGather,
    }
}

#[test]
fn over_tp_and_cp_the_attention_block_as_one_node_gives_the_composed_blocks_bits() {
    // tp 2 with and without SP; cp 2 (by all-gather, keys and values gathered inside the
    // node), alone and with tp 2 and SP.
    let layouts = [(TP, 1, false), (TP, 1, true), (1, 2, false), (TP, 2, true)];
    for llama in [true, false] {
        for residual in [false, true] {
            let what = format!("attention (Llama-like {llama}, residual {residual})");
            agree_on(&what, &layouts, H, |b, x, probe, at| {
                let att = Attention::new(b, "att", "o_proj", attention_spec(llama), 0.3, 0.2);
                let att = att.unwrap();
                let composed = |x: &Tensor| att.composed(x, at);
                if llama {
                    let norm = RmsNorm::new(b, "norm", H, 1e-6).unwrap();
                    let fused = |x: &Tensor, n: Option<&RmsNorm>| match n {
                        Some(n) => att.residual(x, n, at),
                        None => att.forward(x, at),
                    };
                    both((&att, &norm, residual), (x, probe), fused, composed)
                } else {
                    let norm = LayerNorm::new(b, "norm", H, 1e-5).unwrap();
                    let fused = |x: &Tensor, n: Option<&LayerNorm>| match n {
                        Some(n) => att.residual(x, n, at),
                        None => att.forward(x, at),
                    };
                    both((&att, &norm, residual), (x, probe), fused, composed)
                }
            });
        }
    }
}

#[test]
fn over_tp_the_mlps_as_one_node_give_the_composed_mlps_bits() {
    for residual in [false, true] {
        agree(&format!("SwiGLU (residual {residual})"), H, |b, x, probe, _| {
            let mlp = SwiGlu::new(b, "mlp", H, 24, 0.3, 0.2).unwrap();
            let norm = RmsNorm::new(b, "norm", H, 1e-6).unwrap();
            let fused = |x: &Tensor, n: Option<&RmsNorm>| match n {
                Some(n) => mlp.residual(x, n),
                None => mlp.forward(x),
            };
            both((&mlp, &norm, residual), (x, probe), fused, |x| mlp.composed(x))
        });
        agree(&format!("GELU MLP (residual {residual})"), H, |b, x, probe, _| {
            let mlp = GeluMlp::new(b, "fc1", "fc2", (H, 24, H), 0.3, 0.2).unwrap();
            let norm = LayerNorm::new(b, "norm", H, 1e-5).unwrap();
            let fused = |x: &Tensor, n: Option<&LayerNorm>| match n {
                Some(n) => mlp.residual(x, n),
                None => mlp.forward(x),
            };
            both((&mlp, &norm, residual), (x, probe), fused, |x| mlp.composed(x))
        });
    }
    // A projector's shape: an output narrower than the input.
    agree("GELU MLP 16 -> 24 -> 10", 10, |b, x, probe, _| {
        let mlp = GeluMlp::new(b, "fc1", "fc2", (H, 24, 10), 0.3, 0.2).unwrap();
        let norm = LayerNorm::new(b, "norm", H, 1e-5).unwrap();
        let fused = |x: &Tensor, _: Option<&LayerNorm>| mlp.forward(x);
        both((&mlp, &norm, false), (x, probe), fused, |x| mlp.composed(x))
    });
}
