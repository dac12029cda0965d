//! The local backend: the conformance suite on several world sizes, determinism, timeouts,
//! failure propagation and the recording wrapper.

use std::time::{Duration, Instant};

use hetpar_comm::conformance::SUITE;
use hetpar_comm::{
    CommError, CommExt, Communicator, LocalOptions, Log, OpKind, P2p, Recording, ReduceOp, launch,
    launch_watched,
};

fn opts(secs: f64) -> LocalOptions {
    LocalOptions { timeout: Duration::from_secs_f64(secs) }
}

macro_rules! conformance {
    ($($name:ident: $world:expr,)*) => {$(
        #[test]
        fn $name() {
            for (check, f) in SUITE {
                let out = launch($world, opts(20.0), |c| f(c)).unwrap_or_else(|e| panic!("{check}: {e}"));
                for r in out {
                    r.unwrap_or_else(|e| panic!("{check}: {e}"));
                }
            }
        }
    )*};
}

conformance! {
    suite_on_1_rank: 1,
    suite_on_2_ranks: 2,
    suite_on_3_ranks: 3,
    suite_on_4_ranks: 4,
    suite_on_8_ranks: 8,
}

#[test]
fn reruns_are_bitwise_identical() {
    let run = || {
        launch(5, opts(10.0), |c| {
            let mut x: Vec<f32> = (0..1001)
                .map(|i| ((c.rank() * 13 + i) as f32).sin() * 1e-3 + 1.0 / (i + 1) as f32)
                .collect();
            c.all_reduce(&mut x, ReduceOp::Sum).expect("all-reduce");
            x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        })
        .expect("launch")
    };
    let (a, b) = (run(), run());
    assert_eq!(a, b);
    // Every rank got the same bits, and they equal a sequential sum in rank order.
    assert!(a.iter().all(|v| *v == a[0]));
    let seq: Vec<u32> = (0..1001)
        .map(|i| {
            let mut acc = 0.0f32;
            for r in 0..5 {
                let v = ((r * 13 + i) as f32).sin() * 1e-3 + 1.0 / (i + 1) as f32;
                acc = if r == 0 { v } else { acc + v };
            }
            acc.to_bits()
        })
        .collect();
    assert_eq!(a[0], seq);
}

#[test]
fn a_rank_that_never_joins_times_out_naming_it() {
    let start = Instant::now();
    let out = launch(3, opts(0.5), |c| {
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(1500));
            return Ok(());
        }
        c.barrier()
    })
    .expect("no panic");
    assert!(start.elapsed() < Duration::from_secs(3));
    for r in [0, 1] {
        let e = out[r].clone().expect_err("timeout");
        assert!(matches!(e, CommError::Timeout { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            format!(
                "barrier #0 over ranks [0-2] timed out after 500ms on rank {r}: ranks [2] never joined; rank 2 is computing (not in a communication call)"
            )
        );
    }
    assert!(out[2].is_ok());
}

/// The direct collectives read peers' buffers in place: a member that gave up on a call
/// (here after a timeout) has closed it, so a late member fails instead of reading a buffer
/// its owner has already reused, and neither buffer is written.
#[test]
fn a_late_member_of_an_abandoned_all_reduce_reads_nothing() {
    let out = launch(2, opts(0.3), |c| {
        let mine = 1.0f32 + c.rank() as f32;
        let mut x = vec![mine; 1 << 16];
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_millis(800));
        }
        let r = c.all_reduce(&mut x, ReduceOp::Sum);
        let untouched = x.iter().all(|&v| v == mine);
        // The owner reuses its buffer at once, and stays alive while the late one arrives.
        x.fill(f32::NAN);
        if c.rank() == 0 {
            std::thread::sleep(Duration::from_millis(1200));
        }
        (r, untouched)
    })
    .expect("no panic");
    assert!(out[0].1 && out[1].1, "a buffer was written");
    let e = out[0].0.clone().expect_err("timed out");
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    let e = out[1].0.clone().expect_err("the call was abandoned").to_string();
    assert!(
        e.starts_with("rank 0 failed: left all-reduce #0 after an error: all-reduce #0"),
        "{e}"
    );
}

