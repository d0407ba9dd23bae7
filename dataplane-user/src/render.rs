//! Text output of the operator commands (`dataplane status`, `certs`).
//! Colour is for terminals only: callers pass [`colour_wanted`], which is
//! false when stdout is not a TTY or `NO_COLOR` is set.

use std::{fmt::Write as _, io::IsTerminal};

use crate::inspect::{CertInfo, StatusReport};

/// Whether to colour output written to stdout.
pub fn colour_wanted() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

#[derive(Clone, Copy)]
struct Paint(bool);

impl Paint {
    fn wrap(self, code: &str, text: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn good(self, text: &str) -> String {
        self.wrap("32", text)
    }

    fn bad(self, text: &str) -> String {
        self.wrap("31", text)
    }

    fn bold(self, text: &str) -> String {
        self.wrap("1", text)
    }
}

fn age(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// The `status` screen.
pub fn status(report: &StatusReport, colour: bool) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    status_at(report, colour, now)
}

/// The `status` screen as of `now` (seconds since the Unix epoch).
fn status_at(report: &StatusReport, colour: bool, now: u64) -> String {
    let p = Paint(colour);
    let mut out = String::new();
    let state = if report.ready {
        p.good("ready")
    } else {
        p.bad(&format!(
            "not ready (waiting for {})",
            report.pending.join(", ")
        ))
    };
    let _ = writeln!(
        out,
        "{} {} · version {} · up {} · {state}",
        p.bold("agent"),
        report.instance,
        report.version,
        age(report.uptime_secs)
    );
    let failure = if report.fail_open {
        "fail-open"
    } else {
        "fail-closed"
    };
    let _ = writeln!(out, "capture   {} ({failure})", report.capture);
    let endpoint = |addr: Option<std::net::SocketAddr>| {
        addr.map_or_else(|| p.bad("not serving"), |a| a.to_string())
    };
    let _ = writeln!(
        out,
        "serving   readiness {} · metrics {} · admin {}",
        endpoint(report.endpoints.readiness),
        endpoint(report.endpoints.metrics),
        endpoint(report.endpoints.admin)
    );
    match &report.cgroup {
        Some(cgroup) => {
            let _ = writeln!(out, "programs  attached to {cgroup}");
        }
        None => {
            let _ = writeln!(out, "programs  none (iptables capture)");
        }
    }
    for program in &report.programs {
        let mark = if program.attached {
            p.good("attached")
        } else {
            p.bad("NOT ATTACHED")
        };
        let link = program.link.as_deref().unwrap_or("-");
        let _ = writeln!(out, "  {:18} {mark} ({link})", program.program);
    }
    let captured = report.pods.iter().filter(|p| p.captured).count();
    let _ = writeln!(
        out,
        "pods      {} listed, {captured} captured",
        report.pods.len()
    );
    for pod in &report.pods {
        let mark = if pod.captured {
            p.good("captured")
        } else {
            p.bad("not captured")
        };
        let _ = writeln!(
            out,
            "  {:40} {mark}: {}",
            format!("{}/{}", pod.namespace, pod.name),
            pod.reason
        );
        if pod.unknown_to_control_plane {
            let _ = writeln!(
                out,
                "    {}",
                p.bad("unknown to the control plane: its connections are refused")
            );
        }
        if let Some(on) = pod.original_source {
            let state = match (on, &pod.original_source_error) {
                (true, _) => p.good("on"),
                (false, Some(err)) => format!("{} ({err})", p.bad("off")),
                (false, None) => "off".to_owned(),
            };
            let _ = writeln!(out, "    original source: {state}");
        }
        if let Some(on) = pod.dns_capture {
            let _ = writeln!(out, "    dns capture: {}", if on { "on" } else { "off" });
        }
        if let Some(on) = pod.fast_path {
            let _ = writeln!(out, "    fast path: {}", if on { "on" } else { "off" });
        }
        if let Some(worker) = pod.worker {
            let _ = writeln!(out, "    worker: {worker}");
        }
        if let Some(words) = &pod.not_captured {
            let _ = writeln!(out, "    not captured: {words}");
        }
    }
    let _ = writeln!(out, "conns     {} open", report.connections_open);
    match &report.config_error {
        Some(err) => {
            let _ = writeln!(
                out,
                "config    {} ({}): {err}",
                report.config_origin,
                p.bad("last file rejected, previous one in force")
            );
        }
        None => {
            let _ = writeln!(out, "config    {}", report.config_origin);
        }
    }
    if let Some(certs) = &report.certificates {
        cert_source(&mut out, certs, p);
    }
    if let Some(xds) = &report.xds {
        let state = match &xds.connected_since {
            Some(since) => p.good(&format!("connected since {since}")),
            None => p.bad(&format!(
                "not connected ({}); serving the last state received",
                xds.last_error.as_deref().unwrap_or("connecting")
            )),
        };
        let _ = writeln!(
            out,
            "istiod    {} {state} · {} stream(s)",
            xds.address, xds.streams
        );
        for t in &xds.types {
            let kind = t.type_url.rsplit('/').next().unwrap_or(&t.type_url);
            let ack = t.last_ack.as_deref().unwrap_or("never");
            let _ = writeln!(out, "  {kind:32} {} held · last ACK {ack}", t.held);
            if let (Some(at), Some(why)) = (&t.last_nack, &t.last_nack_reason) {
                let _ = writeln!(out, "  {:32} {} {at}: {why}", "", p.bad("last NACK"));
            }
        }
    }
    if let Some(a) = &report.redirection_annotations {
        let state = match &a.last_error {
            None if a.pending == 0 => p.good(&format!("{} pod(s) annotated", a.written)),
            _ => p.bad(&format!(
                "{} pod(s) not yet annotated ({}); istiod treats them as uncaptured",
                a.pending,
                a.last_error.as_deref().unwrap_or("on its way")
            )),
        };
        let _ = writeln!(out, "istiod    ambient.istio.io/redirection: {state}");
    }
    let errors = if report.errors_last_minute == 0 {
        p.good("none")
    } else {
        p.bad(&report.errors_last_minute.to_string())
    };
    let _ = writeln!(out, "errors    {errors} in the last minute");
    for e in &report.recent_errors {
        let ago = age(now.saturating_sub(e.at));
        let _ = writeln!(
            out,
            "  {ago:>4} ago {} {}: {}",
            e.level, e.target, e.message
        );
    }
    out
}

/// The certificate source's lines of `status`.
fn cert_source(out: &mut String, certs: &crate::identity::CertSourceStatus, p: Paint) {
    let _ = writeln!(
        out,
        "certs     {} ({}): {} of {} held, {} issued, {} failed",
        certs.source,
        certs.description,
        certs.held,
        certs.wanted,
        certs.successes,
        if certs.failures == 0 {
            "0".to_owned()
        } else {
            p.bad(&certs.failures.to_string())
        },
    );
    let fields = [
        ("last issued", &certs.last_issued),
        ("next refresh", &certs.next_refresh),
        ("last failure", &certs.last_failure),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            let _ = writeln!(out, "  {name:13} {value}");
        }
    }
    for root in &certs.roots {
        let state = match &root.retiring_at {
            Some(at) => format!("retiring, trusted until {at}"),
            None => "current".to_owned(),
        };
        let _ = writeln!(out, "  root          {} ({state})", root.subject);
    }
}

