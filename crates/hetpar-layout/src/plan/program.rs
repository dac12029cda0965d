//! Per-rank boundary programs: buffers, row segments and the operations that move them.
//!
//! Every rank owns three row buffers. `Held` is the source layout (rows the rank holds after
//! the source forward, in held order), `Needed` the destination layout (rows it needs, in
//! local position order), `Stage` scratch for rows in transit. A forward reads `Held` and
//! fills `Needed`; a backward reads gradients from `Needed` and fills `Held`. Operations
//! address rows by buffer and slot, so the executor walks them without re-deriving anything,
//! and messages are the concatenation of their segments.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// A per-rank row buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Buf {
    /// Source-layout rows (gradients in the backward).
    Held,
    /// Destination-layout rows (gradients in the backward).
    Needed,
    /// Scratch for rows in transit.
    Stage,
}

impl Buf {
    fn letter(self) -> char {
        match self {
            Buf::Held => 'H',
            Buf::Needed => 'N',
            Buf::Stage => 'S',
        }
    }
}

/// `len` consecutive rows of `buf` from slot `start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    /// Buffer.
    pub buf: Buf,
    /// First slot.
    pub start: usize,
    /// Number of rows.
    pub len: usize,
}

/// An ordered list of row segments: the layout of one message (or copy) on one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Segs(pub Vec<Seg>);

impl Segs {
    /// Appends one row, merging with the last segment when contiguous.
    pub fn push(&mut self, buf: Buf, slot: usize) {
        if let Some(last) = self.0.last_mut()
            && last.buf == buf
            && last.start + last.len == slot
        {
            last.len += 1;
            return;
        }
        self.0.push(Seg { buf, start: slot, len: 1 });
    }

    /// Total rows.
    pub fn rows(&self) -> usize {
        self.0.iter().map(|s| s.len).sum()
    }

    /// True when no row is listed.
    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    /// Every `(buf, slot)` in order.
    pub fn slots(&self) -> impl Iterator<Item = (Buf, usize)> + '_ {
        self.0.iter().flat_map(|s| (s.start..s.start + s.len).map(move |i| (s.buf, i)))
    }
}

impl fmt::Display for Segs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(" ")?;
            }
            match s.len {
                1 => write!(f, "{}[{}]", s.buf.letter(), s.start)?,
                _ => write!(f, "{}[{}..{}]", s.buf.letter(), s.start, s.start + s.len)?,
            }
        }
        Ok(())
    }
}

/// One step of a rank's boundary program. Collectives appear, identical in kind and group,
/// in the program of every member of `group`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Local copy, row by row.
    Copy {
        /// Rows read.
        from: Segs,
        /// Rows written, same count.
        to: Segs,
    },
    /// Point-to-point send of the rows of `rows`, packed in order.
    Send {
        /// Receiving rank.
        peer: usize,
        /// Rows sent.
        rows: Segs,
    },
    /// Point-to-point receive, unpacked into `rows` in order.
    Recv {
        /// Sending rank.
        peer: usize,
        /// Where the rows land.
        rows: Segs,
    },
    /// All-to-all-v over `group` (ascending ranks): `(i, rows)` in `send` go to `group[i]`,
    /// in `recv` come from `group[i]`. Only the members a rank exchanges rows with are
    /// listed, ascending by `i` (never this rank itself): over a colocated world of `n`
    /// ranks a rank's lists name its few peers, not all `n` (lists of every member on every
    /// rank, `n^2` of them in a whole plan, took the planner to 2.2 GB at 4,096 ranks).
    /// Members' ops share one `group`.
    AllToAllV {
        /// Member ranks, ascending.
        group: Arc<[usize]>,
        /// Rows to each member sent to: `(index in group, rows)`.
        send: Vec<(usize, Segs)>,
        /// Rows from each member received from: `(index in group, rows)`.
        recv: Vec<(usize, Segs)>,
    },
    /// All-gather-v over `group`: member `i` contributes `counts[i]` rows; every member
    /// receives the concatenation of all contributions, in member order, at `into`.
    AllGatherV {
        /// Member ranks, ascending.
        group: Vec<usize>,
        /// This rank's contribution.
        send: Segs,
        /// Rows contributed by each member.
        counts: Vec<usize>,
        /// Where the concatenation lands (a `Stage` range of `sum(counts)` rows).
        into: Seg,
    },
    /// Broadcast of `root`'s rows to every member of `group`.
    Broadcast {
        /// Member ranks, ascending.
        group: Vec<usize>,
        /// Sending rank.
        root: usize,
        /// Rows read on the root, written on the others.
        rows: Segs,
    },
}

impl Op {
    /// The collective's group, or `None` for local and point-to-point operations.
    pub fn group(&self) -> Option<&[usize]> {
        match self {
            Op::AllToAllV { group, .. } => Some(group),
            Op::AllGatherV { group, .. } | Op::Broadcast { group, .. } => Some(group),
            _ => None,
        }
    }

    /// `(sent, received)` rows of this operation on `rank`. Collectives count logical
    /// transfers: an all-gather-v sends its contribution to every other member, a broadcast
    /// root sends to every other member.
    pub fn traffic(&self, rank: usize) -> (usize, usize) {
        match self {
            Op::Copy { .. } => (0, 0),
            Op::Send { rows, .. } => (rows.rows(), 0),
            Op::Recv { rows, .. } => (0, rows.rows()),
            Op::AllToAllV { send, recv, .. } => {
                let rows = |l: &[(usize, Segs)]| l.iter().map(|(_, s)| s.rows()).sum();
                (rows(send), rows(recv))
            }
            Op::AllGatherV { group, counts, .. } => {
                let me = group.iter().position(|&m| m == rank).expect("a member's own op");
                all_gather_traffic(counts, me)
            }
            Op::Broadcast { group, root, rows } if *root == rank => {
                (rows.rows() * (group.len() - 1), 0)
            }
            Op::Broadcast { rows, .. } => (0, rows.rows()),
        }
    }
}

