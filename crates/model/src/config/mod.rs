//! The local configuration file: workloads, services and authorization
//! policies in the shape Istio's node proxy accepts for local config.
//!
//! Parsing is strict: an unknown field, a bad IP, CIDR or port is an error
//! that names the file, the line and the column; so is a duplicate workload
//! IP or service VIP, or a reference to a service or policy that does not
//! exist. Nothing is silently ignored.

pub mod changes;
pub mod entries;
pub mod interned;
pub(crate) mod limits;
mod schema;
mod shared_str;
mod validate;
mod vip;
mod workload;

pub use limits::{MAX_CONFIG_BYTES, MAX_FLOW_DEPTH};

pub use schema::{
    Action, HealthPolicy, IpFamily, LoadBalancing, Match, Policy, Routing, RoutingMode,
    RoutingScope, Scope, Service, Visibility, WeightedWaypoint,
};
pub use shared_str::SharedStr;
pub use vip::{Vip, VipError, VipRange, VipRangeError};
pub use workload::{
    AppTunnelProtocol, ApplicationTunnel, Locality, Ports, Protocol, ServicePorts, Waypoint,
    Workload, WorkloadStatus,
};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The configuration compiled into the agent (see `config/default.yaml`).
pub const EMBEDDED_DEFAULT: &str = include_str!("default.yaml");

/// Errors reading a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is empty (or only comments): applying it would take every
    /// workload out of the mesh at once, which is never what an empty
    /// file means (a config being written, a volume not yet filled).
    #[error(
        "config {origin} is empty; refusing it (to remove every workload on purpose, write `workloads: []`)"
    )]
    Empty {
        /// The file path.
        origin: String,
    },
    /// The file exceeds what the agent parses (size, nesting).
    #[error("config {origin} refused before parsing: {what}")]
    Bounds {
        /// The file path.
        origin: String,
        /// Which bound, and by how much.
        what: String,
    },
    /// The YAML is malformed or does not match the schema.
    #[error("invalid config {origin}")]
    Parse {
        /// The file path, or `<embedded default>`.
        origin: String,
        /// The parser's error, which carries line and column.
        #[source]
        source: serde_yaml_ng::Error,
    },
    /// The file parses but contradicts itself.
    #[error("invalid config {origin}:{line}:{column}: {field}: {reason}")]
    Invalid {
        /// The file path, or `<embedded default>`.
        origin: String,
        /// 1-based line of the offending value (best effort: its first
        /// occurrence after the entry's start).
        line: usize,
        /// 1-based column.
        column: usize,
        /// The field, e.g. `workloads[2].workloadIps`.
        field: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
}

/// A parsed configuration.
///
/// Serializes as `{origin, workloads, services, policies}` with the entries
/// in the camelCase shape the file is read in; without `origin` the output
/// parses back (as YAML) to an equal value.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LocalConfig {
    /// Where it came from (a path, or `<embedded default>`).
    pub origin: String,
    /// Workloads, each shared by every config and mesh state that holds
    /// it (a push from istiod copies none of those it does not change).
    pub workloads: Vec<Arc<Workload>>,
    /// Services.
    pub services: Vec<Service>,
    /// Authorization policies.
    pub policies: Vec<Policy>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    workloads: Vec<Workload>,
    #[serde(default)]
    services: Vec<Service>,
    #[serde(default)]
    policies: Vec<Policy>,
}

impl LocalConfig {
    /// The embedded default.
    pub fn embedded() -> Result<Self, ConfigError> {
        Self::parse(EMBEDDED_DEFAULT, "<embedded default>")
    }