/// The `certs` table.
pub fn certs(certs: &[CertInfo], colour: bool) -> String {
    let p = Paint(colour);
    if certs.is_empty() {
        return "no workload certificates held\n".to_owned();
    }
    let mut out = format!(
        "{:50} {:22} {:10} {:8} ISSUER / SERIAL\n",
        "IDENTITY", "EXPIRES (UTC)", "IN", "SOURCE"
    );
    for cert in certs {
        let left = if cert.expires_in_secs <= 0 {
            p.bad("expired")
        } else {
            age(cert.expires_in_secs.unsigned_abs())
        };
        let _ = writeln!(
            out,
            "{:50} {:22} {:10} {:8} {} / {}",
            cert.identity, cert.not_after, left, cert.source, cert.issuer, cert.serial
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inspect::{PodCaptureState, ProgramStatus};

    fn report() -> StatusReport {
        StatusReport {
            pid: 4242,
            instance: "node1".into(),
            version: "0.1.0".into(),
            uptime_secs: 75,
            ready: true,
            pending: vec![],
            capture: "ebpf".into(),
            fail_open: false,
            endpoints: Default::default(),
            cgroup: Some("/sys/fs/cgroup".into()),
            programs: vec![ProgramStatus {
                program: "dp_connect4".into(),
                link: Some("cgroup_connect4_dp_connect4".into()),
                attached: true,
            }],
            pods: vec![PodCaptureState {
                uid: "u1".into(),
                name: "web".into(),
                namespace: "shop".into(),
                captured: false,
                reason: "unenrolled on request".into(),
                dns_capture: None,
                original_source: None,
                original_source_error: None,
                fast_path: None,
                worker: None,
                not_captured: None,
                unknown_to_control_plane: false,
            }],
            connections_open: 3,
            config_origin: "/etc/mesh.yaml".into(),
            config_error: None,
            errors_last_minute: 0,
            recent_errors: vec![],
            certificates: None,
            xds: None,
            redirection_annotations: None,
        }
    }

    #[test]
    fn recent_errors_show_how_long_ago() {
        let mut report = report();
        let now = 1_800_000_000;
        report.errors_last_minute = 1;
        report.recent_errors = vec![crate::logging::RecentError {
            at: now - 5,
            level: "WARN".into(),
            target: "access".into(),
            message: "connection refused reason=\"denied\"".into(),
        }];
        let text = status_at(&report, false, now);
        assert!(text.contains("1 in the last minute"), "{text}");
        assert!(
            text.contains("5s ago WARN access: connection refused"),
            "{text}"
        );
    }

    #[test]
    fn plain_output_has_no_escape_codes_and_names_the_reason() {
        let text = status(&report(), false);
        assert!(!text.contains('\x1b'), "{text}");
        assert!(
            text.contains("shop/web") && text.contains("not captured: unenrolled on request"),
            "{text}"
        );
        assert!(text.contains("3 open"), "{text}");
        assert!(!report().healthy());
    }

    #[test]
    fn colour_output_marks_states() {
        let text = status(&report(), true);
        assert!(text.contains("\x1b[31mnot captured\x1b[0m"), "{text}");
        assert!(text.contains("\x1b[32mready\x1b[0m"), "{text}");
    }
}
