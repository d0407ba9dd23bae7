//! Who the agent says it is to istiod: the xDS `Node`, in the shape Istio's
//! node proxy sends, because istiod decides from it which workloads and
//! services this node needs.

use std::collections::BTreeMap;
use std::net::IpAddr;

use prost_types::{Struct, Value, value::Kind};

use crate::istio_api::discovery::Node;

/// The facts the node id and metadata are built from (normally the
/// agent pod's downward-API environment).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeIdentity {
    /// The agent pod's IP (`INSTANCE_IP`).
    pub ip: IpAddr,
    /// The agent pod's name (`POD_NAME`).
    pub pod: String,
    /// The agent pod's namespace (`POD_NAMESPACE`).
    pub namespace: String,
    /// The Kubernetes node (`NODE_NAME`): istiod sends the workloads of
    /// this node and everything they may call.
    pub node_name: String,
    /// The cluster id (`CLUSTER_ID`), when set.
    pub cluster_id: Option<String>,
    /// Extra metadata (`ISTIO_META_<KEY>` environment variables, the prefix
    /// removed).
    pub extra: BTreeMap<String, String>,
}

/// Prefix of environment variables passed through as node metadata.
pub const META_PREFIX: &str = "ISTIO_META_";

impl NodeIdentity {
    /// `ztunnel~<ip>~<pod>.<ns>~<ns>.svc.cluster.local`: the id istiod
    /// recognises as a node proxy's.
    pub fn id(&self) -> String {
        let Self {
            ip, pod, namespace, ..
        } = self;
        format!("ztunnel~{ip}~{pod}.{namespace}~{namespace}.svc.cluster.local")
    }

    /// The xDS node: id and metadata (`NAME`, `NAMESPACE`, `INSTANCE_IPS`,
    /// `NODE_NAME`, `CLUSTER_ID`, then the extra keys, which may not
    /// override those).
    pub fn node(&self) -> Node {
        let mut fields: BTreeMap<String, Value> = self
            .extra
            .iter()
            .map(|(key, value)| (key.clone(), string(value)))
            .collect();
        fields.insert("NAME".into(), string(&self.pod));
        fields.insert("NAMESPACE".into(), string(&self.namespace));
        fields.insert("INSTANCE_IPS".into(), string(&self.ip.to_string()));
        fields.insert("NODE_NAME".into(), string(&self.node_name));
        if let Some(cluster) = &self.cluster_id {
            fields.insert("CLUSTER_ID".into(), string(cluster));
        }
        Node {
            id: self.id(),
            cluster: String::new(),
            metadata: Some(Struct { fields }),
        }
    }

    /// The `ISTIO_META_*` variables among `vars`, prefix removed.
    pub fn extra_from(
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> BTreeMap<String, String> {
        vars.into_iter()
            .filter_map(|(key, value)| {
                let key = key.strip_prefix(META_PREFIX)?;
                (!key.is_empty()).then(|| (key.to_owned(), value))
            })
            .collect()
    }
}

/// A protobuf `Value` holding a string.
pub fn string(value: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent() -> NodeIdentity {
        NodeIdentity {
            ip: IpAddr::from([10, 0, 0, 7]),
            pod: "dataplane-x7k2p".into(),
            namespace: "istio-system".into(),
            node_name: "node-a".into(),
            cluster_id: Some("Kubernetes".into()),
            extra: NodeIdentity::extra_from([
                ("ISTIO_META_DNS_CAPTURE".to_owned(), "true".to_owned()),
                ("ISTIO_META_NAME".to_owned(), "spoof".to_owned()),
                ("ISTIO_META_".to_owned(), "empty".to_owned()),
                ("HOME".to_owned(), "/root".to_owned()),
            ]),
        }
    }

    #[test]
    fn id_has_the_node_proxy_shape() {
        assert_eq!(
            agent().id(),
            "ztunnel~10.0.0.7~dataplane-x7k2p.istio-system~istio-system.svc.cluster.local"
        );
    }

    #[test]
    fn metadata_names_the_pod_and_node_and_passes_istio_meta() {
        let node = agent().node();
        let fields = node.metadata.map(|m| m.fields).unwrap_or_default();
        let get = |key: &str| match fields.get(key).and_then(|v| v.kind.clone()) {
            Some(Kind::StringValue(s)) => s,
            other => panic!("{key}: {other:?}"),
        };
        assert_eq!(get("NAME"), "dataplane-x7k2p");
        assert_eq!(get("NAMESPACE"), "istio-system");
        assert_eq!(get("INSTANCE_IPS"), "10.0.0.7");
        assert_eq!(get("NODE_NAME"), "node-a");
        assert_eq!(get("CLUSTER_ID"), "Kubernetes");
        assert_eq!(get("DNS_CAPTURE"), "true");
        assert!(!fields.contains_key(""), "an empty key is dropped");
        assert!(!fields.contains_key("HOME"));
    }
}
