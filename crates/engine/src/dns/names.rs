//! Which mesh service a queried name means, the way Istio's node proxy
//! reads it: the name as asked, its Kubernetes expansions
//! (`name` -> `name.<ns>.svc.<domain>`, `name.ns` -> `name.ns.svc.<domain>`,
//! `name.ns.svc` -> `name.ns.svc.<domain>`), and the same after stripping
//! one of the pod's search domains (`<ns>.svc.<domain>`, `svc.<domain>`,
//! `<domain>`) that a stub resolver appended.

/// A name the mesh may know, tried in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The service hostname to look up (lower case, no trailing dot).
    pub hostname: String,
    /// The query name with a search domain stripped, when the candidate
    /// came from stripping one: the answer then carries a CNAME from the
    /// asked name to it.
    pub stripped: Option<String>,
}

/// The pod's search domains, most specific first.
pub fn search_domains(namespace: &str, domain: &str) -> [String; 3] {
    [
        format!("{namespace}.svc.{domain}"),
        format!("svc.{domain}"),
        domain.to_owned(),
    ]
}

/// The candidates for `name` (lower case, no trailing dot) asked by a pod
/// of `namespace`, in the cluster domain `domain`. No duplicates.
pub fn candidates(name: &str, namespace: &str, domain: &str) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut add = |hostname: String, stripped: Option<&str>| {
        if !hostname.is_empty() && !out.iter().any(|c| c.hostname == hostname) {
            out.push(Candidate {
                hostname,
                stripped: stripped.map(str::to_owned),
            });
        }
    };
    add(name.to_owned(), None);
    for fqdn in kube_fqdns(name, namespace, domain) {
        add(fqdn, None);
    }
    for search in search_domains(namespace, domain) {
        let Some(stripped) = name
            .strip_suffix(search.as_str())
            .and_then(|rest| rest.strip_suffix('.'))
        else {
            continue;
        };
        if stripped.is_empty() {
            continue;
        }
        add(stripped.to_owned(), Some(stripped));
        for fqdn in kube_fqdns(stripped, namespace, domain) {
            add(fqdn, Some(stripped));
        }
    }
    out
}

/// The Kubernetes names `name` can stand for, given how many labels it
/// has: a service's (`<svc>.<ns>.svc.<domain>`) and a pod's under its
/// subdomain (`<pod>.<subdomain>.<ns>.svc.<domain>`, a StatefulSet's), in
/// ztunnel's order (`dns/server.rs` `to_kube_fqdns`).
fn kube_fqdns(name: &str, namespace: &str, domain: &str) -> Vec<String> {
    let labels: Vec<&str> = name.split('.').collect();
    match labels.as_slice() {
        [_] => vec![format!("{name}.{namespace}.svc.{domain}")],
        // `<svc>.<ns>`, or `<pod>.<subdomain>` in the pod's namespace.
        [_, _] => vec![
            format!("{name}.svc.{domain}"),
            format!("{name}.{namespace}.svc.{domain}"),
        ],
        // `<svc>.<ns>.svc`, or `<pod>.<subdomain>.<ns>`.
        [_, _, "svc"] => vec![format!("{name}.{domain}"), format!("{name}.svc.{domain}")],
        [_, _, _] => vec![format!("{name}.svc.{domain}")],
        // `<pod>.<subdomain>.<ns>.svc`.
        [_, _, _, "svc"] => vec![format!("{name}.{domain}")],
        _ => Vec::new(),
    }
}

/// The names a service may be defined under to answer for `hostname`:
/// itself, then the wildcards above it, most specific first.
pub fn wildcards(hostname: &str) -> impl Iterator<Item = String> + '_ {
    // Each suffix of two labels or more, its first label a wildcard:
    // `www.example.com` -> `*.example.com`, `*.com` (ztunnel
    // `dns/server.rs` `get_wildcards`).
    std::iter::once(hostname.to_owned()).chain(
        hostname
            .match_indices('.')
            .map(move |(dot, _)| format!("*{}", &hostname[dot..])),
    )
}

/// A query name in the form hostnames are indexed by: lower case, without
/// the trailing dot.
pub fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(name: &str) -> Vec<(String, Option<String>)> {
        candidates(name, "shop", "cluster.local")
            .into_iter()
            .map(|c| (c.hostname, c.stripped))
            .collect()
    }

    #[test]
    fn a_name_matches_itself_then_each_wildcard_above_it() {
        let all: Vec<String> = wildcards("www.example.com").collect();
        assert_eq!(all, ["www.example.com", "*.example.com", "*.com"]);
        assert_eq!(wildcards("localhost").collect::<Vec<_>>(), ["localhost"]);
    }

    #[test]
    fn a_short_name_expands_to_the_pods_namespace() {
        assert_eq!(
            hosts("web"),
            [
                ("web".into(), None),
                ("web.shop.svc.cluster.local".into(), None)
            ]
        );
    }

    #[test]
    fn name_dot_namespace_and_name_namespace_svc_expand() {
        assert!(hosts("web.other").contains(&("web.other.svc.cluster.local".into(), None)));
        assert!(hosts("web.other.svc").contains(&("web.other.svc.cluster.local".into(), None)));
        // Four labels or more are taken as they are, but a pod's
        // `<pod>.<subdomain>.<ns>.svc`.
        assert_eq!(hosts("a.b.c.d"), [("a.b.c.d".into(), None)]);
        assert_eq!(hosts("a.b.c.d.e"), [("a.b.c.d.e".into(), None)]);
    }

    /// A StatefulSet pod's name under its headless service's subdomain
    /// (ztunnel `to_kube_fqdns`), after the service forms.
    #[test]
    fn a_pods_name_under_its_subdomain_expands() {
        assert_eq!(
            hosts("db-0.db"),
            [
                ("db-0.db".into(), None),
                ("db-0.db.svc.cluster.local".into(), None),
                ("db-0.db.shop.svc.cluster.local".into(), None),
            ]
        );
        assert_eq!(
            hosts("db-0.db.data"),
            [
                ("db-0.db.data".into(), None),
                ("db-0.db.data.svc.cluster.local".into(), None),
            ]
        );
        assert_eq!(
            hosts("db-0.db.data.svc"),
            [
                ("db-0.db.data.svc".into(), None),
                ("db-0.db.data.svc.cluster.local".into(), None),
            ]
        );
        // `<svc>.<ns>.svc` is a service first, then a pod of namespace
        // `svc`.
        assert_eq!(
            hosts("web.other.svc")[1..],
            [
                ("web.other.svc.cluster.local".into(), None),
                ("web.other.svc.svc.cluster.local".into(), None),
            ]
        );
    }

    #[test]
    fn an_appended_search_domain_is_stripped() {
        let got = hosts("web.other.svc.cluster.local.shop.svc.cluster.local");
        assert!(got.contains(&(
            "web.other.svc.cluster.local".into(),
            Some("web.other.svc.cluster.local".into())
        )));
        let got = hosts("web.svc.cluster.local");
        assert!(got.contains(&("web.shop.svc.cluster.local".into(), Some("web".into()))));
    }

    #[test]
    fn a_full_name_is_tried_first_and_nothing_repeats() {
        let got = hosts("web.shop.svc.cluster.local");
        assert_eq!(got[0], ("web.shop.svc.cluster.local".into(), None));
        let mut names: Vec<_> = got.iter().map(|(h, _)| h.clone()).collect();
        names.dedup();
        assert_eq!(names.len(), got.len());
    }

    #[test]
    fn names_are_normalized() {
        assert_eq!(
            normalize("Web.Shop.SVC.cluster.local."),
            "web.shop.svc.cluster.local"
        );
    }
}
