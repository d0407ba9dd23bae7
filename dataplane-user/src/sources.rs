//! Where the mesh state comes from: the local file, istiod (xDS), or both.
//!
//! Both sources are the same model ([`crate::config::LocalConfig`]): the
//! file as parsed, istiod's resources as [`crate::xds::translate`] writes
//! them. With both, an entry of the file wins over istiod's entry of the
//! same key (workload uid, service `namespace/hostname`, policy
//! `namespace/name`), and an istiod workload or VIP that claims an address
//! a file entry holds is left out: the file is the operator's override.
//! `config-dump` marks every entry with its source and the file entries
//! that shadow istiod's.
//!
//! A change of either source rebuilds the merged state and installs it
//! whole (policies re-checked on open connections, configured pods
//! enrolled), one change at a time, off the runtime's threads. What did
//! not change is not built again: istiod's untouched resources keep their
//! translation ([`crate::xds::translate::TranslationCache`]), workloads are
//! shared entries, and the new state takes unchanged ones from the state
//! in force.

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use serde_json::Value;
use tokio::sync::{Mutex, watch};
use tracing::{info, warn};

use crate::config::LocalConfig;
use crate::enroll::Enroller;
use crate::logging::Chain;
use crate::mesh::MeshContext;
use crate::readiness::{Readiness, Step};
use crate::state::MeshState;
use crate::xds::{Translated, XdsSnapshot, client::AppliedReporter, translate::TranslationCache};

/// Which source each entry of a merged configuration came from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Provenance {
    /// istiod's address, when xDS is a source.
    pub xds_origin: Option<String>,
    /// Keys (`workloads/<uid>`, `services/<ns>/<host>`, `policies/<ns>/<name>`)
    /// of the file's entries: every other entry is istiod's (kept this way
    /// round so that a push costs nothing here for istiod's many entries).
    pub from_file: HashSet<String>,
    /// Keys of file entries that replaced one from istiod.
    pub shadowing: HashSet<String>,
    /// istiod entries (or addresses of them) left out, and why.
    pub dropped: Vec<String>,
}

impl Provenance {
    /// `config` (the JSON of [`LocalConfig::to_json`]) with `source` on
    /// every entry (`file` or `xds`) and `shadows: "xds"` on file entries
    /// that replaced one from istiod, plus `xdsDropped`. Unchanged when
    /// istiod is not a source.
    pub fn annotate(&self, mut config: Value) -> Value {
        if self.xds_origin.is_none() {
            return config;
        }
        for (list, key_of) in [
            (
                "workloads",
                (|e: &Value| field(e, "uid")) as fn(&Value) -> String,
            ),
            ("services", |e| {
                format!("{}/{}", field(e, "namespace"), field(e, "hostname"))
            }),
            ("policies", |e| {
                format!("{}/{}", field(e, "namespace"), field(e, "name"))
            }),
        ] {
            let Some(entries) = config.get_mut(list).and_then(Value::as_array_mut) else {
                continue;
            };
            for entry in entries {
                let key = format!("{list}/{}", key_of(entry));
                let source = if self.from_file.contains(&key) {
                    "file"
                } else {
                    "xds"
                };
                if let Some(object) = entry.as_object_mut() {
                    object.insert("source".into(), source.into());
                    if self.shadowing.contains(&key) {
                        object.insert("shadows".into(), "xds".into());
                    }
                }
            }
        }
        if let Some(object) = config.as_object_mut() {
            object.insert("xdsDropped".into(), self.dropped.clone().into());
        }
        config
    }
}

