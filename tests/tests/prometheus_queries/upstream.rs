//! The TCP queries of Istio's Grafana dashboards and of Kiali's traffic
//! graph, copied verbatim, with the series each returns for the test's
//! traffic.
//!
//! Istio's: `manifests/addons/dashboards/istio-workload-dashboard.json`
//! and `istio-service-dashboard.json` (istio/istio, read at 86c9f01f),
//! TCP panels, with their template variables set as Grafana sets them for
//! the test's workloads. Kiali's: `graph/telemetry/istio/istio.go`
//! (`buildNamespaceTrafficMap`, "TCP Byte traffic"; kiali/kiali, read at
//! d733a096) with `graph/options.go`'s defaults (`ambientTraffic=total`,
//! so `util.GetApp` adds nothing and `util.GetReporter` matches
//! `waypoint|<reporter>`; a 10-minute graph; idle edges hidden, `> 0`)
//! and the TCP rate `total`, which queries both byte families (the
//! default, `sent`, queries `istio_tcp_received_bytes_total` alone: L4
//! telemetry is named from the server's side, istio/istio#32399).

use dataplane_tests::prometheus::{Series, series_of};

/// One dashboard query.
pub struct Query {
    /// Where it comes from: the file and the panel title (or function).
    pub from: String,
    /// The query as the dashboard sends it, variables substituted.
    pub expr: String,
    /// What its totals form (rates replaced by the counters, see
    /// [`totals`]) returns: exactly these series.
    pub want: Vec<Series>,
}

/// Bytes the test's traffic moves in all (see the test's constants):
/// through the `echo` service, and straight to the pod.
pub struct Carried {
    /// Client to server through the service (Istio's `received` bytes).
    pub service_request: u64,
    /// Server to client through the service (Istio's `sent` bytes).
    pub service_response: u64,
    /// Client to server on the direct connections.
    pub direct_request: u64,
    /// Server to client on the direct connections.
    pub direct_response: u64,
}

const SERVICE: &str = "echo.test.svc.cluster.local";

/// Grafana's `$__rate_interval` where Prometheus scrapes every 15 s (four
/// scrape intervals); the test's 1 s scrapes keep several samples in it.
const RATE_INTERVAL: &str = "1m";

/// `expr` with Grafana's variables replaced. Multi-value variables left
/// at "All" (`$srcwl`, `$srcns`, `$dstsvc`, `$dstwl`, `$dstns`) become
/// `.*`: Grafana sends the alternation of every value the variable's own
/// query lists, which here are exactly the values present, so the same
/// series match. `$qrep` keeps its default, `destination`.
fn grafana(expr: &str, vars: &[(&str, &str)]) -> String {
    let mut out = expr.replace("$__rate_interval", RATE_INTERVAL);
    for (name, value) in vars.iter().chain(&[
        ("qrep", "destination"),
        ("srcwl", ".*"),
        ("srcns", ".*"),
        ("dstsvc", ".*"),
        ("dstwl", ".*"),
        ("dstns", ".*"),
    ]) {
        out = out.replace(&format!("${name}"), value);
    }
    out
}

/// Go's `fmt.Sprintf` for the `%s` and `%v` verbs Kiali's queries use.
fn sprintf(format: &str, args: &[&str]) -> String {
    let mut out = String::new();
    let mut args = args.iter();
    let mut rest = format;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        out.push_str(args.next().copied().unwrap_or("%!(MISSING)"));
        rest = &rest[at + 2..];
    }
    out.push_str(rest);
    out
}

/// The totals form of a dashboard query: each `irate(X[range])` or
/// `rate(X [range])` becomes `X`, keeping the label matchers, the
/// aggregation and its grouping verbatim. A counter's value is exact where
/// a rate over a window is an estimate, so this form is what the test
/// compares values on.
pub fn totals(expr: &str) -> anyhow::Result<String> {
    let mut out = expr.to_owned();
    for function in ["irate(", "rate("] {
        while let Some(start) = out.find(function) {
            let open = out[start..]
                .find('[')
                .map(|i| start + i)
                .ok_or_else(|| anyhow::anyhow!("no range after {function} in {expr}"))?;
            let close = out[open..]
                .find("])")
                .map(|i| open + i)
                .ok_or_else(|| anyhow::anyhow!("no range end after {function} in {expr}"))?;
            let selector_end = out[..open].trim_end().len();
            out.replace_range(selector_end..close + 2, "");
            out.replace_range(start..start + function.len(), "");
        }
    }
    Ok(out)
}

