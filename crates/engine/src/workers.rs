//! The threads that serve pods' connections.
//!
//! Two ways, chosen by `--threading`:
//!
//! - **pinned** (the default): `--worker-threads` threads, each running a
//!   single-threaded tokio runtime of its own. A pod is placed on the
//!   worker serving the fewest pods when its engine starts, and its
//!   listeners, HBONE pool and every connection stay there. A connection's
//!   tasks (its relay, the pooled HTTP/2 connection carrying it) wake each
//!   other on one thread: no work stealing, no wake-ups of idle threads,
//!   no socket state bouncing between caches. The price: one pod's
//!   connections use at most one core of the agent; many pods use them
//!   all.
//! - **shared**: every pod's connections run on the agent's own
//!   multi-thread runtime, so one pod's connections may use every thread.
//!
//! Everything else (enrollment, xDS, control, metrics, DNS) runs on the
//! agent's main runtime either way.

use std::{
    io,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{runtime::Handle, sync::oneshot};

/// Errors starting the worker threads.
#[derive(Debug, thiserror::Error)]
pub enum WorkersError {
    /// A worker's runtime or thread could not be created.
    #[error(
        "cannot start connection worker {index} (out of threads or memory? lower --worker-threads)"
    )]
    Start {
        /// The worker's index.
        index: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// How pods' connections are spread over threads (see the module doc; the
/// flag `--threading` converts into it in `cli::workers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Threading {
    /// [`Workers::pinned`]: single-threaded workers, one pod on one.
    Pinned,
    /// [`Workers::shared`]: the agent's multi-thread runtime for every pod.
    Shared,
}

/// The connection workers.
#[derive(Debug)]
pub struct Workers {
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Shared(Handle),
    /// At least one worker: `first`, then the others.
    Pinned {
        first: Worker,
        more: Vec<Worker>,
    },
}

/// One pinned worker thread.
#[derive(Debug)]
struct Worker {
    handle: Handle,
    /// Pods placed here now.
    pods: Arc<AtomicUsize>,
    /// Dropped (with [`Workers`]) to end the thread's runtime.
    _stop: oneshot::Sender<()>,
}

impl Workers {
    /// Connections run on `handle`'s runtime (tests, and `--threading
    /// shared`).
    pub fn shared(handle: Handle) -> Self {
        Self {
            inner: Inner::Shared(handle),
        }
    }

    /// Starts `count` (at least one) pinned worker threads.
    pub fn pinned(count: usize) -> Result<Self, WorkersError> {
        let first = Worker::start(0)?;
        let more = (1..count).map(Worker::start).collect::<Result<_, _>>()?;
        Ok(Self {
            inner: Inner::Pinned { first, more },
        })
    }

    /// Where the next pod's engine runs: the pinned worker with the fewest
    /// pods (the first of them on a tie), or the shared runtime. The pod
    /// counts as placed until the returned [`Placement`] is dropped.
    pub fn place(&self) -> Placement {
        match &self.inner {
            Inner::Shared(handle) => Placement {
                handle: handle.clone(),
                worker: None,
            },
            Inner::Pinned { first, more } => {
                // `min_by_key` keeps the first of equals.
                let (index, worker) = std::iter::once(first)
                    .chain(more)
                    .enumerate()
                    .min_by_key(|(_, w)| w.pods.load(Ordering::Relaxed))
                    .unwrap_or((0, first));
                worker.pods.fetch_add(1, Ordering::Relaxed);
                Placement {
                    handle: worker.handle.clone(),
                    worker: Some((index, Arc::clone(&worker.pods))),
                }
            }
        }
    }

    /// Pods placed on each pinned worker now (empty when shared).
    #[cfg(test)]
    fn load(&self) -> Vec<usize> {
        match &self.inner {
            Inner::Shared(_) => Vec::new(),
            Inner::Pinned { first, more } => std::iter::once(first)
                .chain(more)
                .map(|w| w.pods.load(Ordering::Relaxed))
                .collect(),
        }
    }
}

impl Worker {
    fn start(index: usize) -> Result<Self, WorkersError> {
        let err = |source| WorkersError::Start { index, source };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(err)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("dp-worker-{index}"))
            .spawn(move || {
                // Runs the pods' tasks until the workers are dropped (the
                // sender going away ends the wait), then drops them.
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })
            .map_err(err)?;
        Ok(Self {
            handle,
            pods: Arc::new(AtomicUsize::new(0)),
            _stop: stop,
        })
    }
}

/// A pod's place among the workers.
#[derive(Debug)]
pub struct Placement {
    handle: Handle,
    /// The pinned worker's index and pod count (`None` when shared).
    worker: Option<(usize, Arc<AtomicUsize>)>,
}

impl Placement {
    /// The runtime the pod's tasks run on.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The pinned worker's index, `None` when shared.
    pub fn worker(&self) -> Option<usize> {
        self.worker.as_ref().map(|(index, _)| *index)
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        if let Some((_, pods)) = &self.worker {
            pods.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_go_to_the_least_loaded_worker_and_leave_it_when_dropped() -> anyhow::Result<()> {
        let workers = Workers::pinned(3)?;
        let a = workers.place();
        let b = workers.place();
        let c = workers.place();
        assert_eq!(
            [a.worker(), b.worker(), c.worker()],
            [Some(0), Some(1), Some(2)]
        );
        drop(b);
        assert_eq!(workers.load(), vec![1, 0, 1]);
        let d = workers.place();
        assert_eq!(d.worker(), Some(1));
        // Each worker runs what is spawned on it, on its own thread.
        let names: Vec<String> = [&a, &d]
            .iter()
            .map(|p| {
                let (tx, rx) = std::sync::mpsc::channel();
                p.handle().spawn(async move {
                    let name = std::thread::current().name().map(str::to_owned);
                    let _ = tx.send(name.unwrap_or_default());
                });
                rx.recv_timeout(std::time::Duration::from_secs(10))
            })
            .collect::<Result<_, _>>()?;
        assert_eq!(names, ["dp-worker-0", "dp-worker-1"]);
        Ok(())
    }
}
