//! Mesh axes: the single vocabulary for how a module's ranks are factorized.
//!
//! "Axis" always means a mesh axis; "dim" is reserved for tensor dimensions. Dense axes are
//! ordered fastest-first `tp, cp, dp, pp` (Megatron's `tp-cp-ep-dp-pp` without the expert
//! axis). MoE layers read the same ranks through a second factorization, the expert view
//! `etp, ep, edp, pp`, with `etp * ep * edp == tp * cp * dp`.

use std::fmt;

/// A mesh axis of a module layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Axis {
    /// Tensor parallelism: matmuls split over ranks (Megatron column/row parallel).
    Tp,
    /// Context parallelism: the sequence split into `2*cp` load-balanced chunks.
    Cp,
    /// Data parallelism: replicas that own disjoint samples (the LLM) or items (encoders).
    Dp,
    /// Pipeline parallelism: consecutive layer stages.
    Pp,
    /// Expert tensor parallelism (expert view).
    Etp,
    /// Expert parallelism: experts sharded over ranks (expert view).
    Ep,
    /// Expert data parallelism: replicas of the expert shards (expert view).
    Edp,
}

/// Which factorization of a module's ranks an axis belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum View {
    /// `tp, cp, dp, pp`: every layer except MoE experts.
    Dense,
    /// `etp, ep, edp, pp`: MoE expert layers.
    Expert,
}

impl Axis {
    /// Dense axes, fastest-varying first.
    pub const DENSE: [Axis; 4] = [Axis::Tp, Axis::Cp, Axis::Dp, Axis::Pp];
    /// Expert-view axes, fastest-varying first (`pp` is shared with the dense view).
    pub const EXPERT: [Axis; 4] = [Axis::Etp, Axis::Ep, Axis::Edp, Axis::Pp];

    /// The lower-case name used in configs and messages.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Etp => "etp",
            Axis::Ep => "ep",
            Axis::Edp => "edp",
        }
    }

    /// Views this axis belongs to (`pp` belongs to both).
    pub fn in_view(self, view: View) -> bool {
        match view {
            View::Dense => Axis::DENSE.contains(&self),
            View::Expert => Axis::EXPERT.contains(&self),
        }
    }
}

impl fmt::Display for Axis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