fn src(value: f64) -> Vec<Series> {
    vec![series_of(
        &[
            ("source_workload", "client"),
            ("source_workload_namespace", "test"),
        ],
        value,
    )]
}

fn dst_workload(value: f64) -> Vec<Series> {
    vec![series_of(
        &[
            ("destination_workload", "remote"),
            ("destination_workload_namespace", "test"),
        ],
        value,
    )]
}

fn by_service(service: f64, direct: f64) -> Vec<Series> {
    vec![
        series_of(&[("destination_service", SERVICE)], service),
        series_of(&[("destination_service", "unknown")], direct),
    ]
}

/// The TCP panels of Istio's workload and service dashboards.
pub fn istio(c: &Carried) -> Vec<Query> {
    let (req, resp) = (
        (c.service_request + c.direct_request) as f64,
        (c.service_response + c.direct_response) as f64,
    );
    let (svc_req, svc_resp) = (c.service_request as f64, c.service_response as f64);
    let both = req + resp;
    let server = [("namespace", "test"), ("workload", "remote")];
    let client = [("namespace", "test"), ("workload", "client")];
    let service = [("service", SERVICE)];
    let q = |title: &str, expr: &str, vars: &[(&str, &str)], want: Vec<Series>| {
        let (board, panel) = title.split_once(": ").unwrap_or(("", title));
        Query {
            from: format!(
                "manifests/addons/dashboards/istio-{board}-dashboard.json, panel {panel:?}"
            ),
            expr: grafana(expr, vars),
            want,
        }
    };
    vec![
        q(
            "workload: TCP Server Traffic",
            r#"sum(irate(istio_tcp_sent_bytes_total{reporter=~"$qrep", destination_workload_namespace=~"$namespace", destination_workload=~"$workload"}[$__rate_interval])) + sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", destination_workload_namespace=~"$namespace", destination_workload=~"$workload"}[$__rate_interval]))"#,
            &server,
            vec![series_of(&[], both)],
        ),
        q(
            "workload: TCP Client Traffic",
            r#"sum(irate(istio_tcp_sent_bytes_total{reporter=~"$qrep", source_workload_namespace=~"$namespace", source_workload=~"$workload"}[$__rate_interval])) + sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", source_workload_namespace=~"$namespace", source_workload=~"$workload"}[$__rate_interval]))"#,
            &client,
            vec![series_of(&[], both)],
        ),
        q(
            "workload: Bytes Received from Incoming TCP Connection (mTLS)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", connection_security_policy="mutual_tls", destination_workload_namespace=~"$namespace", destination_workload=~"$workload", source_workload=~"$srcwl", source_workload_namespace=~"$srcns"}[$__rate_interval])) by (source_workload, source_workload_namespace), 0.001)"#,
            &server,
            src(req),
        ),
        q(
            "workload: Bytes Received from Incoming TCP Connection (plain)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", connection_security_policy!="mutual_tls", destination_workload_namespace=~"$namespace", destination_workload=~"$workload", source_workload=~"$srcwl", source_workload_namespace=~"$srcns"}[$__rate_interval])) by (source_workload, source_workload_namespace), 0.001)"#,
            &server,
            Vec::new(),
        ),
        q(
            "workload: Bytes Sent to Incoming TCP Connection (mTLS)",
            r#"round(sum(irate(istio_tcp_sent_bytes_total{connection_security_policy="mutual_tls", reporter=~"$qrep", destination_workload_namespace=~"$namespace", destination_workload=~"$workload", source_workload=~"$srcwl", source_workload_namespace=~"$srcns"}[$__rate_interval])) by (source_workload, source_workload_namespace), 0.001)"#,
            &server,
            src(resp),
        ),
        q(
            "workload: Bytes Sent on Outgoing TCP Connection (mTLS)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{connection_security_policy="mutual_tls", reporter="source", source_workload_namespace=~"$namespace", source_workload=~"$workload", destination_service=~"$dstsvc"}[$__rate_interval])) by (destination_service), 0.001)"#,
            &client,
            by_service(svc_req, c.direct_request as f64),
        ),
        q(
            "workload: Bytes Sent on Outgoing TCP Connection (plain)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{connection_security_policy!="mutual_tls", reporter="source", source_workload_namespace=~"$namespace", source_workload=~"$workload", destination_service=~"$dstsvc"}[$__rate_interval])) by (destination_service), 0.001)"#,
            &client,
            Vec::new(),
        ),
        q(
            "workload: Bytes Received from Outgoing TCP Connection (mTLS)",
            r#"round(sum(irate(istio_tcp_sent_bytes_total{reporter="source", connection_security_policy="mutual_tls", source_workload_namespace=~"$namespace", source_workload=~"$workload", destination_service=~"$dstsvc"}[$__rate_interval])) by (destination_service), 0.001)"#,
            &client,
            by_service(svc_resp, c.direct_response as f64),
        ),
        q(
            "service: TCP Received Bytes",
            r#"sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", destination_service="$service"}[$__rate_interval]))"#,
            &service,
            vec![series_of(&[], svc_req)],
        ),
        q(
            "service: TCP Sent Bytes",
            r#"sum(irate(istio_tcp_sent_bytes_total{reporter=~"$qrep", destination_service="$service"}[$__rate_interval]))"#,
            &service,
            vec![series_of(&[], svc_resp)],
        ),
        q(
            "service: Bytes Received from Incoming TCP Connection (mTLS, by source)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{reporter=~"$qrep", connection_security_policy="mutual_tls", destination_service="$service", source_workload=~"$srcwl", source_workload_namespace=~"$srcns"}[$__rate_interval])) by (source_workload, source_workload_namespace), 0.001)"#,
            &service,
            src(svc_req),
        ),
        q(
            "service: Bytes Sent to Incoming TCP Connection (mTLS, by source)",
            r#"round(sum(irate(istio_tcp_sent_bytes_total{connection_security_policy="mutual_tls", reporter=~"$qrep", destination_service="$service", source_workload=~"$srcwl", source_workload_namespace=~"$srcns"}[$__rate_interval])) by (source_workload, source_workload_namespace), 0.001)"#,
            &service,
            src(svc_resp),
        ),
        q(
            "service: Bytes Received from Incoming TCP Connection (mTLS, by destination)",
            r#"round(sum(irate(istio_tcp_received_bytes_total{reporter="destination", connection_security_policy="mutual_tls", destination_service="$service", destination_workload=~"$dstwl", destination_workload_namespace=~"$dstns"}[$__rate_interval])) by (destination_workload, destination_workload_namespace), 0.001)"#,
            &service,
            dst_workload(svc_req),
        ),
        q(
            "service: Bytes Sent to Incoming TCP Connection (plain, by destination)",
            r#"round(sum(irate(istio_tcp_sent_bytes_total{connection_security_policy!="mutual_tls", reporter="destination", destination_service="$service", destination_workload=~"$dstwl", destination_workload_namespace=~"$dstns"}[$__rate_interval])) by (destination_workload, destination_workload_namespace), 0.001)"#,
            &service,
            Vec::new(),
        ),
        q(
            "service: Bytes Sent to Incoming TCP Connection (mTLS, by destination)",
            r#"round(sum(irate(istio_tcp_sent_bytes_total{connection_security_policy="mutual_tls", reporter="destination", destination_service="$service", destination_workload=~"$dstwl", destination_workload_namespace=~"$dstns"}[$__rate_interval])) by (destination_workload, destination_workload_namespace), 0.001)"#,
            &service,
            dst_workload(svc_resp),
        ),
    ]
}

