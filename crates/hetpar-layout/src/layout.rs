//! A module's validated layout: axis sizes, rank span, and rank <-> coordinate queries.
//!
//! Coordinates follow SEMANTICS.md section 2, fastest axis first:
//!
//! ```text
//! local  = rank - span.start
//! tp_idx = local % tp
//! cp_idx = (local / tp) % cp
//! dp_idx = (local / (tp*cp)) % dp
//! pp_idx = local / (tp*cp*dp)
//! ```
//!
//! and the expert view of the same span is
//! `local = etp_idx + etp*(ep_idx + ep*(edp_idx + edp*pp_idx))`.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use serde::Serialize;

use crate::axis::{Axis, View};
use crate::error::{ConfigError, Result};

/// A contiguous half-open range of global ranks `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Span {
    /// First rank.
    pub start: usize,
    /// One past the last rank.
    pub end: usize,
}

impl Span {
    /// The span `[start, end)`.
    pub fn new(start: usize, end: usize) -> Span {
        Span { start, end }
    }

    /// Number of ranks.
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// True when the span holds no rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `rank` lies in the span.
    pub fn contains(&self, rank: usize) -> bool {
        (self.start..self.end).contains(&rank)
    }

    /// The ranks, ascending.
    pub fn ranks(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Whether two spans share at least one rank.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

impl fmt::Display for Span {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// The parallel settings a user writes for a module; `dp` is derived from the span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutSpec {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Context-parallel size.
    pub cp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size; `None` means "same as tp" (Megatron's default).
    pub etp: Option<usize>,
    /// Sequence parallelism inside the TP group.
    pub sp: bool,
}

impl Default for LayoutSpec {
    fn default() -> Self {
        LayoutSpec { tp: 1, cp: 1, pp: 1, ep: 1, etp: None, sp: false }
    }
}

/// Dense coordinates of a rank inside its module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Coords {
    /// Index along `tp`.
    pub tp_idx: usize,
    /// Index along `cp`.
    pub cp_idx: usize,
    /// Index along `dp` (the replica).
    pub dp_idx: usize,
    /// Index along `pp` (the stage).
    pub pp_idx: usize,
}

/// Expert-view coordinates of a rank inside its module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExpertCoords {
    /// Index along `etp`.
    pub etp_idx: usize,
    /// Index along `ep`.
    pub ep_idx: usize,
    /// Index along `edp`.
    pub edp_idx: usize,
    /// Index along `pp`.
    pub pp_idx: usize,
}

/// A validated layout of one module: the only way to get one is [`ModuleLayout::new`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleLayout {
    name: String,
    span: Span,
    tp: usize,
    cp: usize,
    dp: usize,
    pp: usize,
    etp: usize,
    ep: usize,
    edp: usize,
    sp: bool,
}

impl ModuleLayout {
    /// Validates `spec` on `span` for module `name`. `dp` is `span / (tp*cp*pp)`; the expert
    /// view needs `etp*ep` to divide `tp*cp*dp`.
    pub fn new(name: &str, span: Span, spec: LayoutSpec) -> Result<ModuleLayout> {
        let field = format!("modules.{name}.parallel");
        let err = |message: String| Err(ConfigError::new(field.clone(), message));
        if span.is_empty() {
            return err(format!(
                "ranks {span} is empty: write ranks = [start, end) with start < end"
            ));
        }
        for (axis, size) in [("tp", spec.tp), ("cp", spec.cp), ("pp", spec.pp), ("ep", spec.ep)] {
            if size == 0 {
                return err(format!("{axis} must be at least 1, got 0"));
            }
        }
        let n = span.len();
        let model = spec.tp * spec.cp * spec.pp;
        if !n.is_multiple_of(model) {
            return err(format!(
                "tp({}) * cp({}) * pp({}) = {model} does not divide span {span} of {n} ranks",
                spec.tp, spec.cp, spec.pp
            ));
        }
        let dp = n / model;
        let etp = spec.etp.unwrap_or(spec.tp);
        if etp == 0 {
            return err("etp must be at least 1, got 0".to_string());
        }
        let dense = spec.tp * spec.cp * dp;
        if !dense.is_multiple_of(etp * spec.ep) {
            return err(format!(
                "etp({etp}) * ep({}) = {} does not divide tp({}) * cp({}) * dp({dp}) = {dense}",
                spec.ep,
                etp * spec.ep,
                spec.tp,
                spec.cp
            ));
        }
        Ok(ModuleLayout {
            name: name.to_string(),
            span,
            tp: spec.tp,
            cp: spec.cp,
            dp,
            pp: spec.pp,
            etp,
            ep: spec.ep,
            edp: dense / (etp * spec.ep),
            sp: spec.sp,
        })
    }

