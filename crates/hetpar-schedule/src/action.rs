//! The actions of a per-rank schedule and the messages they post.
//!
//! A rank runs its actions in order. Compute actions (forward, backward, optimizer step,
//! offload, reload) never wait. Communication actions post one or more messages and complete
//! when every message they posted has completed; a message completes once every one of its
//! participants has posted it (rendezvous, like a batch of isend/irecv followed by a wait,
//! or a collective). Every message names its participants, so posts can be matched and a
//! missing one named.

use std::sync::Arc;

use hetpar_layout::{Direction, EdgeId, ModuleId};

/// Forward or backward pass of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    /// Forward.
    Forward,
    /// Backward.
    Backward,
}

/// Forward or backward of one virtual stage of a module for one microbatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Compute {
    /// Which pass.
    pub pass: Pass,
    /// Module.
    pub module: ModuleId,
    /// Virtual stage `chunk * pp + stage` (the stage itself without interleaving).
    pub vstage: usize,
    /// Global microbatch.
    pub mb: usize,
}

/// What a message carries; with its participants it identifies the message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MsgId {
    /// Output activation of `vstage`'s forward for `mb`, from rank `from` to rank `to`.
    Act {
        /// Module.
        module: ModuleId,
        /// Producing virtual stage.
        vstage: usize,
        /// Microbatch.
        mb: usize,
        /// Sender.
        from: usize,
        /// Receiver.
        to: usize,
    },
    /// Input gradient of `vstage`'s backward for `mb`, from rank `from` to rank `to`.
    Grad {
        /// Module.
        module: ModuleId,
        /// Producing virtual stage.
        vstage: usize,
        /// Microbatch.
        mb: usize,
        /// Sender.
        from: usize,
        /// Receiver.
        to: usize,
    },
    /// The boundary transform of `edge` for `mb` (its participants are the source's last
    /// stage and the destination's first stage).
    Boundary {
        /// Edge.
        edge: EdgeId,
        /// Microbatch.
        mb: usize,
        /// Forward (activations) or backward (gradients).
        dir: Direction,
    },
    /// Gradient reduction of `module` over the data- and context-parallel group whose lowest
    /// rank is `group`.
    Reduce {
        /// Module.
        module: ModuleId,
        /// Lowest rank of the group.
        group: usize,
    },
}

/// This rank's side of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Provides the data.
    Send,
    /// Receives the data.
    Recv,
    /// Takes part in a collective.
    Member,
}

/// One message posted by an action.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Post {
    /// What it carries.
    pub msg: MsgId,
    /// This rank's side.
    pub role: Role,
    /// Every participant, ascending (this rank included). One list shared by every
    /// participant's post: a boundary transform or a reduction over thousands of ranks
    /// would otherwise hold the square of them.
    pub participants: Arc<[usize]>,
}

/// One step of a rank's schedule.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward or backward of a stage.
    Compute(Compute),
    /// Pipeline (and, in graph-aware schedules, boundary) messages posted together.
    Comm(Vec<Post>),
    /// A standalone boundary transform (three-phase schedules).
    Boundary(Post),
    /// Gradient reduction of a module.
    Reduce(Post),
    /// Optimizer step of a module.
    Step(ModuleId),
    /// Move a module's parameters and optimizer state to host memory.
    Offload(ModuleId),
    /// Bring them back.
    Reload(ModuleId),
}

impl Action {
    /// Messages this action posts.
    pub fn posts(&self) -> &[Post] {
        match self {
            Action::Comm(p) => p,
            Action::Boundary(p) | Action::Reduce(p) => std::slice::from_ref(p),
            _ => &[],
        }
    }

    /// Whether the action moves boundary rows.
    pub fn has_boundary(&self) -> bool {
        self.posts().iter().any(|p| matches!(p.msg, MsgId::Boundary { .. }))
    }