    /// Reads and parses `path`; a file over [`MAX_CONFIG_BYTES`] is refused
    /// without being read whole.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let read_error = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        let invalid =
            |what: String| read_error(std::io::Error::new(std::io::ErrorKind::InvalidData, what));
        let (bytes, more) =
            dataplane_core::fs::read_at_most(path, MAX_CONFIG_BYTES).map_err(read_error)?;
        if more {
            return Err(invalid(format!(
                "larger than the {MAX_CONFIG_BYTES} bytes accepted"
            )));
        }
        let text =
            String::from_utf8(bytes).map_err(|err| invalid(format!("not UTF-8 text: {err}")))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The configuration as JSON, for the admin endpoint:
    /// `{"origin": ..., "workloads": [...], "services": [...], "policies": [...]}`
    /// with camelCase keys, as the file is written. Map keys (ports) become
    /// JSON strings, as JSON requires.
    ///
    /// Serialization can only fail for a non-UTF-8 `netns` path, which the
    /// parser never produces; then the value is `{"origin", "error"}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_else(|e| {
            let mut object = serde_json::Map::new();
            object.insert("origin".to_owned(), self.origin.clone().into());
            object.insert(
                "error".to_owned(),
                format!("cannot serialize the configuration: {e}").into(),
            );
            serde_json::Value::Object(object)
        })
    }

    /// The configuration as the file that reads back to it (without its
    /// origin), e.g. to write what istiod sent as a local file.
    pub fn to_yaml(&self) -> Result<String, serde_yaml_ng::Error> {
        #[derive(Serialize)]
        struct File<'a> {
            workloads: &'a [Arc<Workload>],
            services: &'a [Service],
            policies: &'a [Policy],
        }
        serde_yaml_ng::to_string(&File {
            workloads: &self.workloads,
            services: &self.services,
            policies: &self.policies,
        })
    }

    /// Parses YAML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        limits::check(text, origin)?;
        let raw: RawConfig =
            serde_yaml_ng::from_str(text).map_err(|source| ConfigError::Parse {
                origin: origin.to_owned(),
                source,
            })?;
        let config = Self {
            origin: origin.to_owned(),
            workloads: raw.workloads.into_iter().map(Arc::new).collect(),
            services: raw.services,
            policies: raw.policies,
        };
        validate::check(&config, text)?;
        Ok(config)
    }
}