fn field(entry: &Value, name: &str) -> String {
    entry
        .get(name)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

/// The file's entries, then istiod's that the file does not replace; the
/// provenance says which is which.
pub fn merge(file: &LocalConfig, xds: Option<(&str, &Translated)>) -> (LocalConfig, Provenance) {
    let Some((xds_origin, xds)) = xds else {
        return (file.clone(), Provenance::default());
    };
    let mut provenance = Provenance {
        xds_origin: Some(xds_origin.to_owned()),
        dropped: xds.dropped.clone(),
        from_file: file
            .workloads
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
            .collect(),
        ..Provenance::default()
    };
    let mut merged = file.clone();
    merged.origin =
        if file.workloads.is_empty() && file.services.is_empty() && file.policies.is_empty() {
            xds.config.origin.clone()
        } else {
            format!("{} + {}", file.origin, xds.config.origin)
        };
    // Addresses the file holds: istiod may not claim them (istiod's own
    // entries were made to agree with one another by the translation).
    let taken: HashSet<IpAddr> = file
        .workloads
        .iter()
        .flat_map(|w| w.workload_ips.iter().copied())
        .chain(file.services.iter().flat_map(|s| s.vips.iter().copied()))
        .collect();
    let uids: BTreeSet<&str> = file.workloads.iter().map(|w| w.uid.as_str()).collect();
    merged.workloads.reserve(xds.config.workloads.len());
    for w in &xds.config.workloads {
        if uids.contains(w.uid.as_str()) {
            provenance.shadowing.insert(format!("workloads/{}", w.uid));
            continue;
        }
        if let Some(ip) = w.workload_ips.iter().find(|ip| taken.contains(ip)) {
            provenance.dropped.push(format!(
                "workload {}: IP {ip} belongs to a workload of the file",
                w.uid
            ));
            continue;
        }
        merged.workloads.push(w.clone());
    }
    let services: BTreeSet<String> = file.services.iter().map(|s| s.key()).collect();
    for s in &xds.config.services {
        let key = s.key();
        if services.contains(&key) {
            provenance.shadowing.insert(format!("services/{key}"));
            continue;
        }
        let mut s = s.clone();
        s.vips.retain(|vip| {
            let free = !taken.contains(vip);
            if !free {
                provenance.dropped.push(format!(
                    "service {key}: VIP {vip} belongs to an entry of the file"
                ));
            }
            free
        });
        merged.services.push(s);
    }
    let policies: BTreeSet<String> = file.policies.iter().map(|p| p.key()).collect();
    for p in &xds.config.policies {
        let key = p.key();
        if policies.contains(&key) {
            provenance.shadowing.insert(format!("policies/{key}"));
            continue;
        }
        merged.policies.push(p.clone());
    }
    (merged, provenance)
}

/// The latest version of each source.
#[derive(Debug, Default)]
struct Held {
    file: Arc<LocalConfig>,
    xds: Option<(String, Arc<Translated>)>,
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
    /// embedded default), istiod's part empty until it arrives.
    pub fn new(mesh: Arc<MeshContext>, enroller: Enroller, file: Arc<LocalConfig>) -> Self {
        Self {
            mesh,
            enroller,
            held: Mutex::new(Held { file, xds: None }),
        }
    }

    /// A new file version (parsed and valid on its own).
    pub async fn file_changed(&self, file: LocalConfig) -> Result<(), String> {
        let mut held = self.held.lock().await;
        let previous = std::mem::replace(&mut held.file, Arc::new(file));
        let result = self.install(&held).await;
        match &result {
            Ok(()) => self.mesh.accept_config(),
            Err(_) => held.file = previous,
        }
        result
    }

    /// A new state from istiod (`origin` names it).
    pub async fn xds_changed(&self, origin: String, xds: Translated) -> Result<(), String> {
        let mut held = self.held.lock().await;
        let previous = held.xds.replace((origin, Arc::new(xds)));
        let result = self.install(&held).await;
        if result.is_err() {
            held.xds = previous;
        }
        result
    }

    async fn install(&self, held: &Held) -> Result<(), String> {
        let file = Arc::clone(&held.file);
        let xds = held
            .xds
            .as_ref()
            .map(|(origin, t)| (origin.clone(), Arc::clone(t)));
        // What did not change is taken from the state in force.
        let previous = self.mesh.state();
        // Off the runtime: the build grows with the mesh, and the xDS
        // client and the connections share the runtime's threads.
        let built = tokio::task::spawn_blocking(move || {
            let xds = xds
                .as_ref()
                .map(|(origin, t)| (origin.as_str(), t.as_ref()));
            let (merged, provenance) = merge(&file, xds);
            // One copy of the merged config, shared by the state and the
            // enrollment actor.
            let merged = Arc::new(merged);
            MeshState::succeeding(Arc::clone(&merged), Some(&previous))
                .map(|state| (merged, state, provenance))
                .map_err(|e| Chain(&e).to_string())
        })
        .await
        .map_err(|err| format!("building the mesh state failed: {err}"))?;
        let (merged, mut state, provenance) = built?;
        for dropped in &provenance.dropped {
            warn!(reason = %dropped, "left out of the mesh state");
        }
        state.provenance = provenance;
        let closed = self.mesh.install(state);
        if let Err(err) = self.enroller.apply_config(Arc::clone(&merged)).await {
            warn!(error = %Chain(&err), "cannot apply the configured workloads");
        }
        info!(
            origin = %merged.origin,
            workloads = merged.workloads.len(),
            services = merged.services.len(),
            policies = merged.policies.len(),
            connections_closed = closed,
            "configuration applied"
        );
        Ok(())
    }
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
    // What was translated for the last push: what a push did not change is
    // not translated again (and stays the entry the state holds).
    let mut cache = TranslationCache::default();
    while snapshots.changed().await.is_ok() {
        // The watch keeps only the newest: a burst of pushes is translated
        // once.
        let snapshot = snapshots.borrow_and_update().clone();
        let generation = snapshot.generation;
        if !snapshot.synced {
            // Nothing to serve from yet: its answers need not wait.
            applied.report(generation, None);
            continue;
        }
        let name = origin.clone();
        let translated = tokio::task::spawn_blocking(move || {
            let translated = cache.translate(&snapshot.resources, &name);
            (translated, cache)
        })
        .await;
        let result = match translated {
            Ok((translated, kept)) => {
                cache = kept;
                sources.xds_changed(origin.clone(), translated).await
            }
            Err(err) => {
                cache = TranslationCache::default();
                Err(format!("translating istiod's resources failed: {err}"))
            }
        };
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
