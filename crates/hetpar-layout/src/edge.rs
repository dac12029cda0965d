//! The vocabulary of edges, defined once and imported by the graph and the plans alike:
//! module and edge ids, placement modes, DP relations, routing strategies and directions.
//! Nothing here depends on another module of the crate, so the crate's layering runs one
//! way: vocabulary -> layouts -> graph -> manifests -> geometry -> plans -> reports.

use std::fmt;

/// Index of a module in [`crate::graph::ModelGraph::modules`].
pub type ModuleId = usize;
/// Index of an edge in [`crate::graph::ModelGraph::edges`].
pub type EdgeId = usize;

/// How the two ends of an edge are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementMode {
    /// Same span, different grids.
    Colocated,
    /// Disjoint spans (rank islands).
    NonColocated,
}

impl PlacementMode {
    /// `colocated` or `non_colocated`.
    pub fn name(self) -> &'static str {
        match self {
            PlacementMode::Colocated => "colocated",
            PlacementMode::NonColocated => "non_colocated",
        }
    }
}

/// The DP relation between the ends of an edge (SEMANTICS.md section 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DpRelation {
    /// `dp_src == dp_dst`.
    EqualDp,
    /// `dp_src == k * dp_dst`, `k > 1`.
    FanIn(usize),
    /// `dp_dst == k * dp_src`, `k > 1`.
    FanOut(usize),
    /// Neither divides the other.
    General,
}

impl DpRelation {
    /// Classifies `dp_src -> dp_dst`.
    pub fn of(dp_src: usize, dp_dst: usize) -> DpRelation {
        if dp_src == dp_dst {
            DpRelation::EqualDp
        } else if dp_src.is_multiple_of(dp_dst) {
            DpRelation::FanIn(dp_src / dp_dst)
        } else if dp_dst.is_multiple_of(dp_src) {
            DpRelation::FanOut(dp_dst / dp_src)
        } else {
            DpRelation::General
        }
    }

    /// `equal-dp`, `fan-in`, `fan-out` or `general`.
    pub fn name(self) -> &'static str {
        match self {
            DpRelation::EqualDp => "equal-dp",
            DpRelation::FanIn(_) => "fan-in",
            DpRelation::FanOut(_) => "fan-out",
            DpRelation::General => "general",
        }
    }
}

impl fmt::Display for DpRelation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DpRelation::FanIn(k) | DpRelation::FanOut(k) => write!(f, "{} x{k}", self.name()),
            _ => f.write_str(self.name()),
        }
    }
}

/// How an edge moves its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Exactly the missing rows, directly from a holder.
    Exact,
    /// Colocated all-gather and local selection.
    Gather,
    /// Non-colocated boundary leaders; `stripes > 1` spreads a replica pair over that many
    /// leader pairs.
    Leaders {
        /// Leader pairs per replica pair.
        stripes: usize,
    },
}

impl Strategy {
    /// The strategies that apply to `mode`, with `stripes` for leaders.
    pub fn all_for(mode: PlacementMode, max_stripes: usize) -> Vec<Strategy> {
        match mode {
            PlacementMode::Colocated => vec![Strategy::Exact, Strategy::Gather],
            PlacementMode::NonColocated => {
                let mut v = vec![Strategy::Exact, Strategy::Leaders { stripes: 1 }];
                if max_stripes > 1 {
                    v.push(Strategy::Leaders { stripes: max_stripes });
                }
                v
            }
        }
    }

    /// Config spelling: `exact`, `gather`, `leaders`.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Exact => "exact",
            Strategy::Gather => "gather",
            Strategy::Leaders { .. } => "leaders",
        }
    }

    /// Leader pairs per replica pair: `stripes` for leaders, 1 otherwise.
    pub fn stripes(self) -> usize {
        match self {
            Strategy::Leaders { stripes } => stripes,
            Strategy::Exact | Strategy::Gather => 1,
        }
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Strategy::Leaders { stripes } if *stripes > 1 => write!(f, "leaders x{stripes}"),
            _ => f.write_str(self.name()),
        }
    }
}

/// Forward (activations, source to destination) or backward (gradients, back).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    /// Activations: `Held` to `Needed`.
    Forward,
    /// Gradients: `Needed` to `Held`.
    Backward,
}
