//! A module's parallel context on one rank: its coordinates and the communicators of its
//! groups. Built from the world communicator and the module's layout; passed explicitly to
//! every layer (there is no global state).

use std::sync::Arc;

use hetpar_comm::{CommExt, Communicator, Counted, Traffic};
use hetpar_layout::{Axis, Coords, ExpertCoords, ModuleLayout};

use crate::error::{NnError, Result};

/// One group of a module: its members (world ranks), this rank's index, and a communicator
/// when it has more than one member (a group of one never communicates).
#[derive(Clone)]
pub struct Group {
    comm: Option<Arc<dyn Communicator>>,
    /// World ranks of the members, ascending.
    pub ranks: Vec<usize>,
    /// This rank's index among them.
    pub rank: usize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group({:?}, rank {})", self.ranks, self.rank)
    }
}

impl Group {
    /// Members.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The communicator, if the group has more than one member.
    pub fn comm(&self) -> Option<&Arc<dyn Communicator>> {
        self.comm.as_ref()
    }

    fn new(world: &dyn Communicator, ranks: Vec<usize>) -> Result<Group> {
        let me = world.global_rank();
        let rank = ranks.iter().position(|&r| r == me).expect("a rank is in its own groups");
        let comm = if ranks.len() > 1 { Some(Arc::from(world.subgroup(&ranks)?)) } else { None };
        Ok(Group { comm, ranks, rank })
    }
}

/// Coordinates and groups of one rank in one module.
#[derive(Debug)]
pub struct ParallelCtx {
    /// The module's layout.
    pub layout: ModuleLayout,
    /// This rank's world rank.
    pub rank: usize,
    /// Dense coordinates.
    pub coords: Coords,
    /// Expert-view coordinates.
    pub expert: ExpertCoords,
    /// Tensor-parallel peers.
    pub tp: Group,
    /// Context-parallel peers.
    pub cp: Group,
    /// Data-parallel peers.
    pub dp: Group,
    /// Data- and context-parallel peers: where dense gradients are summed.
    pub dp_cp: Group,
    /// Every rank of this pipeline stage (tp x cp x dp): ranks holding disjoint tokens once
    /// the MoE layer splits replicated ones.
    pub stage: Group,
    /// Expert-parallel peers (MoE dispatch).
    pub ep: Group,
    /// Expert data-parallel peers: where expert gradients are summed.
    pub edp: Group,
    /// What this rank has put into the module's groups (collectives and messages).
    pub traffic: Arc<Traffic>,
}

impl ParallelCtx {
    /// The context of this rank (`world.global_rank()`) in the module laid out by `layout`.
    /// Every rank of the module must call it, in the same order relative to other modules:
    /// groups are created in one fixed axis order.
    pub fn new(world: &dyn Communicator, layout: &ModuleLayout) -> Result<Arc<ParallelCtx>> {
        let rank = world.global_rank();
        let (Some(coords), Some(expert)) = (layout.coords(rank), layout.expert_coords(rank)) else {
            return Err(NnError::Input(format!(
                "rank {rank} is not in module {} (ranks {})",
                layout.name(),
                layout.span()
            )));
        };
        let traffic = Arc::new(Traffic::default());
        let counted = Counted::new(Box::new(world), traffic.clone());
        let group = |axes: &[Axis]| Group::new(&counted, layout.group(axes, rank));
        Ok(Arc::new(ParallelCtx {
            layout: layout.clone(),
            rank,
            coords,
            expert,
            tp: group(&[Axis::Tp])?,
            cp: group(&[Axis::Cp])?,
            dp: group(&[Axis::Dp])?,
            dp_cp: group(&[Axis::Dp, Axis::Cp])?,
            stage: group(&[Axis::Tp, Axis::Cp, Axis::Dp])?,
            ep: group(&[Axis::Ep])?,
            edp: group(&[Axis::Edp])?,
            traffic,
        }))
    }

    /// Whether sequence parallelism is on (and does something: tp > 1).
    pub fn sp(&self) -> bool {
        self.layout.sp() && self.layout.tp() > 1
    }
}
