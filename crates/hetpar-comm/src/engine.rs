//! An engine thread: owns state that may not leave its thread (MPI and NCCL handles) and runs
//! jobs on it, so the communicator handles that callers hold are `Send + Sync` (candle's
//! custom ops, which run collectives inside autograd, require that).
//!
//! A call sends a closure and blocks on its reply. Between jobs the engine runs an idle hook
//! (MPI answers status queries there). The thread ends when [`EngineHandle::shutdown`] is
//! called or the last handle is dropped; state is dropped on the engine thread.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, SyncSender, channel, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{CommError, Result};

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

enum Msg<S> {
    Run(Job<S>),
    Stop,
}

/// A handle to an engine thread owning an `S`.
pub struct EngineHandle<S> {
    name: &'static str,
    tx: Mutex<Option<Sender<Msg<S>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<S> std::fmt::Debug for EngineHandle<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EngineHandle({})", self.name)
    }
}

impl<S: 'static> EngineHandle<S> {
    /// Starts thread `name`, builds the state with `init` on it, and runs `idle` on the state
    /// whenever no job arrived for `tick`.
    pub fn spawn(
        name: &'static str,
        tick: Duration,
        init: impl FnOnce() -> Result<S> + Send + 'static,
        idle: fn(&mut S),
    ) -> Result<Arc<EngineHandle<S>>> {
        let (tx, rx): (Sender<Msg<S>>, Receiver<Msg<S>>) = channel();
        let (ready_tx, ready_rx) = sync_channel::<Result<()>>(1);
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let mut state = match init() {
                    Ok(s) => {
                        let _ = ready_tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                loop {
                    match rx.recv_timeout(tick) {
                        Ok(Msg::Run(job)) => job(&mut state),
                        Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                        Err(RecvTimeoutError::Timeout) => idle(&mut state),
                    }
                }
            })
            .map_err(|e| CommError::Backend {
                backend: name,
                message: format!("cannot start the engine thread: {e}"),
            })?;
        let started = ready_rx.recv().map_err(|_| CommError::Backend {
            backend: name,
            message: "the engine thread died while starting".into(),
        })?;
        started?;
        Ok(Arc::new(EngineHandle {
            name,
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Runs `f` on the engine thread and returns its result. `f` may borrow from the caller
    /// (the buffers of a collective, used in place on the engine: no copy to it and back),
    /// since the call returns only once `f` is done with them.
    pub fn call<'a, R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut S) -> Result<R> + Send + 'a,
    ) -> Result<R> {
        let (reply_tx, reply_rx): (SyncSender<Result<R>>, _) = sync_channel(1);
        let pending = Pending { f: Some(f), reply: reply_tx };
        let job: Box<dyn FnOnce(&mut S) + Send + 'a> = Box::new(move |s| {
            let mut pending = pending;
            let f = pending.f.take().expect("a job runs once");
            let out = f(s);
            let _ = pending.reply.send(out);
        });
        // SAFETY: only the lifetime changes, from `'a` to `'static`. The job owns the reply's
        // sender, and `reply_rx.recv()` below (which must stay a wait without a timeout)
        // returns only once that sender has sent or been dropped. It sends after `f` has
        // returned, touching nothing borrowed afterwards; it is dropped after `f` and its
        // captures are gone: after `f` unwinds from a panic, or, for a job dropped without
        // running (an engine that stopped or panicked, a send that failed), by
        // [`Pending`]'s drop order. So nothing `f` borrows is used after this call returns.
        #[allow(unsafe_code)]
        let job: Job<S> =
            unsafe { std::mem::transmute::<Box<dyn FnOnce(&mut S) + Send + 'a>, Job<S>>(job) };
        let stopped = || CommError::Backend {
            backend: self.name,
            message: "the engine has shut down".into(),
        };
        {
            let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
            tx.as_ref().ok_or_else(stopped)?.send(Msg::Run(job)).map_err(|_| stopped())?;
        }
        reply_rx.recv().map_err(|_| stopped())?
    }

    /// Stops the engine after the jobs already sent and waits for its thread (the state is
    /// dropped there: for MPI, communicators are freed and MPI finalized).
    pub fn shutdown(&self) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A job's closure and the sender of its reply. Dropped unrun, it drops the closure (and
/// whatever the closure borrows) before the sender, whose drop wakes the caller: the order
/// [`EngineHandle::call`]'s safety rests on.
struct Pending<F, R> {
    f: Option<F>,
    reply: SyncSender<Result<R>>,
}

impl<F, R> Drop for Pending<F, R> {
    fn drop(&mut self) {
        // The fields, the sender among them, are dropped after this returns.
        drop(self.f.take());
    }
}

impl<S> Drop for EngineHandle<S> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EngineHandle;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    fn engine() -> std::sync::Arc<EngineHandle<u32>> {
        EngineHandle::spawn("test", Duration::from_millis(5), || Ok(0), |_| {})
            .expect("an engine thread")
    }

    /// A job borrows the caller's buffers and works on them in place on the engine thread.
    #[test]
    fn a_job_works_on_the_callers_buffers() {
        let e = engine();
        let (src, mut dst) = (vec![1u8, 2, 3], vec![0u8; 3]);
        let on = e
            .call(|count| {
                *count += 1;
                dst.iter_mut().zip(&src).for_each(|(d, s)| *d = 2 * s);
                Ok(std::thread::current().name().map(str::to_owned))
            })
            .expect("the job runs");
        assert_eq!(dst, [2, 4, 6]);
        assert_eq!(on.as_deref(), Some("test"));
        assert_eq!(e.call(|count| Ok(*count)).expect("state kept"), 1);
    }

    /// After a shutdown, or after a job panicked on the engine, a call fails without
    /// running its job; the caller gets an error, not a hang.
    #[test]
    fn a_stopped_engine_runs_no_job() {
        let e = engine();
        e.shutdown();
        let ran = AtomicBool::new(false);
        let job = |_: &mut u32| {
            ran.store(true, Ordering::SeqCst);
            Ok(())
        };
        assert!(e.call(job).is_err());
        assert!(!ran.load(Ordering::SeqCst));

        let e = engine();
        let panicked = e.call(|_| -> crate::error::Result<()> { panic!("a job's panic") });
        assert!(panicked.is_err());
        assert!(e.call(job).is_err());
        assert!(!ran.load(Ordering::SeqCst));
    }
}