#[cfg(test)]
#[expect(
    clippy::unwrap_used,
    reason = "a bad fixture should fail the test loudly"
)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn embedded_default_parses() {
        let config = LocalConfig::embedded().expect("embedded default must parse");
        assert!(config.workloads.is_empty());
    }

    #[test]
    fn workload_defaults_and_fields() {
        let config = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  workloadIps: [10.0.0.5]\n",
            "t",
        )
        .expect("valid config");
        let w = &config.workloads[0];
        assert_eq!(&*w.trust_domain, "cluster.local");
        assert_eq!(&*w.service_account, "default");
        assert_eq!(w.protocol, Protocol::Hbone);
        assert_eq!(*w.workload_ips, vec!["10.0.0.5".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn unknown_field_is_rejected_with_position() {
        let err = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  colour: red\n",
            "cfg.yaml",
        )
        .unwrap_err();
        let err = dataplane_core::error::Chain(&err).to_string();
        assert!(err.contains("cfg.yaml"), "{err}");
        assert!(err.contains("colour"), "{err}");
        assert!(err.contains("line 5"), "{err}");
    }

    /// A config using every field kind, with non-default values where a
    /// default exists.
    const RICH: &str = r#"
workloads:
- uid: cluster1//v1/Pod/shop/web-0
  name: web-0
  namespace: shop
  serviceAccount: web
  trustDomain: example.org
  workloadIps: [10.0.0.5, "fd00::5"]
  protocol: TCP
  node: node-a
  netns: /var/run/netns/web-0
  services:
    shop/web.shop.svc.cluster.local: {80: 8080, 443: 8443}
  authorizationPolicies: [shop/only-frontend]
  status: Unhealthy
  waypoint: {hostname: shop/waypoint.shop.svc.cluster.local}
  network: net1
  canonicalName: web
  canonicalRevision: v2
  workloadName: web
  clusterId: cluster1
  locality: {region: eu, zone: eu-1, subzone: rack-4}
- uid: cluster1//v1/Pod/shop/db-0
  name: db-0
  namespace: shop
  workloadIps: [10.0.0.6]
  waypoint: {address: 10.0.0.9, hbonePort: 15009}
services:
- name: web
  namespace: shop
  hostname: web.shop.svc.cluster.local
  vips: [net1/10.96.0.10, "/fd00::10"]
  ports: {80: 8080, 443: 0}
  subjectAltNames: [spiffe://example.org/ns/shop/sa/web, cluster.local/ns/shop/sa/legacy]
  loadBalancing: random
  healthPolicy: allowAll
  routing: {mode: failover, preferences: [network, zone, node]}
  waypoint: {address: "fd00::9"}
- name: db
  namespace: shop
  hostname: db.shop.svc.cluster.local
policies:
- name: only-frontend
  namespace: shop
  scope: WorkloadSelector
  action: Deny
  dryRun: true
  rules:
  - - - namespaces: [front]
        notNamespaces: [kube-system]
        serviceAccounts: [front/ui, api]
        notServiceAccounts: [front/batch]
        principals: [cluster.local/ns/front/sa/*]
        notPrincipals: [spiffe://cluster.local/ns/front/sa/admin]
        sourceIps: [10.1.0.0/16, "fd00:1::/64"]
        notSourceIps: [10.1.2.3/32]
        destinationIps: [10.0.0.0/24]
        notDestinationIps: [10.0.0.7/32]
        destinationPorts: [8080, 8443]
        notDestinationPorts: [9090]
      - principals: ["*"]
    - - destinationPorts: [80]
- name: allow-all
  namespace: istio-system
  scope: Global
  action: Allow
- name: ns-deny
  namespace: shop
  scope: Namespace
  action: Deny
  rules:
  - - - notSourceIps: [0.0.0.0/0]
"#;

    /// Writes `config` as a config file (workloads, services, policies)
    /// and parses it back with the real parser.
    fn reparse(config: &LocalConfig) -> (String, LocalConfig) {
        let text = config.to_yaml().unwrap();
        crate::fuzz_seeds::seed("config", &text);
        let parsed = LocalConfig::parse(&text, &config.origin)
            .unwrap_or_else(|e| panic!("{}\n{text}", dataplane_core::error::Chain(&e)));
        (text, parsed)
    }

    #[test]
    fn embedded_default_round_trips() {
        let config = LocalConfig::embedded().unwrap();
        let (_, parsed) = reparse(&config);
        assert_eq!(parsed, config);
    }

    #[test]
    fn every_field_kind_round_trips() {
        crate::fuzz_seeds::seed("config", RICH);
        let config = LocalConfig::parse(RICH, "rich.yaml").unwrap();
        // The fixture really sets the non-default values.
        assert_eq!(config.workloads[0].protocol, Protocol::Tcp);
        assert_eq!(config.services[0].load_balancing, LoadBalancing::Random);
        assert_eq!(config.workloads[0].status, WorkloadStatus::Unhealthy);
        assert_eq!(&*config.workloads[0].locality().subzone, "rack-4");
        assert_eq!(config.services[0].routing.mode, RoutingMode::Failover);
        assert_eq!(
            config.workloads[1].waypoint.as_ref().map(|w| w.hbone_port),
            Some(15009)
        );
        assert!(config.policies[0].dry_run);
        assert_eq!(
            config.policies[0].rules[0][0][0].not_destination_ports,
            [9090]
        );

        let (text, parsed) = reparse(&config);
        assert_eq!(parsed, config, "{text}");
        // VIPs are written in the `network/ip` form the parser reads.
        assert!(text.contains("/10.96.0.10"), "{text}");
        // Fields at their default are left out.
        assert!(!text.contains("dryRun: false"), "{text}");
        assert!(!text.contains("notNamespaces: []"), "{text}");
    }

    #[test]
    fn to_json_has_the_file_shape_in_camel_case() {
        let config = LocalConfig::parse(RICH, "rich.yaml").unwrap();
        let json = config.to_json();
        let mut keys: Vec<&str> = json
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["origin", "policies", "services", "workloads"]);
        assert_eq!(json["origin"], "rich.yaml");

        let web = &json["workloads"][0];
        assert_eq!(web["serviceAccount"], "web");
        assert_eq!(web["trustDomain"], "example.org");
        assert_eq!(web["workloadIps"][1], "fd00::5");
        assert_eq!(web["protocol"], "TCP");
        assert_eq!(web["authorizationPolicies"][0], "shop/only-frontend");
        assert_eq!(
            web["services"]["shop/web.shop.svc.cluster.local"]["80"],
            8080
        );
        assert!(web.get("service_account").is_none());

        let svc = &json["services"][0];
        assert_eq!(svc["vips"][0], "net1/10.96.0.10");
        assert_eq!(svc["subjectAltNames"][1], "cluster.local/ns/shop/sa/legacy");
        assert_eq!(svc["loadBalancing"], "random");

        let policy = &json["policies"][0];
        assert_eq!(policy["scope"], "WorkloadSelector");
        assert_eq!(policy["action"], "Deny");
        assert_eq!(policy["dryRun"], true);
        let m = &policy["rules"][0][0][0];
        assert_eq!(m["notSourceIps"][0], "10.1.2.3/32");
        assert_eq!(m["notDestinationPorts"][0], 9090);
        assert!(policy["rules"][0][0][1].get("namespaces").is_none());
    }

    #[test]
    fn from_file_refuses_an_oversized_or_non_utf8_file_without_reading_it_whole() {
        let dir = std::env::temp_dir().join(format!("dp-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("big.yaml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES + 1]).unwrap();
        let binary = dir.join("binary.yaml");
        std::fs::write(&binary, [0xff, 0xfe, b'\n']).unwrap();
        let big_err = LocalConfig::from_file(&big).map(drop);
        let binary_err = LocalConfig::from_file(&binary).map(drop);
        std::fs::remove_dir_all(&dir).unwrap();
        let text =
            |r: Result<(), ConfigError>| dataplane_core::error::Chain(&r.unwrap_err()).to_string();
        let big_err = text(big_err);
        assert!(
            big_err.contains("big.yaml") && big_err.contains("larger than"),
            "{big_err}"
        );
        let binary_err = text(binary_err);
        assert!(
            binary_err.contains("binary.yaml") && binary_err.contains("UTF-8"),
            "{binary_err}"
        );
    }

    #[test]
    fn a_waypoint_needs_one_destination() {
        let base = "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  waypoint: ";
        for (waypoint, expected) in [
            ("{}", "exactly one of `address` and `hostname`"),
            ("{address: 10.0.0.1, hostname: a/b}", "exactly one of"),
            ("{hostname: waypoint}", "not namespace/hostname"),
            ("{address: 10.0.0.1, hbonePort: 0}", "0 is not a port"),
        ] {
            let err = LocalConfig::parse(&format!("{base}{waypoint}\n"), "w.yaml").unwrap_err();
            let err = dataplane_core::error::Chain(&err).to_string();
            assert!(
                err.contains(expected) && err.contains("workloads[0].waypoint"),
                "{waypoint}: {err}"
            );
        }
    }

    #[test]
    fn an_application_tunnel_reads_as_ztunnel_writes_it() {
        let base = "workloads:\n- uid: u1\n  name: wp\n  namespace: shop\n  applicationTunnel: ";
        let tunnel = |text: &str| {
            LocalConfig::parse(&format!("{base}{text}\n"), "t.yaml")
                .map(|c| c.workloads[0].application_tunnel)
        };
        assert_eq!(
            tunnel("{protocol: PROXY, port: 15088}").unwrap(),
            Some(ApplicationTunnel {
                protocol: AppTunnelProtocol::Proxy,
                port: Some(15088)
            })
        );
        assert_eq!(
            tunnel("{protocol: NONE}").unwrap(),
            Some(ApplicationTunnel {
                protocol: AppTunnelProtocol::None,
                port: None
            })
        );
        for (text, expected) in [
            ("{protocol: PROXY, port: 0}", "applicationTunnel.port"),
            ("{protocol: HAPROXY}", "unknown variant"),
            ("{port: 15088}", "protocol"),
        ] {
            let err = dataplane_core::error::Chain(&tunnel(text).unwrap_err()).to_string();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn services_of_different_namespaces_may_share_a_vip_and_no_others() {
        let two = |ns: &str| {
            format!(
                "services:\n\
                 - {{name: db, namespace: a, hostname: db.ext, vips: ['/10.96.0.9']}}\n\
                 - {{name: db, namespace: {ns}, hostname: db2.ext, vips: ['/10.96.0.9']}}\n"
            )
        };
        let config = LocalConfig::parse(&two("b"), "cfg.yaml").unwrap();
        let state = crate::state::MeshState::from_config(&config).unwrap();
        let vip = "10.96.0.9".parse().unwrap();
        let seen = |ns| {
            state
                .services
                .by_vip_for(vip, ns)
                .map(|e| e.service.namespace.clone())
        };
        assert_eq!(seen("a").as_deref(), Some("a"));
        assert_eq!(seen("b").as_deref(), Some("b"));
        let err = LocalConfig::parse(&two("a"), "cfg.yaml").unwrap_err();
        let err = dataplane_core::error::Chain(&err).to_string();
        assert!(
            err.contains("services[1].vips") && err.contains("namespace `a`"),
            "{err}"
        );
    }

    #[test]
    fn bad_ip_is_rejected() {
        let err = LocalConfig::parse(
            "workloads:\n- uid: u1\n  name: web\n  namespace: shop\n  workloadIps: [10.0.0.300]\n",
            "cfg.yaml",
        )
        .unwrap_err();
        let err = dataplane_core::error::Chain(&err).to_string();
        assert!(err.contains("invalid"), "{err}");
    }

    #[test]
    fn a_workload_hostname_must_be_a_dns_name() {
        let with = |host: &str| {
            let text = format!(
                "workloads:\n- uid: u1\n  name: api\n  namespace: shop\n  hostname: '{host}'\n"
            );
            LocalConfig::parse(&text, "cfg.yaml")
                .map(|c| c.workloads[0].hostname.to_string())
                .map_err(|e| dataplane_core::error::Chain(&e).to_string())
        };
        assert_eq!(with("api.example.com").unwrap(), "api.example.com");
        assert_eq!(with("api.example.com.").unwrap(), "api.example.com.");
        assert_eq!(with("_svc.db-1.example").unwrap(), "_svc.db-1.example");
        let long = format!("{}.com", "a".repeat(64));
        let longer = vec!["abcdefghi"; 26].join(".");
        for bad in ["api..example.com", "api example.com", &long, &longer, "."] {
            let err = with(bad).unwrap_err();
            assert!(err.contains("workloads[0].hostname"), "{bad}: {err}");
        }
    }
}
