//! Feeding the [`Reconciler`] from the Kubernetes API: a watch of this
//! node's pods (field selector `spec.nodeName=<node>`) and one of
//! namespaces (for their opt-in label), plus a periodic resync.
//!
//! kube-runtime's watcher does the list-then-watch protocol: a paginated
//! list, then a watch from the list's `resourceVersion`; when the watch
//! ends (server timeout, dropped connection) it resumes from the last
//! `resourceVersion` it saw, and when the server answers `410 Gone` (that
//! version is too old) it lists again. Each complete list reaches the
//! reconciler as one [`Reconciler::pods_listed`], so pods deleted while the
//! watch was down are unenrolled there.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use tracing::{debug, warn};

use super::reconcile::{PodView, Reconciler, namespace_labels};

/// One step of a watch, already reduced to what the reconciler needs.
#[derive(Debug)]
enum Update<T> {
    /// A complete list.
    Listed(Vec<T>),
    /// One object added or changed.
    Applied(T),
    /// One object deleted (its key).
    Deleted(String),
}

/// Watches the API and drives `reconciler` until the returned task is
/// aborted. `resync` is how often everything is re-evaluated (retrying pods
/// whose namespace was not found yet, expiring unknown uids).
pub fn spawn(
    client: Client,
    node: &str,
    reconciler: Reconciler,
    resync: Duration,
) -> tokio::task::JoinHandle<()> {
    let pods: Api<Pod> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client);
    let pod_config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let pod_updates = updates(
        watcher(pods, pod_config).default_backoff(),
        |pod: &Pod| PodView::from_pod(pod),
        |pod: &Pod| pod.metadata.uid.clone(),
    );
    let ns_updates = updates(
        watcher(namespaces, watcher::Config::default()).default_backoff(),
        namespace_labels,
        |ns: &Namespace| ns.metadata.name.clone(),
    );
    let reconciler = Arc::new(Mutex::new(reconciler));
    tokio::spawn(async move {
        let mut pod_updates = std::pin::pin!(pod_updates);
        let mut ns_updates = std::pin::pin!(ns_updates);
        let mut ticker = tokio::time::interval(resync);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let step: Box<dyn FnOnce(&mut Reconciler) + Send> = tokio::select! {
                Some(update) = pod_updates.next() => Box::new(move |r: &mut Reconciler| {
                    match update {
                        Update::Listed(pods) => { r.pods_listed(pods); }
                        Update::Applied(pod) => { r.pod_applied(pod); }
                        Update::Deleted(uid) => { r.pod_deleted(&uid); }
                    }
                }),
                Some(update) = ns_updates.next() => Box::new(move |r: &mut Reconciler| {
                    match update {
                        Update::Listed(namespaces) => { r.namespaces_listed(namespaces); }
                        Update::Applied((name, labels)) => { r.namespace_applied(name, labels); }
                        Update::Deleted(name) => { r.namespace_deleted(&name); }
                    }
                }),
                _ = ticker.tick() => Box::new(|r: &mut Reconciler| { r.reconcile_all(); }),
            };
            // Enrolling blocks (it enters namespaces, issues certificates):
            // off the async threads, one step at a time.
            let reconciler = Arc::clone(&reconciler);
            let done = tokio::task::spawn_blocking(move || {
                let mut guard = match reconciler.lock() {
                    Ok(guard) => guard,
                    Err(poisoned) => poisoned.into_inner(),
                };
                step(&mut guard);
            })
            .await;
            if let Err(err) = done {
                warn!(error = %err, "a reconciliation step panicked");
            }
        }
    })
}

/// Turns watcher events into [`Update`]s: buffers a list between `Init` and
/// `InitDone`, converts objects with `view`, logs (and survives) errors.
fn updates<K, T, S>(
    events: S,
    view: impl Fn(&K) -> Option<T> + Send + 'static,
    key: impl Fn(&K) -> Option<String> + Send + 'static,
) -> impl Stream<Item = Update<T>> + Send
where
    K: Send + 'static,
    T: Send + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut buffer: Option<Vec<T>> = None;
    events.filter_map(move |event| {
        let update = match event {
            Ok(watcher::Event::Init) => {
                buffer = Some(Vec::new());
                None
            }
            Ok(watcher::Event::InitApply(obj)) => {
                if let (Some(buffer), Some(v)) = (buffer.as_mut(), view(&obj)) {
                    buffer.push(v);
                }
                None
            }
            Ok(watcher::Event::InitDone) => buffer.take().map(Update::Listed),
            Ok(watcher::Event::Apply(obj)) => view(&obj).map(Update::Applied),
            Ok(watcher::Event::Delete(obj)) => key(&obj).map(Update::Deleted),
            Err(err) => {
                match &err {
                    watcher::Error::WatchError(status) if status.code == 410 => {
                        debug!(error = %err, "watch expired; listing again")
                    }
                    _ => warn!(error = %err, "Kubernetes watch failed; retrying with backoff"),
                }
                None
            }
        };
        std::future::ready(update)
    })
}
