//! Where the mesh state comes from: the local file, istiod (xDS), or both.
//!
//! Both sources are the same model ([`crate::config::LocalConfig`]): the
//! file as parsed, istiod's resources as [`crate::xds::translate`] writes
//! them. With both, an entry of the file wins over istiod's entry of the
//! same key (workload uid, service `namespace/hostname`, policy
//! `namespace/name`), and an istiod workload or VIP that claims a network
//! address (network and IP, as ztunnel keys both: `NetworkAddress`) a file
//! entry holds is left out: the file is the operator's override. The same
//! IP on another network is another address, and kept.
//! `config-dump` marks every entry with its source and the file entries
//! that shadow istiod's.
//!
//! A push from istiod changes only what it names: [`XdsModel`] translates
//! the resources it changed and names the entries that changed,
//! [`merge_changes`] turns those into [`Changes`] to the merged
//! configuration, and
//! [`MeshState::apply`] makes the next state from the one in force,
//! sharing everything else. A change of the file (rare, and it can
//! shadow any of istiod's entries) builds the state whole. Either is
//! installed one at a time (policies re-checked on open connections;
//! configured pods enrolled when the file changed), made off the
//! runtime's threads unless the push was small ([`INLINE_NAMES`]).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use tokio::sync::{Mutex, watch};
use tracing::{debug, info, warn};

use crate::config::{
    LocalConfig, SharedStr,
    entries::{EntryKey, EntryKind, XdsEntry},
};
use crate::enroll::Enroller;
use crate::logging::Chain;
use crate::mesh::MeshContext;
use crate::readiness::{Readiness, Step};
use crate::state::{Affected, Changes, MeshState, Provenance, Spare, StateError};
use crate::xds::{
    ChangedEntries, XdsEntries, XdsModel, XdsResources, XdsSnapshot, client::AppliedReporter,
};

/// The file's keys and addresses: istiod's entries of the same key are
/// replaced by the file's, and those claiming its addresses left out.
#[derive(Debug, Default)]
pub struct FileIndex {
    uids: HashSet<Arc<str>>,
    services: HashSet<String>,
    policies: HashSet<String>,
    /// The network addresses its workloads and VIPs hold: each IP
    /// (canonical) on its network, as ztunnel keys workloads and services
    /// (`src/state/workload.rs` `WorkloadStore::by_addr`,
    /// `src/state/service.rs` `ServiceStore::by_vip`: `NetworkAddress`).
    taken: HashSet<(SharedStr, IpAddr)>,
}

impl FileIndex {
    /// The keys and addresses of `file`.
    pub fn of(file: &LocalConfig) -> Self {
        Self {
            uids: file.workloads.iter().map(|w| w.uid.clone()).collect(),
            services: file.services.iter().map(|s| s.key()).collect(),
            policies: file.policies.iter().map(|p| p.key()).collect(),
            taken: file
                .workloads
                .iter()
                .flat_map(|w| {
                    w.own_ips()
                        .iter()
                        .map(|ip| (w.network.clone(), ip.to_canonical()))
                })
                .chain(
                    file.services
                        .iter()
                        .flat_map(|s| s.vips.iter().map(|vip| (vip.network.clone(), vip.ip))),
                )
                .collect(),
        }
    }

    /// Whether a file entry holds `ip` on `network`.
    fn holds(&self, network: &SharedStr, ip: IpAddr) -> bool {
        self.taken.contains(&(network.clone(), ip.to_canonical()))
    }

    /// The provenance keys of the file's entries.
    fn provenance_keys(file: &LocalConfig) -> HashSet<String> {
        file.workloads
            .iter()
            .map(|w| format!("workloads/{}", w.uid))
            .chain(
                file.services
                    .iter()
                    .map(|s| format!("services/{}", s.key())),
            )
            .chain(
                file.policies
                    .iter()
                    .map(|p| format!("policies/{}", p.key())),
            )
            .collect()
    }
}

