//! The plugin's access to the Kubernetes API: a kubeconfig in the CNI
//! configuration directory pointing at a copy of the DaemonSet pod's
//! service-account token, which `install-cni` keeps fresh (the kubelet
//! rotates the projected token; the plugin, run by the runtime on the host,
//! cannot read the pod's mount).

use std::path::Path;

use base64::Engine as _;

/// Name of the kubeconfig in the CNI configuration directory. No `.conf`
/// suffix, so runtimes do not take it for a network configuration.
pub const KUBECONFIG_NAME: &str = "ZZZ-dataplane-cni-kubeconfig";

/// Name of the token copy beside it.
pub const TOKEN_NAME: &str = "ZZZ-dataplane-cni-token";

/// The in-cluster API server from `KUBERNETES_SERVICE_HOST` and
/// `KUBERNETES_SERVICE_PORT`, as the kubelet sets them in every pod.
pub fn in_cluster_server(get: impl Fn(&str) -> Option<String>) -> Option<String> {
    let host = get("KUBERNETES_SERVICE_HOST").filter(|h| !h.is_empty())?;
    let port = get("KUBERNETES_SERVICE_PORT")
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "443".into());
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host
    };
    Some(format!("https://{host}:{port}"))
}

/// A kubeconfig for `server`, trusting `ca_pem` (when given) and
/// authenticating with the token in `token_file` (a host path).
pub fn render(server: &str, ca_pem: Option<&[u8]>, token_file: &Path) -> String {
    let trust = match ca_pem {
        Some(pem) => format!(
            "    certificate-authority-data: {}\n",
            base64::engine::general_purpose::STANDARD.encode(pem)
        ),
        None => String::new(),
    };
    format!(
        "# Written by `dataplane install-cni` for the dataplane-cni plugin; rewritten at every start.\n\
         apiVersion: v1\n\
         kind: Config\n\
         clusters:\n\
         - name: local\n  cluster:\n    server: {server}\n{trust}\
         users:\n\
         - name: dataplane-cni\n  user:\n    tokenFile: {token}\n\
         contexts:\n\
         - name: dataplane-cni\n  context:\n    cluster: local\n    user: dataplane-cni\n\
         current-context: dataplane-cni\n",
        token = token_file.display()
    )
}

#[cfg(test)]
#[expect(clippy::unwrap_used, reason = "tests fail loudly on unexpected errors")]
mod tests {
    use super::*;

    #[test]
    fn server_from_environment() {
        let env = |host: &'static str| {
            move |name: &str| match name {
                "KUBERNETES_SERVICE_HOST" => Some(host.to_owned()),
                "KUBERNETES_SERVICE_PORT" => Some("6443".to_owned()),
                _ => None,
            }
        };
        assert_eq!(
            in_cluster_server(env("10.96.0.1")).as_deref(),
            Some("https://10.96.0.1:6443")
        );
        assert_eq!(
            in_cluster_server(env("fd00::1")).as_deref(),
            Some("https://[fd00::1]:6443")
        );
        assert_eq!(in_cluster_server(|_| None), None);
    }

    #[test]
    fn kubeconfig_reads_back() {
        let text = render(
            "https://10.96.0.1:443",
            Some(b"-----BEGIN CERTIFICATE-----\n"),
            Path::new("/etc/cni/net.d/ZZZ-dataplane-cni-token"),
        );
        let parsed = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        assert_eq!(parsed.current_context.as_deref(), Some("dataplane-cni"));
        let cluster = parsed.clusters[0].cluster.as_ref().unwrap();
        assert_eq!(cluster.server.as_deref(), Some("https://10.96.0.1:443"));
        let user = parsed.auth_infos[0].auth_info.as_ref().unwrap();
        assert_eq!(
            user.token_file.as_deref(),
            Some("/etc/cni/net.d/ZZZ-dataplane-cni-token")
        );
    }
}