/// A send-receive lends its send buffer while it receives; a receiver that comes later
/// gets a copy made before the call returned, not what the sender wrote afterwards.
#[test]
fn a_send_receive_taken_late_delivers_what_was_sent() {
    let out = launch(2, opts(10.0), |c| {
        if c.rank() == 0 {
            let mut a = vec![7i64; 1000];
            let mut r = [0i64; 4];
            c.send_recv(&a, 1, 5, &mut r, 1, 6).expect("send-receive");
            a.fill(-1);
            r.to_vec()
        } else {
            c.send(&[3i64; 4], 0, 6).expect("send");
            std::thread::sleep(Duration::from_millis(200));
            let mut got = vec![0i64; 1000];
            c.recv(&mut got, 0, 5).expect("recv");
            got
        }
    })
    .expect("no panic");
    assert_eq!(out[0], [3; 4]);
    assert!(out[1].iter().all(|&v| v == 7), "the receiver saw the buffer after the call");
}

#[test]
fn a_rank_that_returns_early_fails_the_others_fast() {
    let start = Instant::now();
    let out = launch(3, opts(30.0), |c| if c.rank() == 1 { Ok(()) } else { c.barrier() })
        .expect("no panic");
    assert!(start.elapsed() < Duration::from_secs(5), "did not wait for the 30 s timeout");
    let e = out[0].clone().expect_err("peer exited");
    assert_eq!(e.to_string(), "rank 1 failed: exited without joining it (barrier #0 on rank 0)");
}

#[test]
fn a_receive_without_a_send_times_out() {
    let out = launch(2, opts(0.3), |c| {
        let mut buf = [0.0f32; 4];
        if c.rank() == 0 {
            c.recv(&mut buf, 1, 9)
        } else {
            std::thread::sleep(Duration::from_millis(800));
            Ok(())
        }
    })
    .expect("no panic");
    let e = out[0].clone().expect_err("timeout");
    assert_eq!(
        e.to_string(),
        "recv from rank 1 (tag 9) over ranks [0-1] timed out after 300ms on rank 0: ranks [1] never sent it; rank 1 is computing (not in a communication call)"
    );
}

/// Two ranks each receiving from the other, on tags neither sends: the timeout names the
/// call the other waits in (a peer that computes is named as computing, above).
#[test]
fn a_timeout_says_which_call_the_missing_rank_waits_in() {
    let out = launch(2, opts(0.3), |c| {
        let mut buf = [0.0f32; 4];
        let (peer, tag) = if c.rank() == 0 { (1, 9) } else { (0, 5) };
        // Rank 1 still waits when rank 0's timeout passes.
        if c.rank() == 1 {
            c.set_timeout(Duration::from_secs(5));
        }
        c.recv(&mut buf, peer, tag)
    })
    .expect("no panic");
    let e = out[0].clone().expect_err("timeout").to_string();
    assert!(
        e.ends_with(
            "ranks [1] never sent it; rank 1 is in recv from rank 0 (tag 5) over ranks [0-1]"
        ),
        "{e}"
    );
}