/// The state of the file's entries and istiod's (`xds`: its name and
/// entries) that the file does not replace, built whole; the provenance
/// says which is which.
pub fn merged_state(
    file: &LocalConfig,
    xds: Option<(&str, &XdsEntries)>,
) -> Result<MeshState, StateError> {
    let Some((xds_origin, entries)) = xds else {
        return MeshState::from_config(file);
    };
    let origin =
        if file.workloads.is_empty() && file.services.is_empty() && file.policies.is_empty() {
            xds_origin.to_owned()
        } else {
            format!("{} + {xds_origin}", file.origin)
        };
    let mut provenance = Provenance {
        xds_origin: Some(xds_origin.to_owned()),
        from_file: Arc::new(FileIndex::provenance_keys(file)),
        ..Provenance::default()
    };
    let mut changes = Changes::of_file(file);
    changes.extend(merge_changes(
        &FileIndex::of(file),
        entries,
        &ChangedEntries::everything(),
        &mut provenance,
    ));
    let empty = MeshState {
        origin,
        ..MeshState::default()
    };
    let mut state = empty.apply(&changes)?;
    state.provenance = provenance;
    Ok(state)
}

/// The changes to the merged configuration that the `changed` entries of
/// istiod's (`entries`, as they now stand) make: each as the merge keeps
/// it (`None` when gone or when the file replaces it), with `provenance`
/// brought up to date. Costs what changed: each changed entry is looked
/// up, nothing else is visited.
pub fn merge_changes(
    file: &FileIndex,
    entries: &XdsEntries,
    changed: &ChangedEntries,
    provenance: &mut Provenance,
) -> Changes {
    let mut changes = Changes::default();
    for name in changed.workloads(entries) {
        let entry = XdsEntry::new(EntryKind::Workload, Arc::clone(name));
        provenance.shadows.remove(&entry);
        provenance.merge_dropped.remove(&entry);
        let kept = entries.workloads.get(name).filter(|w| {
            if file.uids.contains(&w.uid) {
                provenance
                    .shadows
                    .insert(entry.clone(), format!("workloads/{}", w.uid));
                return false;
            }
            let Some(ip) = w.own_ips().iter().find(|ip| file.holds(&w.network, **ip)) else {
                return true;
            };
            let note = format!(
                "workload {}: IP {ip} on network `{}` belongs to an entry of the file",
                w.uid, w.network
            );
            warn!(reason = %note, "left out of the mesh state");
            provenance
                .merge_dropped
                .insert(entry.clone(), Arc::from([note]));
            false
        });
        changes
            .workloads
            .push((EntryKey::xds(Arc::clone(name)), kept.cloned()));
    }
    for name in changed.services(entries) {
        let entry = XdsEntry::new(EntryKind::Service, Arc::clone(name));
        provenance.shadows.remove(&entry);
        provenance.merge_dropped.remove(&entry);
        let kept = entries.services.get(name).and_then(|s| {
            let key = s.key();
            if file.services.contains(&key) {
                provenance
                    .shadows
                    .insert(entry.clone(), format!("services/{key}"));
                return None;
            }
            if !s.vips.iter().any(|vip| file.holds(&vip.network, vip.ip)) {
                return Some(Arc::clone(s));
            }
            let mut notes = Vec::new();
            let mut kept = (**s).clone();
            kept.vips.retain(|vip| {
                let free = !file.holds(&vip.network, vip.ip);
                if !free {
                    notes.push(format!(
                        "service {key}: VIP {vip} belongs to an entry of the file"
                    ));
                }
                free
            });
            for note in &notes {
                warn!(reason = %note, "left out of the mesh state");
            }
            provenance.merge_dropped.insert(entry.clone(), notes.into());
            Some(Arc::new(kept))
        });
        changes
            .services
            .push((EntryKey::xds(Arc::clone(name)), kept));
    }
    for name in changed.policies(entries) {
        let entry = XdsEntry::new(EntryKind::Policy, Arc::clone(name));
        provenance.shadows.remove(&entry);
        let kept = entries.policies.get(name).filter(|p| {
            let key = p.key();
            let shadowed = file.policies.contains(&key);
            if shadowed {
                provenance
                    .shadows
                    .insert(entry.clone(), format!("policies/{key}"));
            }
            !shadowed
        });
        changes
            .policies
            .push((EntryKey::xds(Arc::clone(name)), kept.cloned()));
    }
    provenance.xds_dropped = entries.dropped.clone();
    changes
}

/// The latest version of each source, as the state in force holds them.
#[derive(Debug, Default)]
struct Held {
    file: Arc<LocalConfig>,
    file_index: Arc<FileIndex>,
    /// istiod's name, once its entries are in the state in force.
    xds: Option<String>,
    /// istiod's resources as translated for the last push (a push
    /// translates only what it changed), with the entries changed since
    /// the state in force took them in (more than the last push's when a
    /// state made from them was refused).
    model: XdsModel,
    /// The state the one in force replaced, to make the next from in
    /// place (see [`Spare`]).
    spare: Spare,
}