/// Kiali's graph of namespace `test`: for each byte family, its three
/// queries (`buildNamespaceTrafficMap`, "TCP Byte traffic"): 0) source
/// telemetry of traffic into the namespace's services from elsewhere that
/// no workload answered, 1) destination telemetry into the namespace's
/// workloads, 2) source telemetry out of the namespace's workloads. Each
/// edge of the graph is one series.
pub fn kiali(c: &Carried) -> Vec<Query> {
    // The Go format strings, verbatim (Kiali's raw strings: `\\.` reaches
    // PromQL as is).
    const UNSERVICED: &str = r#"sum(rate(%s{%s%s,source_workload_namespace!="%s",destination_workload_namespace="unknown",destination_workload="unknown",destination_service=~"^.+\\.%s\\..+$"} [%vs])) by (%s) %s"#;
    const INCOMING: &str =
        r#"sum(rate(%s{%s%s,destination_workload_namespace="%s"} [%vs])) by (%s) %s"#;
    const OUTGOING: &str = r#"sum(rate(%s{%s%s,source_workload_namespace="%s"} [%vs])) by (%s) %s"#;
    const GROUP_BY: &str = "app,source_cluster,source_workload_namespace,source_workload,source_canonical_service,source_canonical_revision,destination_cluster,destination_service_namespace,destination_service,destination_service_name,destination_workload_namespace,destination_workload,destination_canonical_service,destination_canonical_revision,response_flags";
    // `util.GetApp` with ambientTraffic=total, `util.GetReporter`, the
    // namespace, the duration in seconds, the idle condition.
    let (app, namespace, seconds, idle) = ("", "test", "600", "> 0");
    let source = r#"reporter=~"waypoint|source""#;
    let destination = r#"reporter=~"waypoint|destination""#;
    let edges = |service: f64, direct: f64| {
        let edge = |svc_ns: &str, svc: &str, svc_name: &str, value: f64| {
            series_of(
                &[
                    ("source_cluster", "unknown"),
                    ("source_workload_namespace", "test"),
                    ("source_workload", "client"),
                    ("source_canonical_service", "client"),
                    ("source_canonical_revision", "latest"),
                    ("destination_cluster", "unknown"),
                    ("destination_service_namespace", svc_ns),
                    ("destination_service", svc),
                    ("destination_service_name", svc_name),
                    ("destination_workload_namespace", "test"),
                    ("destination_workload", "remote"),
                    ("destination_canonical_service", "remote"),
                    ("destination_canonical_revision", "latest"),
                    ("response_flags", "-"),
                ],
                value,
            )
        };
        vec![
            edge("test", SERVICE, "echo", service),
            edge("unknown", "unknown", "unknown", direct),
        ]
    };
    let mut queries = Vec::new();
    for (metric, service, direct) in [
        (
            "istio_tcp_received_bytes_total",
            c.service_request,
            c.direct_request,
        ),
        (
            "istio_tcp_sent_bytes_total",
            c.service_response,
            c.direct_response,
        ),
    ] {
        let from = |n: &str| {
            format!(
                "kiali graph/telemetry/istio/istio.go, buildNamespaceTrafficMap, TCP query {n} on {metric}"
            )
        };
        queries.push(Query {
            from: from("0 (unserviced)"),
            expr: sprintf(
                UNSERVICED,
                &[
                    metric, app, source, namespace, namespace, seconds, GROUP_BY, idle,
                ],
            ),
            want: Vec::new(),
        });
        queries.push(Query {
            from: from("1 (incoming)"),
            expr: sprintf(
                INCOMING,
                &[metric, app, destination, namespace, seconds, GROUP_BY, idle],
            ),
            want: edges(service as f64, direct as f64),
        });
        queries.push(Query {
            from: from("2 (outgoing)"),
            expr: sprintf(
                OUTGOING,
                &[metric, app, source, namespace, seconds, GROUP_BY, idle],
            ),
            want: edges(service as f64, direct as f64),
        });
    }
    queries
}

#[test]
fn totals_drop_only_the_rate() -> anyhow::Result<()> {
    assert_eq!(
        totals(
            r#"round(sum(irate(a{b="c"}[1m])) by (d), 0.001) + sum(rate(e{f=~"g"} [600s])) > 0"#
        )?,
        r#"round(sum(a{b="c"}) by (d), 0.001) + sum(e{f=~"g"}) > 0"#
    );
    Ok(())
}

#[test]
fn sprintf_fills_in_order() {
    assert_eq!(sprintf("%s{%s} [%vs]", &["m", "l", "60"]), "m{l} [60s]");
}