#[test]
fn mismatched_sizes_are_errors_not_hangs() {
    let out = launch(2, opts(2.0), |c| {
        let mut x = vec![1.0f64; 4 + c.rank()];
        c.all_reduce(&mut x, ReduceOp::Sum)
    })
    .expect("no panic");
    let msgs: Vec<String> = out.into_iter().map(|r| r.expect_err("mismatch").to_string()).collect();
    assert!(
        msgs.iter().all(|m| m.starts_with("all-reduce #0 over ranks [0-1]: rank ")),
        "{msgs:?}"
    );
    assert!(msgs.iter().all(|m| m.contains("passes bytes Some(")), "{msgs:?}");
    let out = launch(2, opts(2.0), |c| {
        if c.rank() == 0 { c.send(&[1i64, 2, 3], 1, 0) } else { c.recv(&mut [0i64; 2], 0, 0) }
    })
    .expect("no panic");
    assert_eq!(
        out[1].clone().expect_err("size").to_string(),
        "recv from rank 0 (tag 0) over ranks [0-1]: rank 0 sent 24 bytes, rank 1 expects 16"
    );
    let out = launch(2, opts(2.0), |c| {
        if c.rank() == 0 { c.barrier() } else { c.all_reduce(&mut [0i64], ReduceOp::Sum) }
    })
    .expect("no panic");
    let e = out[1].clone().expect_err("kind").to_string();
    assert!(
        e.contains("rank 1 called all-reduce while rank 0 called barrier")
            || e.contains("rank 0 called barrier while rank 1 called all-reduce"),
        "{e}"
    );
    // All-to-all counts that disagree: the receiver names them, and the sender, whose
    // buffer it was about to read, fails with it rather than leaving early.
    let out = launch(2, opts(2.0), |c| {
        let send = [5u8; 6];
        let (sc, rc) = if c.rank() == 0 { ([2, 4], [2, 3]) } else { ([3, 3], [3, 3]) };
        let mut recv = vec![0u8; rc.iter().sum()];
        c.all_to_all_v_bytes(&send, &sc, &mut recv, &rc)
    })
    .expect("no panic");
    let e = out[1].clone().expect_err("counts").to_string();
    assert!(e.contains("rank 0 sends 4 bytes to rank 1, which expects 3"), "{e}");
    let e = out[0].clone().expect_err("abandoned").to_string();
    assert!(e.starts_with("rank 1 failed: left all-to-all-v #0 after an error"), "{e}");
}

#[test]
fn a_panic_fails_every_rank_fast_with_its_rank() {
    let start = Instant::now();
    let e = launch(4, opts(30.0), |c| {
        if c.rank() == 3 {
            panic!("injected fault");
        }
        let mut x = [1.0f32];
        c.all_reduce(&mut x, ReduceOp::Sum).map(|_| ())
    })
    .expect_err("a rank panicked");
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(e.to_string(), "rank 3 failed: panicked: injected fault");
}

/// A rank stuck where no timeout reaches (its own compute here) while another has failed
/// is reported `grace` after the failure, with the errors so far, rather than waited for;
/// the ranks that fail through the timeout are among the errors. Without a failure nobody
/// is reported, however long a rank computes.
#[test]
fn a_rank_stuck_after_a_failure_is_reported_after_the_grace() {
    let start = Instant::now();
    let called = std::sync::Mutex::new(None);
    let out = launch_watched(
        3,
        opts(0.2),
        Duration::from_millis(600),
        |c| match c.rank() {
            0 => Err("data error".to_string()),
            1 => {
                let mut x = [1.0f32];
                c.all_reduce(&mut x, ReduceOp::Sum).map_err(|e| e.to_string())
            }
            _ => {
                std::thread::sleep(Duration::from_secs(3));
                Ok(())
            }
        },
        |errors, stuck| {
            let errors: Vec<(usize, String)> =
                errors.iter().map(|(r, e)| (*r, e.to_string())).collect();
            *called.lock().expect("lock") = Some((start.elapsed(), errors, stuck.to_vec()));
        },
    )
    .expect("no panic");
    let (when, errors, stuck) = called.lock().expect("lock").take().expect("abandon called");
    assert!(when >= Duration::from_millis(600) && when < Duration::from_millis(2500), "{when:?}");
    assert_eq!(stuck, [2]);
    assert_eq!(errors[0], (0, "data error".to_string()));
    assert_eq!(errors.len(), 2, "{errors:?}");
    // `abandon` returned, so the stuck rank was waited for.
    assert!(start.elapsed() >= Duration::from_secs(3));
    assert!(out[2].is_ok());
    let quiet = launch_watched(
        2,
        opts(0.2),
        Duration::from_millis(100),
        |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(500));
            }
            Ok::<(), String>(())
        },
        |_, _| panic!("nothing failed"),
    )
    .expect("no panic");
    assert!(quiet.iter().all(Result::is_ok));
}

