//! Compute orders of one pipeline stage: which forward and backward passes it runs, in
//! which order, in groups. Communication is derived from the groups (see `build.rs`): before
//! each group a rank posts the previous group's sends and this group's receives together.
//! Plain 1F1B uses single-pass groups (Megatron's `send_forward_recv_backward` pattern);
//! interleaved 1F1B pairs the steady-state forward and backward (Megatron's
//! `send_forward_backward_recv_forward_backward`), which it needs to be deadlock-free.

use hetpar_layout::ModuleId;

use crate::action::{Compute, Pass};

fn pass(pass: Pass, module: ModuleId, vstage: usize, mb: usize) -> Compute {
    Compute { pass, module, vstage, mb }
}

/// 1F1B for stage `stage` over `m` microbatches: `warmup` forwards, then alternating one
/// forward and one backward, then the remaining backwards (PipeDream-Flush; Megatron's
/// `forward_backward_pipelining_without_interleaving`). `warmup` is clamped to `m`.
pub fn one_f_one_b(module: ModuleId, stage: usize, m: usize, warmup: usize) -> Vec<Vec<Compute>> {
    let w = warmup.min(m);
    let mut out: Vec<Vec<Compute>> =
        (0..w).map(|k| vec![pass(Pass::Forward, module, stage, k)]).collect();
    for i in 0..m - w {
        out.push(vec![pass(Pass::Forward, module, stage, w + i)]);
        out.push(vec![pass(Pass::Backward, module, stage, i)]);
    }
    out.extend((m - w..m).map(|k| vec![pass(Pass::Backward, module, stage, k)]));
    out
}

/// Interleaved 1F1B (Narayanan et al. 2021; Megatron's
/// `forward_backward_pipelining_with_interleaving`) for physical stage `stage` of a `p`-stage
/// pipeline with `v` chunks per rank over `m` microbatches (`m` a multiple of `p`). Virtual
/// microbatch `j` runs chunk `(j mod p*v) / p` (reversed for backwards) of microbatch
/// `(j / (p*v)) * p + j mod p`; stage `s` runs `2*(p-s-1) + (v-1)*p` warmup forwards, or all
/// of them when `m == p`.
pub fn interleaved(
    module: ModuleId,
    stage: usize,
    p: usize,
    v: usize,
    m: usize,
) -> Vec<Vec<Compute>> {
    let total = m * v;
    let at = |j: usize, pass_: Pass| -> Compute {
        let within = j % (p * v);
        let mut chunk = within / p;
        if pass_ == Pass::Backward {
            chunk = v - 1 - chunk;
        }
        let mb = (j / (p * v)) * p + j % p;
        pass(pass_, module, chunk * p + stage, mb)
    };
    let warmup = if m == p { total } else { (2 * (p - stage - 1) + (v - 1) * p).min(total) };
    let mut out: Vec<Vec<Compute>> = (0..warmup).map(|j| vec![at(j, Pass::Forward)]).collect();
    for i in 0..total - warmup {
        out.push(vec![at(warmup + i, Pass::Forward), at(i, Pass::Backward)]);
    }
    out.extend((total - warmup..total).map(|j| vec![at(j, Pass::Backward)]));
    out
}

/// Every forward of `vstages`, microbatch-major (encoder phase 1 of the three-phase schedule).
pub fn forwards(module: ModuleId, vstages: &[usize], m: usize) -> Vec<Vec<Compute>> {
    (0..m)
        .flat_map(|k| vstages.iter().map(move |&v| vec![pass(Pass::Forward, module, v, k)]))
        .collect()
}

/// Every backward of `vstages`, microbatch-major, chunks in reverse (encoder phase 3).
pub fn backwards(module: ModuleId, vstages: &[usize], m: usize) -> Vec<Vec<Compute>> {
    (0..m)
        .flat_map(|k| vstages.iter().rev().map(move |&v| vec![pass(Pass::Backward, module, v, k)]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells(order: &[Vec<Compute>]) -> String {
        order
            .iter()
            .flatten()
            .map(|c| {
                let p = if c.pass == Pass::Forward { 'F' } else { 'B' };
                format!("{p}{}.{}", c.mb, c.vstage)
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn one_f_one_b_of_the_first_of_four_stages() {
        let o = one_f_one_b(0, 0, 6, 3);
        assert_eq!(cells(&o), "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0");
    }

    #[test]
    fn interleaved_two_stages_two_chunks() {
        // Stage 0 of p=2, v=2, m=4: warmup 2*(2-0-1) + (2-1)*2 = 4.
        let o = interleaved(0, 0, 2, 2, 4);
        assert_eq!(
            cells(&o),
            "F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0"
        );
        assert_eq!(o.iter().flatten().count(), 2 * 4 * 2);
        assert!(o[4..8].iter().all(|g| g.len() == 2), "steady state pairs F and B");
    }
}