/// `(sent, received)` rows of member `i` of an all-gather-v of `counts`: it sends its
/// contribution to every other member and receives every other member's.
pub fn all_gather_traffic(counts: &[usize], i: usize) -> (usize, usize) {
    let own = counts[i];
    (own * (counts.len() - 1), counts.iter().sum::<usize>() - own)
}

/// Compact rank list: `0-7`, `0,2,4`, `8-9,12`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{}-{}", ranks[i], ranks[j]) } else { ranks[i].to_string() });
        i = j + 1;
    }
    out.join(",")
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let per_peer = |group: &[usize], lists: &[(usize, Segs)]| -> String {
            let parts: Vec<String> = lists
                .iter()
                .filter(|(_, s)| !s.is_empty())
                .map(|(i, s)| match group.get(*i) {
                    Some(r) => format!("{r}:{}", s.rows()),
                    // A malformed op prints rather than panics (the symbolic executor names it).
                    None => format!("member {i} of {}?:{}", group.len(), s.rows()),
                })
                .collect();
            if parts.is_empty() { "-".to_string() } else { parts.join(" ") }
        };
        match self {
            Op::Copy { from, to } => write!(f, "copy {from} -> {to}"),
            Op::Send { peer, rows } => write!(f, "send {} rows to {peer} from {rows}", rows.rows()),
            Op::Recv { peer, rows } => {
                write!(f, "recv {} rows from {peer} into {rows}", rows.rows())
            }
            Op::AllToAllV { group, send, recv } => write!(
                f,
                "all-to-all-v over {}: send {}; recv {}",
                rank_list(group),
                per_peer(group, send),
                per_peer(group, recv)
            ),
            Op::AllGatherV { group, send, counts, into } => write!(
                f,
                "all-gather-v over {}: contribute {} rows{}, gather {} into {}",
                rank_list(group),
                send.rows(),
                if send.is_empty() { String::new() } else { format!(" from {send}") },
                counts.iter().sum::<usize>(),
                Segs(vec![*into])
            ),
            Op::Broadcast { group, root, rows } => write!(
                f,
                "broadcast over {} from {root}: {} rows at {rows}",
                rank_list(group),
                rows.rows()
            ),
        }
    }
}

/// The boundary program of every rank for one direction of one edge and microbatch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Program {
    /// Operations per rank, run in order. Every rank of either module has an entry.
    pub ops: BTreeMap<usize, Vec<Op>>,
    /// Stage rows each rank must allocate.
    pub stage_rows: BTreeMap<usize, usize>,
}

impl Program {
    /// Keeps `rank`'s operations and stage rows alone (a share planned from a view, whose
    /// other ranks' lists would be partial).
    pub(crate) fn keep_only(&mut self, rank: usize) {
        self.ops.retain(|&r, _| r == rank);
        self.stage_rows.retain(|&r, _| r == rank);
    }

    /// An empty program for `ranks`.
    pub fn for_ranks(ranks: impl Iterator<Item = usize>) -> Program {
        let ops: BTreeMap<usize, Vec<Op>> = ranks.map(|r| (r, Vec::new())).collect();
        let stage_rows = ops.keys().map(|&r| (r, 0)).collect();
        Program { ops, stage_rows }
    }

    /// Appends `op` to `rank`'s program.
    pub fn push(&mut self, rank: usize, op: Op) {
        self.ops.entry(rank).or_default().push(op);
    }

    /// Reserves `n` stage rows on `rank`; returns the first slot.
    pub fn alloc_stage(&mut self, rank: usize, n: usize) -> usize {
        let used = self.stage_rows.entry(rank).or_insert(0);
        let start = *used;
        *used += n;
        start
    }

    /// Emits point-to-point messages keyed by `(sender, receiver)`, each with the rows read
    /// on the sender and the slots written on the receiver. Every sender's sends are ordered
    /// by receiver and every receiver's receives by sender; when no rank both sends and
    /// receives in the batch, that order cannot deadlock even with rendezvous sends.
    pub fn push_messages(&mut self, msgs: &BTreeMap<(usize, usize), (Segs, Segs)>) {
        for (&(s, t), (send, _)) in msgs {
            self.push(s, Op::Send { peer: t, rows: send.clone() });
        }
        let mut by_receiver: Vec<_> = msgs.iter().collect();
        by_receiver.sort_by_key(|((s, t), _)| (*t, *s));
        for ((s, t), (_, recv)) in by_receiver {
            self.push(*t, Op::Recv { peer: *s, rows: recv.clone() });
        }
    }

    /// Rows each rank sends and receives.
    pub fn traffic(&self) -> Traffic {
        let mut t = Traffic::default();
        for (&rank, ops) in &self.ops {
            let (mut s, mut r) = (0, 0);
            for op in ops {
                let (a, b) = op.traffic(rank);
                s += a;
                r += b;
            }
            t.sent.insert(rank, s);
            t.received.insert(rank, r);
        }
        t
    }
}

/// Rows sent and received per rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Rows each rank sends.
    pub sent: BTreeMap<usize, usize>,
    /// Rows each rank receives.
    pub received: BTreeMap<usize, usize>,
}

impl Traffic {
    /// Rows moved in total (equal to the sum of rows sent).
    pub fn total(&self) -> usize {
        self.received.values().sum()
    }
}
