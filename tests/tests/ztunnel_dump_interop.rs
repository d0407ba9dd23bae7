//! A stock Istio ztunnel and our agent fed the same xDS state by the test
//! istiod ([`KnownMesh`]) dump it alike: ztunnel's `/config_dump` and our
//! admin `/config_dump` carry the same `workloads`, `services`,
//! `policies` and `certificates`, field by field, in any order.
//!
//! Ignored unless asked for, as `ztunnel_interop` is: build ztunnel from
//! Istio's sources (`--no-default-features --features tls-ring`) and run
//! `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test ztunnel_dump_interop -- --ignored`.
//! `ztunnel_dump` checks our side against ztunnel's code on every run.
//!
//! What legitimately differs, and is left out of the comparison
//! (`NOT_CARRIED` in `dataplane-user/src/inspect/ztunnel_dump.rs`):
//! - `workloads[].workloadType`: ztunnel writes istiod's enum
//!   (`deployment` here), our model does not keep it;
//! - `certificates[].certChain[]` and `rootCerts[]` values: two holders
//!   of one identity get two certificates (serial, validity, PEM differ);
//!   compared are identity, state, how many certificates each list holds,
//!   and the roots (the same istiod CA), and every value's form;
//! - ztunnel's other top-level keys (`config`, `version`, `staticConfig`,
//!   `stagedServices`, ...) and `workloadState`: ztunnel is fed no pods
//!   (no ZDS), our agent enrolls one.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use dataplane_tests::{
    Cgroup, TempDir,
    known_mesh::{KnownMesh, holds_known_state},
    traffic::wait_until,
    ztunnel::{self, Ztunnel, ZtunnelHome, ZtunnelNode, ztunnel_binary},
};
use serde_json::Value;

/// The fields of `section`'s entries that legitimately differ (see the
/// module documentation).
fn ignored(section: &str) -> &'static [&'static str] {
    match section {
        "workloads" => &["workloadType"],
        _ => &[],
    }
}

/// `section`'s entries, keyed as ztunnel keys them, without the ignored
/// fields: order is not compared.
fn entries(dump: &Value, section: &str) -> Result<Vec<(String, Value)>> {
    let list = dump[section]
        .as_array()
        .with_context(|| format!("no {section}"))?;
    let mut entries: Vec<(String, Value)> = list
        .iter()
        .map(|entry| {
            let key = match section {
                "workloads" => entry["uid"].to_string(),
                "services" => format!("{}/{}", entry["namespace"], entry["hostname"]),
                _ => format!("{}/{}", entry["namespace"], entry["name"]),
            };
            let mut entry = entry.clone();
            if let Some(object) = entry.as_object_mut() {
                for field in ignored(section) {
                    object.remove(*field);
                }
            }
            (key, entry)
        })
        .collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(entries)
}

/// The certificate of `identity` in `dump`.
fn certificate<'a>(dump: &'a Value, identity: &str) -> Result<&'a Value> {
    dump["certificates"]
        .as_array()
        .and_then(|list| list.iter().find(|c| c["identity"] == identity))
        .with_context(|| format!("no certificate for {identity}: {}", dump["certificates"]))
}

/// Every certificate of `list` in ztunnel's form: base64 PEM, a decimal
/// serial, whole-second RFC 3339 times.
fn well_formed(list: &Value) -> Result<()> {
    for cert in list.as_array().context("a certificate list")? {
        let pem = dataplane_tests::known_mesh::base64_decode(cert["pem"].as_str().context("pem")?)?;
        ensure!(pem.starts_with(b"-----BEGIN CERTIFICATE-----\n"), "{cert}");
        let serial = cert["serialNumber"].as_str().context("serialNumber")?;
        ensure!(serial.chars().all(|c| c.is_ascii_digit()), "{cert}");
        for key in ["validFrom", "expirationTime"] {
            let at = cert[key].as_str().context("time")?;
            ensure!(at.len() == 20 && at.ends_with('Z'), "{key}: {cert}");
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn stock_ztunnel_and_the_agent_dump_the_same_state_alike() -> Result<()> {
    let binary = ztunnel_binary()?;
    let mut world = KnownMesh::start("zdio")?;
    // Both take certificates from istiod's CA.
    let agent = world.agent("zq", &["--cert-source", "istio"])?;
    let ours = world.full_dump(&agent)?;
    let w = &world.w;

    // ztunnel in node2's namespace (node1's admin port is free either
    // way, but apart is simpler), named node1: it fetches ahead the
    // certificates of node1's HBONE workloads (`cert_fetcher.rs`,
    // `should_prefetch_certificate`), i.e. the client's, as our agent does
    // for the enrolled client. No pods are fed to it (nobody serves ZDS).
    let logs = TempDir::new("zdlog")?;
    let istiod = world.rt.block_on(world.istiod.listen_in(w.n2.netns()))?;
    let home = ZtunnelHome::new(logs.path(), "node1", istiod, &world.pki.root_pem)?;
    let zds = logs.path().join("nobody.sock");
    let site = ZtunnelNode {
        name: "node1",
        instance_ip: w.n2.bridge_ip4().into(),
        zds: &zds,
    };
    let cgroup = Cgroup::child(w.n2.cgroup(), "zt")?;
    let log = logs.path().join("ztunnel.log");
    let zt = Ztunnel::start(&binary, w.n2.netns(), cgroup, &site, &home, &log)?;
    let mut theirs = Value::Null;
    wait_until(
        "ztunnel's dump to hold istiod's state and a certificate",
        || {
            // Refused until its admin port is up.
            let Ok(body) = ztunnel::http_get(
                w.n2.netns(),
                ztunnel::ADMIN_PORT,
                "/config_dump",
                Duration::from_secs(10),
            ) else {
                return Ok(false);
            };
            theirs = serde_json::from_str(&body)?;
            Ok(holds_known_state(&theirs))
        },
    )
    .with_context(|| format!("ztunnel log:\n{}", zt.log_tail()))?;

    for section in ["workloads", "services", "policies"] {
        let (a, b) = (entries(&ours, section)?, entries(&theirs, section)?);
        ensure!(
            a.len() == b.len(),
            "{section}: ours {a:#?}\nztunnel's {b:#?}"
        );
        for ((key_a, a), (key_b, b)) in a.iter().zip(&b) {
            assert_eq!(key_a, key_b, "{section}");
            assert_eq!(a, b, "{section} {key_a}: ours (left), ztunnel's (right)");
        }
    }
    let identity = "spiffe://cluster.local/ns/test/sa/default";
    let (a, b) = (
        certificate(&ours, identity)?,
        certificate(&theirs, identity)?,
    );
    assert_eq!(a["state"], b["state"]);
    for list in ["certChain", "rootCerts"] {
        assert_eq!(
            a[list].as_array().map(Vec::len),
            b[list].as_array().map(Vec::len),
            "{list}: ours {a}\nztunnel's {b}"
        );
        well_formed(&a[list])?;
        well_formed(&b[list])?;
    }
    assert_eq!(a["rootCerts"], b["rootCerts"], "the same istiod root");
    Ok(())
}