/// Combines the sources and installs every change.
#[derive(Debug)]
pub struct ConfigSources {
    mesh: Arc<MeshContext>,
    enroller: Enroller,
    held: Mutex<Held>,
}

impl ConfigSources {
    /// Sources starting from `file` (the file read at start, or the
    /// embedded default, whose state is in force), istiod's part empty
    /// until it arrives.
    pub fn new(mesh: Arc<MeshContext>, enroller: Enroller, file: Arc<LocalConfig>) -> Self {
        Self {
            mesh,
            enroller,
            held: Mutex::new(Held {
                file_index: Arc::new(FileIndex::of(&file)),
                file,
                xds: None,
                model: XdsModel::default(),
                spare: Spare::default(),
            }),
        }
    }

    /// A new file version (parsed and valid on its own): the state is
    /// built whole again.
    pub async fn file_changed(&self, file: LocalConfig) -> Result<(), String> {
        let mut held = self.held.lock().await;
        let file = Arc::new(file);
        let index = Arc::new(FileIndex::of(&file));
        let xds = held
            .xds
            .clone()
            .map(|origin| (origin, held.model.entries().clone()));
        let built = {
            let file = Arc::clone(&file);
            let network = Arc::clone(&self.mesh.network);
            blocking(move || {
                merged_state(&file, xds.as_ref().map(|(o, e)| (o.as_str(), e)))
                    .map(|state| state.on_network(&network))
            })
            .await?
        };
        held.file = Arc::clone(&file);
        held.file_index = index;
        held.model.taken_in();
        held.spare.clear();
        self.install(
            Arc::new(built),
            usize::MAX,
            &Affected::everything(),
            Some(file),
        )
        .await;
        self.mesh.accept_config();
        Ok(())
    }

    /// A new version of istiod's resources (`origin` names istiod): they
    /// are translated and the state made from them in one step, both
    /// costing only what changed since the last version. A `small` change
    /// (see [`INLINE_NAMES`]) is made on the calling task, as ztunnel
    /// applies every push in its xDS task (`src/xds/client.rs`
    /// `handle_stream_event` calls the type's handler before it answers);
    /// a larger one off the runtime's threads, so the xDS client and the
    /// connections do not wait behind it.
    pub async fn xds_changed(
        &self,
        origin: String,
        resources: Arc<XdsResources>,
        small: bool,
    ) -> Result<(), String> {
        let mut held = self.held.lock().await;
        let file = Arc::clone(&held.file);
        let index = Arc::clone(&held.file_index);
        let previous = self.mesh.state();
        // The state in force holds istiod's entries but the model's
        // pending changes: change only those.
        let incremental = held.xds.as_ref() == Some(&origin);
        let small = small && incremental;
        let mut model = std::mem::take(&mut held.model);
        let mut spare = std::mem::take(&mut held.spare);
        let made_from = Arc::downgrade(&previous);
        let origin_name = origin.clone();
        // A state built whole looks captured traffic up on this node's
        // network, as the one it replaces did (changes keep it).
        let network = Arc::clone(&self.mesh.network);
        let build = move || {
            model.update(&resources);
            let entries = model.entries();
            let state = if incremental {
                {
                    let mut provenance = previous.provenance.clone();
                    let changes = merge_changes(&index, entries, model.pending(), &mut provenance);
                    if changes.is_empty() {
                        let unchanged = (previous, None, 0, Affected::default());
                        return (model, Ok(unchanged), spare);
                    }
                    spare
                        .next(&previous, &changes)
                        .map(|(mut state, affected)| {
                            Arc::make_mut(&mut state).provenance = provenance;
                            let changed = changes.len();
                            (state, Some(changes), changed, affected)
                        })
                }
            } else {
                merged_state(&file, Some((&origin_name, entries))).map(|s| {
                    let s = s.on_network(&network);
                    (Arc::new(s), None, usize::MAX, Affected::everything())
                })
            };
            (model, state, spare)
        };
        let built = if small {
            Ok(build())
        } else {
            tokio::task::spawn_blocking(build).await
        };
        let (model, state, spare) = built.map_err(|err| {
            // A panic lost the model and its pending changes: the next
            // push translates everything and builds the state whole.
            held.xds = None;
            format!("translating istiod's resources failed: {err}")
        })?;
        held.model = model;
        held.spare = spare;
        let (state, changes, changed, affected) = state.map_err(|err| Chain(&err).to_string())?;
        held.model.taken_in();
        held.xds = Some(origin);
        if changed > 0 {
            let installed = Arc::clone(&state);
            let replaced = self.install(state, changed, &affected, None).await;
            // The spare is the state the changes were made to, and only
            // that one.
            match changes {
                Some(changes) if std::ptr::eq(made_from.as_ptr(), Arc::as_ptr(&replaced)) => {
                    held.spare.keep(replaced, changes, &installed);
                }
                _ => held.spare.clear(),
            }
        }
        Ok(())
    }