#[test]
fn recording_counts_what_moves() {
    let log = Log::new();
    launch(4, opts(10.0), |c| {
        let rec = Recording::new(Box::new(c), log.clone());
        let mut x = [0.0f32; 100];
        rec.all_reduce(&mut x, ReduceOp::Sum).expect("all-reduce");
        let g = rec.subgroup(&[0, 1]).ok().filter(|_| c.rank() < 2);
        if let Some(g) = g {
            let peer = 1 - g.rank();
            g.send_recv(&[1i64; 8], peer, 0, &mut [0i64; 8], peer, 0).expect("exchange");
        }
    })
    .expect("launch");
    let kinds = log.count_by_kind();
    assert_eq!(kinds[&OpKind::AllReduce], 4);
    assert_eq!((kinds[&OpKind::Send], kinds[&OpKind::Recv]), (2, 2));
    // All-reduce of 400 bytes on 4 ranks: 2 * 3/4 * 400 each way per rank.
    assert_eq!(log.bytes_by_group()[&vec![0, 1, 2, 3]], 4 * 600);
    assert_eq!(log.bytes_by_peer()[&(0, 1)], 64);
    assert_eq!(log.bytes_by_rank()[&0], (600 + 64, 600 + 64));
}

#[test]
fn batched_messages_report_mismatches_and_missing_peers() {
    let out = launch(2, opts(2.0), |c| {
        let (a, mut b) = ([1i64, 2, 3], [0i64; 2]);
        let peer = 1 - c.rank();
        let mut ops = if c.rank() == 0 {
            vec![P2p::send(&a, peer, 4)]
        } else {
            vec![P2p::recv(&mut b, peer, 4)]
        };
        c.batch_p2p(&mut ops)
    })
    .expect("no panic");
    assert_eq!(
        out[1].clone().expect_err("size").to_string(),
        "recv from rank 0 (tag 4) over ranks [0-1]: rank 0 sent 24 bytes, rank 1 expects 16"
    );
    // A receive nobody sends times out naming the peer; the sends of the batch went out.
    let out = launch(2, opts(0.3), |c| {
        let (a, mut b) = ([7.0f32; 3], [0.0f32; 3]);
        if c.rank() == 0 {
            c.batch_p2p(&mut [P2p::send(&a, 1, 1), P2p::recv(&mut b, 1, 2)])
        } else {
            c.recv(&mut b, 0, 1)?;
            std::thread::sleep(Duration::from_millis(800));
            Ok(())
        }
    })
    .expect("no panic");
    out[1].clone().expect("the batch's send arrived");
    assert_eq!(
        out[0].clone().expect_err("timeout").to_string(),
        "recv from rank 1 (tag 2) over ranks [0-1] timed out after 300ms on rank 0: ranks [1] never sent it; rank 1 is computing (not in a communication call)"
    );
    // A peer outside the communicator is refused before anything moves.
    let out =
        launch(2, opts(1.0), |c| c.batch_p2p(&mut [P2p::Send { data: &[1u8], peer: 5, tag: 0 }]))
            .expect("launch");
    assert!(
        out[0]
            .clone()
            .expect_err("usage")
            .to_string()
            .contains("rank 5 is not in a communicator of 2")
    );
}

#[test]
fn recording_marks_batched_messages() {
    let log = Log::new();
    launch(2, opts(10.0), |c| {
        let rec = Recording::new(Box::new(c), log.clone());
        let peer = 1 - c.rank();
        let (a, mut b) = ([1i64; 8], [0i64; 8]);
        rec.batch_p2p(&mut [P2p::send(&a, peer, 0), P2p::recv(&mut b, peer, 0)]).expect("batch");
        rec.send_recv(&a, peer, 1, &mut b, peer, 1).expect("exchange");
        rec.batch_p2p(&mut [P2p::recv(&mut b, peer, 2), P2p::send(&a, peer, 2)]).expect("batch");
    })
    .expect("launch");
    let mine: Vec<Option<u64>> =
        log.records().iter().filter(|r| r.rank == 0).map(|r| r.batch).collect();
    assert_eq!(mine, [Some(0), Some(0), None, None, Some(1), Some(1)]);
    assert_eq!(log.bytes_by_peer()[&(0, 1)], 3 * 64);
}