    /// The module whose work this is, if any (for colouring).
    pub fn module(&self) -> Option<ModuleId> {
        match self {
            Action::Compute(c) => Some(c.module),
            Action::Step(m) | Action::Offload(m) | Action::Reload(m) => Some(*m),
            Action::Reduce(p) => match p.msg {
                MsgId::Reduce { module, .. } => Some(module),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Names used to print actions: module names, each edge's source, the stages per module
/// and the module whose grid cells carry no prefix (the LLM).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Labels {
    /// Module names by id.
    pub modules: Vec<String>,
    /// Source module of each edge.
    pub edge_src: Vec<ModuleId>,
    /// Destination module of each edge.
    pub edge_dst: Vec<ModuleId>,
    /// Physical pipeline stages per module.
    pub pp: Vec<usize>,
    /// Module whose cells have no prefix.
    pub sink: ModuleId,
}

impl Labels {
    fn initial(&self, m: ModuleId) -> String {
        self.modules[m]
            .chars()
            .next()
            .map(|c| c.to_ascii_lowercase().to_string())
            .unwrap_or_default()
    }

    fn prefix(&self, m: ModuleId) -> String {
        if m == self.sink { String::new() } else { self.initial(m) }
    }

    /// The grid cell of `action`: `F3`, `vB1`, `F3.1` (chunk 1), `>v2` / `<v2` (boundary
    /// forward / backward of the edge from `v...` for microbatch 2), `AR` (reduce), `OPT`,
    /// `voff`, `von`; empty for pure pipeline messages.
    pub fn cell(&self, action: &Action) -> String {
        match action {
            Action::Compute(c) => {
                let p = if c.pass == Pass::Forward { 'F' } else { 'B' };
                let chunk = c.vstage / self.pp[c.module];
                let suffix = if chunk > 0 { format!(".{chunk}") } else { String::new() };
                format!("{}{p}{}{suffix}", self.prefix(c.module), c.mb)
            }
            Action::Comm(_) | Action::Boundary(_) => {
                let mut parts: Vec<String> = action
                    .posts()
                    .iter()
                    .filter_map(|p| match p.msg {
                        MsgId::Boundary { edge, mb, dir } => {
                            let arrow = if dir == Direction::Forward { '>' } else { '<' };
                            Some(format!("{arrow}{}{mb}", self.initial(self.edge_src[edge])))
                        }
                        _ => None,
                    })
                    .collect();
                parts.dedup();
                parts.join("")
            }
            Action::Reduce(_) => format!("{}AR", self.prefix(action.module().unwrap_or(self.sink))),
            Action::Step(m) => format!("{}OPT", self.prefix(*m)),
            Action::Offload(m) => format!("{}off", self.initial(*m)),
            Action::Reload(m) => format!("{}on", self.initial(*m)),
        }
    }

    /// A message in words, for errors.
    pub fn message(&self, msg: &MsgId) -> String {
        match *msg {
            MsgId::Act { module, vstage, mb, from, to } => format!(
                "activation of {} stage {vstage} mb {mb} from rank {from} to rank {to}",
                self.modules[module]
            ),
            MsgId::Grad { module, vstage, mb, from, to } => format!(
                "gradient of {} stage {vstage} mb {mb} from rank {from} to rank {to}",
                self.modules[module]
            ),
            MsgId::Boundary { edge, mb, dir } => format!(
                "boundary {} {} -> {} mb {mb}",
                if dir == Direction::Forward { "forward" } else { "backward" },
                self.modules[self.edge_src[edge]],
                self.modules[self.edge_dst[edge]]
            ),
            MsgId::Reduce { module, group } => {
                format!("gradient reduction of {} (group of rank {group})", self.modules[module])
            }
        }
    }

    /// An action in words, for errors: `send activation of llm stage 0 mb 2 ...`.
    pub fn action(&self, action: &Action) -> String {
        match action {
            Action::Compute(c) => format!(
                "{} of {} stage {} mb {}",
                if c.pass == Pass::Forward { "forward" } else { "backward" },
                self.modules[c.module],
                c.vstage,
                c.mb
            ),
            Action::Comm(_) | Action::Boundary(_) | Action::Reduce(_) => {
                let parts: Vec<String> = action
                    .posts()
                    .iter()
                    .map(|p| {
                        let role = match p.role {
                            Role::Send => "send",
                            Role::Recv => "recv",
                            Role::Member => "join",
                        };
                        format!("{role} {}", self.message(&p.msg))
                    })
                    .collect();
                if parts.is_empty() { "empty communication".to_string() } else { parts.join(" + ") }
            }
            Action::Step(m) => format!("optimizer step of {}", self.modules[*m]),
            Action::Offload(m) => format!("offload of {}", self.modules[*m]),
            Action::Reload(m) => format!("reload of {}", self.modules[*m]),
        }
    }
}
