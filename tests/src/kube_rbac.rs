//! What the chart's ClusterRole lets the agent do, enforced by the stand-in
//! Kubernetes API ([`crate::cni_kubeapi::FakeApi::enforce`]) as Kubernetes'
//! RBAC authorizer would: a request the role does not grant is refused with
//! 403. So a test fails when the agent needs a permission the chart does
//! not give, and the chart checks (`deploy/tools/check_chart.py`) keep the
//! role minimal.
//!
//! Requests are named as the API server names them for RBAC
//! (`k8s.io/apiserver` `RequestInfoFactory`): the resource, with its
//! subresource after a slash, and the verb from the method (`get`, `list`
//! and `watch` for GETs of one object, a collection and a watch; `patch`,
//! `update`, `create`, `delete`).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use k8s_openapi::serde::Deserialize as _;

/// The (resource, verb) pairs a role grants, core API group only (the only
/// one the agent uses).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants(BTreeSet<(String, String)>);

impl Grants {
    /// What the ClusterRole of the chart's default rendering
    /// (`deploy/kubernetes/dataplane.yaml`) grants.
    pub fn from_chart() -> anyhow::Result<Self> {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/dataplane.yaml");
        let text = std::fs::read_to_string(&path)?;
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value = serde_yaml_ng::Value::deserialize(doc)?;
            if value.get("kind").and_then(|k| k.as_str()) != Some("ClusterRole") {
                continue;
            }
            let role: k8s_openapi::api::rbac::v1::ClusterRole = serde_yaml_ng::from_value(value)?;
            let mut grants = BTreeSet::new();
            for rule in role.rules.unwrap_or_default() {
                if !rule
                    .api_groups
                    .unwrap_or_default()
                    .iter()
                    .any(|g| g.is_empty())
                {
                    continue;
                }
                for resource in rule.resources.unwrap_or_default() {
                    for verb in &rule.verbs {
                        grants.insert((resource.clone(), verb.clone()));
                    }
                }
            }
            return Ok(Self(grants));
        }
        anyhow::bail!("no ClusterRole in {}", path.display())
    }

    /// These grants without `resource`'s `verb`.
    pub fn without(mut self, resource: &str, verb: &str) -> Self {
        self.0.remove(&(resource.to_owned(), verb.to_owned()));
        self
    }

    /// Whether a request for `verb` on `resource` is allowed.
    pub fn allows(&self, resource: &str, verb: &str) -> bool {
        self.0.contains(&(resource.to_owned(), verb.to_owned()))
    }
}

/// The resource (with `/subresource`) and verb of a core-API request;
/// `None` for paths outside `/api/v1`.
pub fn attributes(
    method: &str,
    path: &str,
    query: &BTreeMap<String, String>,
) -> Option<(String, String)> {
    let rest = path.strip_prefix("/api/v1/")?;
    let parts: Vec<&str> = rest.split('/').filter(|p| !p.is_empty()).collect();
    // namespaces/<ns>/<resource>[/<name>[/<sub>]], or <resource>[/<name>[/<sub>]].
    let parts = match parts.as_slice() {
        ["namespaces", _, resource, tail @ ..] => {
            let mut v = vec![*resource];
            v.extend_from_slice(tail);
            v
        }
        other => other.to_vec(),
    };
    let (resource, name, sub) = match parts.as_slice() {
        [resource] => (*resource, None, None),
        [resource, name] => (*resource, Some(*name), None),
        [resource, name, sub] => (*resource, Some(*name), Some(*sub)),
        _ => return None,
    };
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = match (method, name) {
        ("GET", _) if watch => "watch",
        ("GET", Some(_)) => "get",
        ("GET", None) => "list",
        ("PATCH", _) => "patch",
        ("PUT", _) => "update",
        ("POST", _) => "create",
        ("DELETE", _) => "delete",
        _ => return None,
    };
    let resource = match sub {
        Some(sub) => format!("{resource}/{sub}"),
        None => resource.to_owned(),
    };
    Some((resource, verb.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(method: &str, path: &str, watch: bool) -> Option<(String, String)> {
        let query = if watch {
            BTreeMap::from([("watch".to_owned(), "true".to_owned())])
        } else {
            BTreeMap::new()
        };
        attributes(method, path, &query)
    }

    #[test]
    fn requests_are_named_as_the_api_server_names_them() {
        let pair = |r: &str, v: &str| Some((r.to_owned(), v.to_owned()));
        assert_eq!(of("GET", "/api/v1/pods", false), pair("pods", "list"));
        assert_eq!(of("GET", "/api/v1/pods", true), pair("pods", "watch"));
        assert_eq!(
            of("GET", "/api/v1/namespaces/shop/pods/web", false),
            pair("pods", "get")
        );
        assert_eq!(
            of("PATCH", "/api/v1/namespaces/shop/pods/web/status", false),
            pair("pods/status", "patch")
        );
        assert_eq!(
            of("PATCH", "/api/v1/namespaces/shop/pods/web", false),
            pair("pods", "patch")
        );
        assert_eq!(
            of("GET", "/api/v1/namespaces", false),
            pair("namespaces", "list")
        );
        assert_eq!(
            of("GET", "/api/v1/namespaces/shop", false),
            pair("namespaces", "get")
        );
    }

    #[test]
    fn the_chart_grants_reads_and_the_status_patch_only() -> anyhow::Result<()> {
        let grants = Grants::from_chart()?;
        assert!(grants.allows("pods", "watch"));
        assert!(grants.allows("pods/status", "patch"));
        assert!(!grants.allows("pods", "patch"));
        assert!(!grants.allows("pods", "update"));
        Ok(())
    }
}
