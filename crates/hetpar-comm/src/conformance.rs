//! The backend conformance suite (feature `testing`): one body per operation, run on every
//! backend by the local tests and by the MPI runner under `mpirun`. Inputs are small
//! integers, so every reduction is exact in any order and results can be compared bitwise;
//! `sum_order_*` alone feeds sums whose rounding depends on the order, which every backend
//! must take as the members' order.

use half::bf16;

use crate::comm::{CommExt, Communicator, P2p};
use crate::dtype::{DType, Element, ReduceOp};

/// A conformance check: `Ok` or what went wrong on this rank.
pub type Check = fn(&dyn Communicator) -> Result<(), String>;

/// Every check, by name.
pub const SUITE: &[(&str, Check)] = &[
    ("barrier", barrier),
    ("longer_waits", longer_waits),
    ("all_reduce_f32", all_reduce::<f32>),
    ("all_reduce_f64", all_reduce::<f64>),
    ("all_reduce_i64", all_reduce::<i64>),
    ("all_reduce_bf16", all_reduce::<bf16>),
    ("sum_order_f32", sum_order::<f32>),
    ("sum_order_f64", sum_order::<f64>),
    ("broadcast", broadcast),
    ("all_gather", all_gather),
    ("all_gather_v", all_gather_v),
    ("reduce_scatter", reduce_scatter),
    ("interleaved", interleaved),
    ("all_to_all_v", all_to_all_v),
    ("point_to_point", point_to_point),
    ("message_lengths", message_lengths),
    ("batched_point_to_point", batched_point_to_point),
    ("overlapping_subgroups", overlapping_subgroups),
    ("many_groups_in_flight", many_groups_in_flight),
];

/// Lengths that catch off-by-one chunking: empty, one, odd, larger than the group.
pub const LENGTHS: [usize; 5] = [0, 1, 7, 1000, 4099];

