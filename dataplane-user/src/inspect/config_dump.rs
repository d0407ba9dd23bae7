//! `dataplane config-dump` and the admin endpoint's `/config_dump`: the
//! configuration in force, pods, certificates and kernel state, with
//! ztunnel's sections flattened beside them.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::json;

use super::{AgentView, list_dir, ztunnel_dump};

impl AgentView {
    /// The configuration dump: configuration in force, enrolled pods,
    /// certificates (no keys), kernel programs and pinned maps, and
    /// ztunnel's sections ([`ztunnel_dump::ZtunnelSections`]) beside them.
    pub fn config_dump(&self) -> serde_json::Value {
        let state = self.mesh.state();
        let (pods, departed) = self.pods_and_departed();
        let (programs, cgroup) = match &self.kernel {
            Some(kernel) => {
                let hooks: Vec<String> = kernel.programs.iter().map(|h| (*h).to_owned()).collect();
                (hooks, Some(kernel.cgroup.display().to_string()))
            }
            None => (Vec::new(), None),
        };
        let counters = crate::redirect::read_counters(&self.pins)
            .map(|c| {
                c.into_iter()
                    .map(|c| (c.name.to_owned(), json!(c.value)))
                    .collect::<serde_json::Map<_, _>>()
            })
            .unwrap_or_default();
        let config_error = self.mesh.config_error();
        let config = state.config();
        let ztunnel = ztunnel_dump::ZtunnelSections::build(
            &config,
            &self.mesh.certs.issued(),
            &self.mesh.roots.roots(),
            &pods,
        );
        let mut dump = json!({
            "instance": self.config.state.instance,
            "version": env!("CARGO_PKG_VERSION"),
            "generatedAt": SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            "config": state.provenance.annotate(config.to_json()),
            "configError": config_error,
            // What the agent runs with (its flags, checked); `config` is
            // the workloads, services and policies in force.
            "agentConfig": serde_json::to_value(&*self.config).unwrap_or_default(),
            "xds": self.xds_view(),
            "pods": pods,
            "departedPods": departed,
            // Ours, renamed: `certificates` is ztunnel's (see below).
            "heldCertificates": self.certs(),
            "certificateSource": self.mesh.certs.status(),
            "trustDomain": self.mesh.trust_domain,
            "kernel": {
                "capture": self.config.capture.name(),
                "failOpen": self.config.redirect.fail_open,
                "cgroup": cgroup,
                "programs": programs,
                "pinDir": self.pins.dir().display().to_string(),
                "pinnedMaps": list_dir(&self.pins.maps_dir()),
                "pinnedLinks": list_dir(&self.pins.links_dir()),
                "counters": counters,
            },
        });
        // ztunnel flattens its sections into the top level, where istioctl
        // looks for them (istio `configdump/api.go`, `ZtunnelDump`).
        if let (Some(dump), Ok(serde_json::Value::Object(sections))) =
            (dump.as_object_mut(), serde_json::to_value(&ztunnel))
        {
            dump.extend(sections);
        }
        dump
    }
}