    /// The module's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The ranks the module occupies.
    pub fn span(&self) -> Span {
        self.span
    }

    /// Whether sequence parallelism is on inside `tp`.
    pub fn sp(&self) -> bool {
        self.sp
    }

    /// Size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        match axis {
            Axis::Tp => self.tp,
            Axis::Cp => self.cp,
            Axis::Dp => self.dp,
            Axis::Pp => self.pp,
            Axis::Etp => self.etp,
            Axis::Ep => self.ep,
            Axis::Edp => self.edp,
        }
    }

    /// `tp` size.
    pub fn tp(&self) -> usize {
        self.tp
    }
    /// `cp` size.
    pub fn cp(&self) -> usize {
        self.cp
    }
    /// `dp` size (number of replicas).
    pub fn dp(&self) -> usize {
        self.dp
    }
    /// `pp` size (number of stages).
    pub fn pp(&self) -> usize {
        self.pp
    }
    /// `ep` size.
    pub fn ep(&self) -> usize {
        self.ep
    }
    /// `etp` size.
    pub fn etp(&self) -> usize {
        self.etp
    }
    /// `edp` size.
    pub fn edp(&self) -> usize {
        self.edp
    }

    /// Ranks per pipeline stage of one replica: `tp * cp`.
    pub fn stage_width(&self) -> usize {
        self.tp * self.cp
    }

    /// Dense coordinates of `rank`, or `None` outside the span.
    pub fn coords(&self, rank: usize) -> Option<Coords> {
        if !self.span.contains(rank) {
            return None;
        }
        let local = rank - self.span.start;
        Some(Coords {
            tp_idx: local % self.tp,
            cp_idx: (local / self.tp) % self.cp,
            dp_idx: (local / (self.tp * self.cp)) % self.dp,
            pp_idx: local / (self.tp * self.cp * self.dp),
        })
    }

    /// The global rank at `coords`. Panics when a coordinate is out of range (an internal
    /// invariant: coordinates come from this layout).
    pub fn rank(&self, c: Coords) -> usize {
        assert!(
            c.tp_idx < self.tp && c.cp_idx < self.cp && c.dp_idx < self.dp && c.pp_idx < self.pp,
            "coordinates {c:?} out of range for module {}",
            self.name
        );
        self.span.start
            + c.tp_idx
            + self.tp * (c.cp_idx + self.cp * (c.dp_idx + self.dp * c.pp_idx))
    }

    /// Expert-view coordinates of `rank`, or `None` outside the span.
    pub fn expert_coords(&self, rank: usize) -> Option<ExpertCoords> {
        if !self.span.contains(rank) {
            return None;
        }
        let local = rank - self.span.start;
        Some(ExpertCoords {
            etp_idx: local % self.etp,
            ep_idx: (local / self.etp) % self.ep,
            edp_idx: (local / (self.etp * self.ep)) % self.edp,
            pp_idx: local / (self.etp * self.ep * self.edp),
        })
    }

    fn view_index(&self, rank: usize, axis: Axis) -> usize {
        let (Some(c), Some(e)) = (self.coords(rank), self.expert_coords(rank)) else {
            panic!("rank {rank} is outside module {} {}", self.name, self.span);
        };
        match axis {
            Axis::Tp => c.tp_idx,
            Axis::Cp => c.cp_idx,
            Axis::Dp => c.dp_idx,
            Axis::Pp => c.pp_idx,
            Axis::Etp => e.etp_idx,
            Axis::Ep => e.ep_idx,
            Axis::Edp => e.edp_idx,
        }
    }

    /// The ranks that differ from `rank` only along `axes`, ascending. All axes must belong
    /// to one view (dense or expert; `pp` fits both). Panics on a rank outside the span or on
    /// mixed views: both are programming errors.
    pub fn group(&self, axes: &[Axis], rank: usize) -> Vec<usize> {
        let fixed = Self::fixed_axes(axes);
        let key = self.group_key(&fixed, rank);
        self.span.ranks().filter(|&r| self.group_key(&fixed, r) == key).collect()
    }

    /// The span cut into its [`ModuleLayout::group`]s along `axes`, each ascending, in
    /// order of their lowest rank: one pass over the span, where asking each rank's group
    /// in turn is one pass per rank.
    pub fn groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        let fixed = Self::fixed_axes(axes);
        let mut by_key: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
        for r in self.span.ranks() {
            by_key.entry(self.group_key(&fixed, r)).or_default().push(r);
        }
        let mut groups: Vec<Vec<usize>> = by_key.into_values().collect();
        groups.sort_unstable_by_key(|g| g[0]);
        groups
    }

    /// The axes a group along `axes` holds fixed: the other axes of their view.
    fn fixed_axes(axes: &[Axis]) -> Vec<Axis> {
        let view = if axes.iter().all(|a| a.in_view(View::Dense)) {
            View::Dense
        } else if axes.iter().all(|a| a.in_view(View::Expert)) {
            View::Expert
        } else {
            panic!("axes {axes:?} mix the dense and expert views");
        };
        match view {
            View::Dense => Axis::DENSE.to_vec(),
            View::Expert => Axis::EXPERT.to_vec(),
        }
        .into_iter()
        .filter(|a| !axes.contains(a))
        .collect()
    }

    /// `rank`'s index along each of the `fixed` axes: equal for the members of one group.
    fn group_key(&self, fixed: &[Axis], rank: usize) -> Vec<usize> {
        fixed.iter().map(|&a| self.view_index(rank, a)).collect()
    }

    /// The ranks of replica `dp_idx` at stage `pp_idx`, in local order (tp fastest, then cp).
    pub fn stage_ranks(&self, dp_idx: usize, pp_idx: usize) -> Vec<usize> {
        (0..self.cp)
            .flat_map(|cp_idx| {
                (0..self.tp).map(move |tp_idx| Coords { tp_idx, cp_idx, dp_idx, pp_idx })
            })
            .map(|c| self.rank(c))
            .collect()
    }

    /// A short description such as `tp2 cp1 dp4 pp1`, with `sp` appended when on.
    pub fn describe(&self) -> String {
        let mut s = format!("tp{} cp{} dp{} pp{}", self.tp, self.cp, self.dp, self.pp);
        if self.sp {
            s.push_str(" sp");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(span: Span, tp: usize, cp: usize, pp: usize) -> ModuleLayout {
        let spec = LayoutSpec { tp, cp, pp, ..LayoutSpec::default() };
        ModuleLayout::new("m", span, spec).expect("valid layout")
    }

    #[test]
    fn coords_round_trip_on_an_offset_span() {
        let l = layout(Span::new(8, 32), 2, 3, 2);
        assert_eq!(l.dp(), 2);
        for r in l.span().ranks() {
            let c = l.coords(r).expect("inside");
            assert_eq!(l.rank(c), r);
        }
        assert_eq!(l.coords(7), None);
        assert_eq!(l.coords(32), None);
        let c = l.coords(8 + 1 + 2 * 2 + 6 + 12).expect("inside");
        assert_eq!(c, Coords { tp_idx: 1, cp_idx: 2, dp_idx: 1, pp_idx: 1 });
    }

    #[test]
    fn leaders_of_tp2_pp2_dp2_grid() {
        // EXAMPLES.md case 4: local index = tp + 2*(dp + 2*pp).
        let l = layout(Span::new(0, 8), 2, 1, 2);
        assert_eq!(l.stage_ranks(0, 1), vec![4, 5]);
        assert_eq!(l.stage_ranks(1, 1), vec![6, 7]);
        assert_eq!(l.stage_ranks(0, 0), vec![0, 1]);
        assert_eq!(l.group(&[Axis::Pp], 5), vec![1, 5]);
        assert_eq!(l.group(&[Axis::Dp], 5), vec![5, 7]);
        assert_eq!(l.group(&[Axis::Tp, Axis::Dp], 0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn expert_view_refactors_the_same_ranks() {
        let spec = LayoutSpec { tp: 2, cp: 1, pp: 1, ep: 4, etp: Some(1), sp: false };
        let l = ModuleLayout::new("llm", Span::new(0, 8), spec).expect("valid");
        assert_eq!((l.etp(), l.ep(), l.edp()), (1, 4, 2));
        assert_eq!(l.group(&[Axis::Ep], 5), vec![4, 5, 6, 7]);
        assert_eq!(l.group(&[Axis::Edp], 5), vec![1, 5]);
        let c = l.expert_coords(6).expect("inside");
        assert_eq!((c.etp_idx, c.ep_idx, c.edp_idx), (0, 2, 1));
    }

    #[test]
    fn arithmetic_errors_name_the_numbers() {
        let spec = LayoutSpec { tp: 4, cp: 2, ..LayoutSpec::default() };
        let e = ModuleLayout::new("llm", Span::new(0, 12), spec).expect_err("12 % 8 != 0");
        assert_eq!(
            e.to_string(),
            "modules.llm.parallel: tp(4) * cp(2) * pp(1) = 8 does not divide span [0, 12) of 12 ranks"
        );
        let spec = LayoutSpec { tp: 2, ep: 3, ..LayoutSpec::default() };
        let e = ModuleLayout::new("llm", Span::new(0, 8), spec).expect_err("ep 3");
        assert_eq!(
            e.to_string(),
            "modules.llm.parallel: etp(2) * ep(3) = 6 does not divide tp(2) * cp(1) * dp(4) = 8"
        );
    }

    /// `groups` cuts the span into exactly the groups `group` gives each rank, for every set
    /// of axes of either view, on offset spans with every axis above 1 somewhere.
    #[test]
    fn groups_are_each_ranks_group_once() {
        // Every nonempty set of one view's axes.
        let subsets: Vec<Vec<Axis>> = [Axis::DENSE, Axis::EXPERT]
            .iter()
            .flat_map(|view| {
                (1..16u32).map(move |bits| {
                    let mine = view.iter().enumerate().filter(move |(i, _)| bits >> i & 1 == 1);
                    mine.map(|(_, &a)| a).collect()
                })
            })
            .collect();
        let specs = [
            (Span::new(8, 32), LayoutSpec { tp: 2, cp: 3, pp: 2, ..LayoutSpec::default() }),
            (Span::new(3, 19), LayoutSpec { tp: 2, cp: 2, pp: 2, ..LayoutSpec::default() }),
            (Span::new(0, 16), LayoutSpec { tp: 2, cp: 1, pp: 2, ep: 2, etp: Some(1), sp: false }),
        ];
        for (span, spec) in specs {
            let l = ModuleLayout::new("m", span, spec).expect("valid");
            for axes in &subsets {
                let want: std::collections::BTreeSet<Vec<usize>> =
                    span.ranks().map(|r| l.group(axes, r)).collect();
                let got = l.groups(axes);
                assert_eq!(got.len(), want.len(), "{axes:?} on {span}");
                assert!(got.windows(2).all(|w| w[0][0] < w[1][0]), "{axes:?}: by lowest rank");
                assert_eq!(
                    got.into_iter().collect::<std::collections::BTreeSet<_>>(),
                    want,
                    "{axes:?}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "mix the dense and expert views")]
    fn mixed_view_groups_are_a_bug() {
        layout(Span::new(0, 4), 2, 1, 1).group(&[Axis::Tp, Axis::Ep], 0);
    }
}
