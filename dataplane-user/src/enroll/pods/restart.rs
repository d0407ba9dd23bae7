//! An agent's pods across its restarts and upgrades: re-adopting the pods
//! a previous agent enrolled or handed over, handing them to a new agent,
//! and shutting down.

use tracing::{info, warn};

use super::{Enrollments, HandedPod, OfferedPod, status_of};
use crate::{
    enroll::{EnrollError, PodStatus, serving::Serving},
    proxy::PodNetns,
    redirect::ExitMode,
};

impl Enrollments {
    /// Re-adopts the pods a previous agent handed over, serving the
    /// listening sockets it passed (the same sockets: the kernel's entries
    /// keep pointing at them, no connection is refused). Returns how many
    /// pods were re-adopted.
    pub fn readopt_handed(&mut self, pods: Vec<HandedPod>) -> Result<usize, EnrollError> {
        let mut recorded = Vec::with_capacity(pods.len());
        for pod in pods {
            if let Some(listeners) = pod.listeners {
                self.handed.insert(
                    pod.status.spec.uid.clone(),
                    (pod.status.netns_cookie, listeners),
                );
            }
            recorded.push(pod.status);
        }
        let result = self.readopt_from(recorded);
        // Sockets of pods that could not be adopted are not ours to keep.
        self.handed.clear();
        result
    }

    /// Duplicates of every enrolled pod's listening sockets, for a new
    /// agent taking over.
    pub fn offer(&self) -> Result<Vec<OfferedPod>, EnrollError> {
        self.pods
            .values()
            .filter_map(|pod| Some((pod, pod.serving.listeners()?)))
            .map(|(pod, listeners)| {
                let netns_err = |source| EnrollError::Netns {
                    uid: pod.spec.uid.clone(),
                    path: pod.spec.netns.clone(),
                    source,
                };
                Ok(OfferedPod {
                    status: status_of(pod),
                    netns_identity: pod.netns.identity().map_err(netns_err)?,
                    listeners: listeners.try_clone().map_err(netns_err)?,
                })
            })
            .collect()
    }

    /// This agent handed its pods over: every engine stops (connections
    /// still open close) and the kernel state and state file, now the new
    /// agent's, are left exactly as they are.
    pub fn release(mut self) {
        for (_, pod) in self.pods.drain() {
            pod.serving.stop();
        }
    }

    /// Re-adopts the pods a previous agent of this instance enrolled: those
    /// whose namespace still exists get listeners again; the kernel state of
    /// the others is removed. Returns how many pods were re-adopted.
    pub fn readopt(&mut self) -> Result<usize, EnrollError> {
        let recorded = self.state.load()?;
        self.readopt_from(recorded)
    }

    fn readopt_from(&mut self, recorded: Vec<PodStatus>) -> Result<usize, EnrollError> {
        let mut adopted = 0;
        for status in recorded {
            let uid = status.spec.uid.clone();
            let still_there = PodNetns::open(&status.spec.netns)
                .and_then(|ns| ns.cookie())
                .is_ok_and(|cookie| cookie == status.netns_cookie);
            if !still_there {
                info!(pod = %uid, netns = %status.spec.netns.display(), "network namespace gone while the agent was down; removing");
                self.with_redirector(|r| r.unenroll_pod(status.netns_cookie))?;
                continue;
            }
            match self.add(status.spec) {
                Ok(_) => adopted += 1,
                Err(err) => {
                    warn!(pod = %uid, error = %crate::logging::Chain(&err), "cannot re-adopt pod")
                }
            }
        }
        // Kernel entries no state file knows about belong to nobody.
        let known: Vec<u64> = self.pods.values().map(|p| p.cookie).collect();
        let enrolled = self.with_redirector(|r| r.enrolled_cookies())?;
        for cookie in enrolled.into_iter().filter(|c| !known.contains(c)) {
            info!(
                netns_cookie = cookie,
                "removing kernel state of an unknown pod"
            );
            self.with_redirector(|r| r.unenroll_pod(cookie))?;
        }
        self.persist()?;
        Ok(adopted)
    }

    /// The agent is stopping: every pod's listeners close; the state file
    /// keeps the pods for the next agent unless `mode` detaches everything;
    /// kernel state is kept (engine marked not ready, so the fail-open or
    /// fail-closed setting decides pods' traffic) or removed as `mode` says.
    pub fn shutdown(mut self, mode: ExitMode) -> Result<(), EnrollError> {
        // Every pool first: a pod stopped before its peer on this node cuts
        // the peer's tunnels, and the peer's records must already know that
        // the agent, not the network, closed them.
        for pod in self.pods.values() {
            pod.serving.close_pool();
        }
        let detach = mode == ExitMode::Detach;
        for (_, pod) in self.pods.drain() {
            if detach && matches!(pod.serving, Serving::External(_)) {
                // Its program on the pod's `lo` is not pinned with the
                // others: it goes here or stays with the namespace.
                let netns = pod.netns.fd();
                if let Some(r) = self.redirector.as_mut()
                    && let Err(err) = r.unenroll_external_pod(pod.cookie, Some(netns))
                {
                    warn!(uid = pod.spec.uid, error = %crate::logging::Chain(&err), "cannot release the pod's capture");
                }
            }
            pod.serving.stop();
            if detach {
                pod.original.tear_down(&pod.netns);
            }
        }
        // ztunnel keeps serving what it has and reconnects to the next
        // agent, which sends it the snapshot again.
        self.settings.external = None;
        if mode == ExitMode::Detach {
            self.state.remove()?;
        }
        let Some(mut redirector) = self.redirector.take() else {
            return Ok(());
        };
        if mode == ExitMode::Keep {
            redirector.set_engine_ready(false)?;
        }
        redirector.shutdown(mode)?;
        Ok(())
    }
}