    /// Puts `state` in force (`changed` entries, reaching `affected`;
    /// `usize::MAX`: built whole) and, when the file changed, enrolls the
    /// pods it configures (only the file configures pods).
    /// Returns the state it replaced.
    async fn install(
        &self,
        state: Arc<MeshState>,
        changed: usize,
        affected: &Affected,
        file: Option<Arc<LocalConfig>>,
    ) -> Arc<MeshState> {
        let (origin, workloads, services, policies) = (
            state.origin.clone(),
            state.workloads.len(),
            state.services.len(),
            state.policies.len(),
        );
        let (closed, replaced) = self.mesh.install(state, affected);
        if let Some(file) = file
            && let Err(err) = self.enroller.apply_config(file).await
        {
            warn!(error = %Chain(&err), "cannot apply the configured workloads");
        }
        let whole = changed == usize::MAX;
        if changed >= crate::heap::TRIM_AFTER {
            // The buffers the change was decoded and built in are free. A
            // trim walks the whole heap (milliseconds at hundreds of MB):
            // off the runtime, whose threads the xDS client shares, and
            // nothing waits for it.
            drop(tokio::task::spawn_blocking(|| {
                let trimmed = crate::heap::trim();
                debug!(trimmed, "freed heap returned after a large change");
            }));
        }
        info!(
            %origin,
            workloads,
            services,
            policies,
            changed = (!whole).then_some(changed),
            whole,
            connections_closed = closed,
            "configuration applied"
        );
        replaced
    }
}

/// The most resource names a push (or a burst the watch coalesced) may
/// carry to be applied on the xDS task itself: a single-workload update
/// costs about 35 us of state work at 10k workloads
/// (`benches/xds_update.rs` `whole`), less than the two thread wake-ups
/// of a hand-over to the blocking pool; 32 of them keep the task busy
/// for about a millisecond at most, while the pods' connections run on
/// their own workers.
pub const INLINE_NAMES: u64 = 32;

/// Runs `build` off the runtime's threads: the xDS client and the
/// connections share them, and a whole build grows with the mesh.
async fn blocking<T: Send + 'static>(
    build: impl FnOnce() -> Result<T, StateError> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(build)
        .await
        .map_err(|err| format!("building the mesh state failed: {err}"))?
        .map_err(|err| Chain(&err).to_string())
}

/// Installs every state istiod publishes, once the first response of
/// every type has arrived (before that a state without its policies could
/// let through what they deny); then marks readiness's xDS step done.
/// Reports each snapshot back once it is the state (or could not be), so
/// the client ACKs what is applied. Returns when the client is gone.
pub async fn follow_xds(
    mut snapshots: watch::Receiver<XdsSnapshot>,
    sources: Arc<ConfigSources>,
    origin: String,
    readiness: Arc<Readiness>,
    applied: AppliedReporter,
) {
    // Resource names the pushes applied so far carried.
    let mut names = 0;
    while snapshots.changed().await.is_ok() {
        // The watch keeps only the newest: a burst of pushes is applied
        // once.
        let snapshot = snapshots.borrow_and_update().clone();
        let generation = snapshot.generation;
        let small = snapshot.names.saturating_sub(names) <= INLINE_NAMES;
        names = snapshot.names;
        if !snapshot.synced {
            // Nothing to serve from yet: its answers need not wait.
            applied.report(generation, None);
            continue;
        }
        let result = sources
            .xds_changed(origin.clone(), snapshot.resources, small)
            .await;
        match &result {
            Ok(()) => readiness.done(Step::Xds),
            Err(error) => {
                warn!(%error, "istiod's state could not be installed; keeping the previous one")
            }
        }
        applied.report(generation, result.err());
    }
}

#[cfg(test)]
#[path = "sources_tests.rs"]
mod tests;