/// Values that survive a round trip through every element type exactly.
pub trait Exact: Element + PartialEq + std::fmt::Debug {
    /// The element for a small integer.
    fn of(v: i64) -> Self;
}
impl Exact for f32 {
    fn of(v: i64) -> Self {
        v as f32
    }
}
impl Exact for f64 {
    fn of(v: i64) -> Self {
        v as f64
    }
}
impl Exact for i64 {
    fn of(v: i64) -> Self {
        v
    }
}
impl Exact for bf16 {
    fn of(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}

fn fail(comm: &dyn Communicator, what: String) -> String {
    format!("rank {} of {} ({}): {what}", comm.global_rank(), comm.size(), comm.backend())
}

fn ok<T>(comm: &dyn Communicator, r: crate::Result<T>, what: &str) -> Result<T, String> {
    r.map_err(|e| fail(comm, format!("{what}: {e}")))
}

fn barrier(c: &dyn Communicator) -> Result<(), String> {
    for _ in 0..3 {
        ok(c, c.barrier(), "barrier")?;
    }
    Ok(())
}

fn value(rank: usize, i: usize) -> i64 {
    ((rank * 31 + i * 7) % 13) as i64 - 6
}

fn all_reduce<T: Exact>(c: &dyn Communicator) -> Result<(), String> {
    let n = c.size();
    for &len in &LENGTHS {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
            let mut data: Vec<T> = (0..len).map(|i| T::of(value(c.rank(), i))).collect();
            ok(c, c.all_reduce(&mut data, op), "all-reduce")?;
            for (i, got) in data.iter().enumerate() {
                let vals = (0..n).map(|r| value(r, i));
                let want = match op {
                    ReduceOp::Sum => vals.sum(),
                    ReduceOp::Max => vals.max().expect("members"),
                    ReduceOp::Min => vals.min().expect("members"),
                };
                if *got != T::of(want) {
                    return Err(fail(
                        c,
                        format!(
                            "all-reduce {} of {len}: element {i} is {got:?}, want {want}",
                            op.name()
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Floats whose sum rounds differently by order: the contract is the members' order
/// (`((x0 + x1) + x2) + ...`), the local backend's, so a run gives the same bits on every
/// backend. At element `i`, one member holds 1e17 (which absorbs a 1 in f32 and f64 alike),
/// the next its negation and the rest 1: in member order the large pair cancels before or
/// after the ones are absorbed, depending on where the pair sits. All-reduce and
/// reduce-scatter.
fn sum_order<T>(c: &dyn Communicator) -> Result<(), String>
where
    T: Exact + Copy + std::ops::Add<Output = T> + std::ops::Neg<Output = T>,
{
    let n = c.size();
    let big = T::of(100_000_000_000_000_000);
    let v = |m: usize, i: usize| -> T {
        if m == i % n {
            big
        } else if m == (i + 1) % n {
            -big
        } else {
            T::of(1)
        }
    };
    let want = |i: usize| (1..n).fold(v(0, i), |acc, m| acc + v(m, i));
    let check = |what: &str, i: usize, got: T| {
        if got == want(i) {
            return Ok(());
        }
        let w = want(i);
        Err(fail(c, format!("{what}: element {i} is {got:?}, want {w:?} (member order)")))
    };
    let len = 64 * n;
    let mut data: Vec<T> = (0..len).map(|i| v(c.rank(), i)).collect();
    ok(c, c.all_reduce(&mut data, ReduceOp::Sum), "all-reduce")?;
    for (i, &got) in data.iter().enumerate() {
        check("all-reduce sum", i, got)?;
    }
    let send: Vec<T> = (0..len).map(|i| v(c.rank(), i)).collect();
    let mut recv = vec![T::of(0); 64];
    ok(c, c.reduce_scatter(&send, &mut recv, ReduceOp::Sum), "reduce-scatter")?;
    for (k, &got) in recv.iter().enumerate() {
        check("reduce-scatter sum", c.rank() * 64 + k, got)?;
    }
    // Interleaved, 4 runs of n blocks of 16: run o's block m is elements (o n + m) 16 ...
    let mut recv = vec![T::of(0); 64];
    let what = "reduce-scatter-interleaved";
    ok(c, c.reduce_scatter_interleaved(&send, &mut recv, ReduceOp::Sum, 4), what)?;
    for (k, &got) in recv.iter().enumerate() {
        check("reduce-scatter-interleaved sum", ((k / 16) * n + c.rank()) * 16 + k % 16, got)?;
    }
    Ok(())
}

/// A phase allowed to wait longer than the timeout, as a checkpoint's writes are
/// (`with_timeout`): with the timeout at 100 ms, a member arriving 300 ms late at a barrier
/// inside `with_timeout(10 s)` is no timeout, and the 100 ms are back afterwards.
fn longer_waits(c: &dyn Communicator) -> Result<(), String> {
    use std::time::Duration;
    let before = c.timeout();
    ok(c, c.barrier(), "barrier")?;
    let short = Duration::from_millis(100);
    c.set_timeout(short);
    let late = c.with_timeout(Duration::from_secs(10), || {
        if c.rank() == 1 {
            std::thread::sleep(3 * short);
        }
        c.barrier()
    });
    let after = c.timeout();
    c.set_timeout(before);
    ok(c, late, "barrier 300 ms late inside with_timeout(10 s)")?;
    if after != short {
        return Err(fail(
            c,
            format!("the timeout after with_timeout is {after:?}, want {short:?}"),
        ));
    }
    ok(c, c.barrier(), "barrier")
}

fn broadcast(c: &dyn Communicator) -> Result<(), String> {
    for root in 0..c.size() {
        for &len in &LENGTHS {
            let mut data: Vec<f64> = (0..len)
                .map(|i| if c.rank() == root { (root * 1000 + i) as f64 } else { -1.0 })
                .collect();
            ok(c, c.broadcast(&mut data, root), "broadcast")?;
            if let Some(i) = (0..len).find(|&i| data[i] != (root * 1000 + i) as f64) {
                return Err(fail(
                    c,
                    format!("broadcast from {root} of {len}: element {i} is {}", data[i]),
                ));
            }
        }
    }
    Ok(())
}

fn all_gather(c: &dyn Communicator) -> Result<(), String> {
    for &len in &[0usize, 3, 1001] {
        let send: Vec<i64> = (0..len).map(|j| (c.rank() * 10_000 + j) as i64).collect();
        let mut recv = vec![-1i64; len * c.size()];
        ok(c, c.all_gather(&send, &mut recv), "all-gather")?;
        for r in 0..c.size() {
            for j in 0..len {
                if recv[r * len + j] != (r * 10_000 + j) as i64 {
                    return Err(fail(
                        c,
                        format!(
                            "all-gather of {len}: part {r} element {j} is {}",
                            recv[r * len + j]
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

fn all_gather_v(c: &dyn Communicator) -> Result<(), String> {
    // Short parts, then long ones with empty parts between (several rounds where a
    // transport gathers in pieces, with parts crossing their edges).
    let rules: [fn(usize) -> usize; 2] =
        [|j| (j * 3 + 1) % 4, |j| if j % 3 == 1 { 0 } else { (j * 37 + 5) % 60 }];
    for rule in rules {
        let counts: Vec<usize> = (0..c.size()).map(rule).collect();
        let send: Vec<f32> = (0..counts[c.rank()]).map(|j| (c.rank() * 100 + j) as f32).collect();
        let mut recv = vec![-1.0f32; counts.iter().sum()];
        ok(c, c.all_gather_v(&send, &mut recv, &counts), "all-gather-v")?;
        let want: Vec<f32> =
            (0..c.size()).flat_map(|r| (0..counts[r]).map(move |j| (r * 100 + j) as f32)).collect();
        if recv != want {
            return Err(fail(
                c,
                format!("all-gather-v with counts {counts:?}: got {recv:?}, want {want:?}"),
            ));
        }
    }
    Ok(())
}

fn reduce_scatter(c: &dyn Communicator) -> Result<(), String> {
    let n = c.size();
    for block in [0usize, 1, 5, 777] {
        let send: Vec<f64> = (0..n * block).map(|k| (c.rank() + k) as f64).collect();
        let mut recv = vec![0.0f64; block];
        ok(c, c.reduce_scatter(&send, &mut recv, ReduceOp::Sum), "reduce-scatter")?;
        for (i, got) in recv.iter().enumerate() {
            let want: usize = (0..n).map(|r| r + c.rank() * block + i).sum();
            if *got != want as f64 {
                return Err(fail(
                    c,
                    format!("reduce-scatter of block {block}: element {i} is {got}, want {want}"),
                ));
            }
        }
    }
    Ok(())
}

/// The interleaved all-gather and reduce-scatter (a split along a tensor's middle
/// dimension): every member's runs in their places, and each run's block reduced, for
/// empty, single and uneven runs.
fn interleaved(c: &dyn Communicator) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    for (outer, run) in [(0usize, 0usize), (1, 0), (1, 5), (3, 1), (4, 333)] {
        let send: Vec<i64> = (0..outer * run).map(|j| (me * 100_000 + j) as i64).collect();
        let mut recv = vec![-1i64; send.len() * n];
        ok(c, c.all_gather_interleaved(&send, &mut recv, outer), "all-gather-interleaved")?;
        let want: Vec<i64> = (0..outer)
            .flat_map(|o| (0..n).flat_map(move |m| (0..run).map(move |j| (m, o * run + j))))
            .map(|(m, j)| (m * 100_000 + j) as i64)
            .collect();
        if recv != want {
            return Err(fail(c, format!("all-gather-interleaved of {outer} runs of {run}")));
        }
        let block = run;
        let send: Vec<f32> = (0..outer * n * block).map(|k| ((me + 1) * (k % 97)) as f32).collect();
        let mut recv = vec![-1.0f32; outer * block];
        let what = "reduce-scatter-interleaved";
        ok(c, c.reduce_scatter_interleaved(&send, &mut recv, ReduceOp::Sum, outer), what)?;
        for (i, &got) in recv.iter().enumerate() {
            let k = ((i / block.max(1)) * n + me) * block + i % block.max(1);
            let want = (1..=n).map(|r| r * (k % 97)).sum::<usize>() as f32;
            if got != want {
                return Err(fail(c, format!("{what} of {outer} runs: element {i} is {got}")));
            }
        }
    }
    // Sizes that do not split are refused the same way everywhere, in elements and in
    // bytes: 5 elements in 2 runs, and blocks of 2 bytes of f32.
    let mut recv = vec![0i64; 5 * n];
    if c.all_gather_interleaved(&[1i64; 5], &mut recv, 2).is_ok() {
        return Err(fail(c, "5 elements in 2 runs were accepted".into()));
    }
    let how = (DType::F32, ReduceOp::Sum);
    if c.reduce_scatter_interleaved_bytes(&vec![0u8; 8 * n], &mut [0u8; 8], how, 4).is_ok() {
        return Err(fail(c, "f32 blocks of 2 bytes were accepted".into()));
    }
    Ok(())
}

fn all_to_all_v(c: &dyn Communicator) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    // Every member sending parts of 0, 1 and 10 elements, then one pair with a long part
    // and every other pair one element (where a transport sends long parts apart, only
    // that pair's two members do).
    let rules: [fn(usize, usize, usize) -> usize; 2] = [
        |from, to, _| [0, 1, 10][(from + 2 * to) % 3],
        |from, to, n| if from == 0 && to == n - 1 { 50 } else { 1 },
    ];
    let tag = |from: usize, to: usize, k: usize| (from * 1_000_000 + to * 1000 + k) as i64;
    for rule in rules {
        let count = |from: usize, to: usize| rule(from, to, n);
        let sc: Vec<usize> = (0..n).map(|j| count(me, j)).collect();
        let rc: Vec<usize> = (0..n).map(|j| count(j, me)).collect();
        let send: Vec<i64> = (0..n).flat_map(|j| (0..sc[j]).map(move |k| tag(me, j, k))).collect();
        let mut recv = vec![-1i64; rc.iter().sum()];
        ok(c, c.all_to_all_v(&send, &sc, &mut recv, &rc), "all-to-all-v")?;
        let want: Vec<i64> = (0..n).flat_map(|j| (0..rc[j]).map(move |k| tag(j, me, k))).collect();
        if recv != want {
            return Err(fail(
                c,
                format!("all-to-all-v with counts {sc:?} sent: got {recv:?}, want {want:?}"),
            ));
        }
    }
    Ok(())
}

fn point_to_point(c: &dyn Communicator) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    // A ring exchange with send_recv, for several sizes (the empty message included).
    for &len in &LENGTHS {
        let send: Vec<f32> = (0..len).map(|i| (me * 7 + i) as f32).collect();
        let mut recv = vec![-1.0f32; len];
        ok(c, c.send_recv(&send, next, 3, &mut recv, prev, 3), "send-recv ring")?;
        if let Some(i) = (0..len).find(|&i| recv[i] != (prev * 7 + i) as f32) {
            return Err(fail(
                c,
                format!("ring of {len}: element {i} from rank {prev} is {}", recv[i]),
            ));
        }
    }
    // Ordered pairs: even ranks send then receive, odd ranks receive then send; two tags
    // between the same pair keep their order per tag, and so do two longer messages on one
    // tag (a transport that cuts long messages into pieces, at a size forced small in a
    // test build, keeps them whole and apart; 8,000 bytes is a multiple of 64).
    if n >= 2 && me < n - n % 2 {
        let peer = me ^ 1;
        let a: Vec<i64> = vec![me as i64; 3];
        let b: Vec<i64> = vec![me as i64 + 100; 5];
        let long = |len: usize, who: usize| -> Vec<i64> {
            (0..len).map(|i| (who * 10_000 + len + i) as i64).collect()
        };
        let (mut ra, mut rb) = (vec![0i64; 3], vec![0i64; 5]);
        let (mut rc, mut rd) = (vec![0i64; 1000], vec![0i64; 1001]);
        let send = |c: &dyn Communicator| -> Result<(), String> {
            ok(c, c.send(&a, peer, 11), "send")?;
            ok(c, c.send(&b, peer, 12), "send")?;
            ok(c, c.send(&long(1000, me), peer, 13), "send")?;
            ok(c, c.send(&long(1001, me), peer, 13), "send")
        };
        if me % 2 == 0 {
            send(c)?;
        }
        ok(c, c.recv(&mut ra, peer, 11), "recv")?;
        ok(c, c.recv(&mut rb, peer, 12), "recv")?;
        ok(c, c.recv(&mut rc, peer, 13), "recv")?;
        ok(c, c.recv(&mut rd, peer, 13), "recv")?;
        if me % 2 == 1 {
            send(c)?;
        }
        if ra != vec![peer as i64; 3] || rb != vec![peer as i64 + 100; 5] {
            return Err(fail(c, format!("pair exchange with {peer}: got {ra:?} and {rb:?}")));
        }
        if rc != long(1000, peer) || rd != long(1001, peer) {
            return Err(fail(c, format!("long messages from {peer} differ")));
        }
    }
    Ok(())
}

/// A message longer than its receive is refused there as a mismatch and taken whole: the
/// next message on the same tag arrives intact (80 bytes, more than one piece where the
/// pieces are forced to 64 bytes, against a receive of 32).
fn message_lengths(c: &dyn Communicator) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    if n < 2 || me >= n - n % 2 {
        return Ok(());
    }
    let peer = me ^ 1;
    if me % 2 == 0 {
        ok(c, c.send(&[7i64; 10], peer, 21), "send")?;
        return ok(c, c.send(&[8i64, 9, 10], peer, 21), "send");
    }
    let mut short = [0i64; 4];
    match c.recv(&mut short, peer, 21) {
        Err(crate::CommError::Mismatch { detail, .. }) if detail.contains("sent 80 bytes") => {}
        other => {
            return Err(fail(c, format!("80 bytes into a receive of 32 gave {other:?}")));
        }
    }
    let mut next = [0i64; 3];
    ok(c, c.recv(&mut next, peer, 21), "recv after a refused message")?;
    if next != [8, 9, 10] {
        return Err(fail(c, format!("the message after a refused one is {next:?}")));
    }
    Ok(())
}

/// The content of message `tag` from `src` to `dst`, element `i`.
fn message(src: usize, dst: usize, tag: u32, i: usize) -> i64 {
    (src * 1000 + dst * 100 + tag as usize * 10 + i) as i64
}

fn batched_point_to_point(c: &dyn Communicator) -> Result<(), String> {
    let (n, me) = (c.size(), c.rank());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let len = |tag: u32| [0, 1, 7, 1000, 4099][tag as usize % 5];
    // Around the ring both ways, to itself, an empty message, two messages with one tag
    // (which keep their order), and the receives listed in another order than the peer
    // lists its sends: tags 1-4 go to `next`, tag 5 to `prev`, tag 6 to this rank.
    let out: Vec<(usize, u32, Vec<i64>)> = [(next, 1), (next, 2), (next, 3), (next, 3), (next, 4)]
        .into_iter()
        .chain([(prev, 5), (me, 6)])
        .enumerate()
        .map(|(k, (dst, tag))| {
            // The second tag-3 message differs from the first so order is visible.
            let extra = if k == 3 { 500 } else { 0 };
            (dst, tag, (0..len(tag)).map(|i| message(me, dst, tag, i) + extra).collect())
        })
        .collect();
    let mut expect: Vec<(usize, u32, Vec<i64>)> = [(me, 6), (next, 5), (prev, 4)]
        .into_iter()
        .chain([(prev, 3), (prev, 3), (prev, 2), (prev, 1)])
        .map(|(src, tag)| (src, tag, (0..len(tag)).map(|i| message(src, me, tag, i)).collect()))
        .collect();
    // Receives from prev with tag 3: the first as sent, the second with its offset.
    for x in &mut expect[4].2 {
        *x += 500;
    }
    let mut got: Vec<Vec<i64>> = expect.iter().map(|(_, _, v)| vec![-1; v.len()]).collect();
    {
        let mut ops: Vec<P2p<'_>> =
            out.iter().map(|(dst, tag, v)| P2p::send(v, *dst, *tag)).collect();
        for ((src, tag, _), buf) in expect.iter().zip(got.iter_mut()) {
            ops.push(P2p::recv(buf, *src, *tag));
        }
        // Receives first on odd ranks, sends first on even ones.
        if me % 2 == 1 {
            ops.rotate_left(out.len());
        }
        ok(c, c.batch_p2p(&mut ops), "batched ring")?;
    }
    for ((src, tag, want), got) in expect.iter().zip(&got) {
        if want != got {
            let at = (0..want.len()).find(|&i| want[i] != got[i]).unwrap_or(0);
            return Err(fail(
                c,
                format!(
                    "batch: message with tag {tag} from rank {src}: element {at} is {:?}, expected {:?}",
                    got.get(at),
                    want.get(at)
                ),
            ));
        }
    }
    // Everyone to everyone at once (blocking sends in this order would wait in a cycle),
    // receives listed from the highest peer down.
    let sends: Vec<Vec<f64>> = (0..n).map(|d| vec![(me * n + d) as f64; 64 + d]).collect();
    let mut recvs: Vec<Vec<f64>> = (0..n).map(|_| vec![-1.0; 64 + me]).collect();
    {
        let mut ops: Vec<P2p<'_>> =
            sends.iter().enumerate().map(|(d, v)| P2p::send(v, d, 8)).collect();
        for (s, buf) in recvs.iter_mut().enumerate().rev() {
            ops.push(P2p::recv(buf, s, 8));
        }
        ok(c, c.batch_p2p(&mut ops), "batched all-to-all")?;
    }
    if let Some(s) = (0..n).find(|&s| recvs[s].iter().any(|&x| x != (s * n + me) as f64)) {
        return Err(fail(c, format!("batched all-to-all: message from rank {s} is wrong")));
    }
    // An empty batch is a no-op.
    ok(c, c.batch_p2p(&mut []), "empty batch")
}

fn sum_of_ranks(c: &dyn Communicator, g: &dyn Communicator) -> Result<(), String> {
    let mut x = [c.global_rank() as i64];
    ok(c, g.all_reduce(&mut x, ReduceOp::Sum), "subgroup all-reduce")?;
    let want: i64 = g.global_ranks().iter().map(|&r| r as i64).sum();
    if x[0] != want {
        return Err(fail(
            c,
            format!("subgroup {:?}: sum of ranks {} != {want}", g.global_ranks(), x[0]),
        ));
    }
    Ok(())
}

fn overlapping_subgroups(c: &dyn Communicator) -> Result<(), String> {
    let n = c.size();
    // Lower half plus one, upper half plus one (they overlap in the middle), evens, all.
    let lists: Vec<Vec<usize>> = vec![
        (0..(n / 2 + 1).min(n)).collect(),
        (n.saturating_sub(n / 2 + 1)..n).collect(),
        (0..n).step_by(2).collect(),
        (0..n).collect(),
    ];
    for list in &lists {
        if list.contains(&c.rank()) {
            let g = ok(c, c.subgroup(list), "subgroup")?;
            if g.size() != list.len() || g.global_ranks()[g.rank()] != c.global_rank() {
                return Err(fail(
                    c,
                    format!(
                        "subgroup {list:?} has size {} and maps rank {} to {}",
                        g.size(),
                        g.rank(),
                        g.global_ranks()[g.rank()]
                    ),
                ));
            }
            sum_of_ranks(c, g.as_ref())?;
            // A subgroup of a subgroup.
            if g.size() >= 2 {
                let inner: Vec<usize> = (0..g.size()).filter(|i| i % 2 == g.rank() % 2).collect();
                let gg = ok(c, g.subgroup(&inner), "nested subgroup")?;
                sum_of_ranks(c, gg.as_ref())?;
            }
        }
    }
    Ok(())
}

fn many_groups_in_flight(c: &dyn Communicator) -> Result<(), String> {
    let n = c.size();
    // Disjoint pairs run many operations at the same time as each other.
    let pair: Vec<usize> = if c.rank() + 1 == n && n % 2 == 1 {
        vec![c.rank()]
    } else {
        vec![c.rank() & !1, c.rank() | 1]
    };
    let g = ok(c, c.subgroup(&pair), "pair subgroup")?;
    for round in 0..25 {
        let mut x = vec![(c.global_rank() + round) as f64; 17];
        ok(c, g.all_reduce(&mut x, ReduceOp::Sum), "pair all-reduce")?;
        let want: usize = g.global_ranks().iter().map(|r| r + round).sum();
        if x.iter().any(|&v| v != want as f64) {
            return Err(fail(c, format!("pair round {round}: {} != {want}", x[0])));
        }
        if g.size() == 2 {
            let peer = 1 - g.rank();
            let mut y = [0i64];
            ok(c, g.send_recv(&[round as i64], peer, 1, &mut y, peer, 1), "pair exchange")?;
            if y[0] != round as i64 {
                return Err(fail(c, format!("pair exchange round {round}: got {}", y[0])));
            }
        }
    }
    ok(c, c.barrier(), "closing barrier")
}
