//! Which source each entry of the merged configuration came from, and
//! what of istiod's was left out, kept with the state it describes and
//! changed with it entry by entry.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::Value;

use crate::config::entries::{Dropped, XdsEntry};

/// Which source each entry of a merged configuration came from.
#[derive(Debug, Clone, Default)]
pub struct Provenance {
    /// istiod's address, when xDS is a source.
    pub xds_origin: Option<String>,
    /// Keys (`workloads/<uid>`, `services/<ns>/<host>`, `policies/<ns>/<name>`)
    /// of the file's entries: every other entry is istiod's (kept this way
    /// round so that a push costs nothing here for istiod's many entries).
    pub from_file: Arc<HashSet<String>>,
    /// istiod's entries a file entry replaces, with that file entry's key.
    pub shadows: imbl::OrdMap<XdsEntry, String>,
    /// What translating istiod's resources left out (see
    /// [`crate::xds::XdsModel`]).
    pub xds_dropped: Dropped,
    /// istiod's entries (or addresses of them) left out because the file
    /// holds the address, and why.
    pub merge_dropped: imbl::OrdMap<XdsEntry, Arc<[String]>>,
}

impl Provenance {
    /// Every note on what of istiod's was left out, in order: the
    /// translation's, then the merge's.
    pub fn dropped(&self) -> Vec<String> {
        self.xds_dropped
            .values()
            .chain(self.merge_dropped.values())
            .flat_map(|notes| notes.iter().cloned())
            .collect()
    }

    /// `config` (the JSON of [`crate::config::LocalConfig::to_json`]) with
    /// `source` on every entry (`file` or `xds`) and `shadows: "xds"` on
    /// file entries that replaced one from istiod, plus `xdsDropped`.
    /// Unchanged when istiod is not a source.
    pub fn annotate(&self, mut config: Value) -> Value {
        if self.xds_origin.is_none() {
            return config;
        }
        let shadowing: HashSet<&str> = self.shadows.values().map(String::as_str).collect();
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
                    if shadowing.contains(key.as_str()) {
                        object.insert("shadows".into(), "xds".into());
                    }
                }
            }
        }
        if let Some(object) = config.as_object_mut() {
            object.insert("xdsDropped".into(), self.dropped().into());
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
