//! istiod's certificate checked against the system's roots
//! (`--istiod-root-cert SYSTEM`).

use super::*;

/// `--istiod-root-cert SYSTEM` (ztunnel's `XDS_ROOT_CA=SYSTEM`,
/// `src/config.rs`; `src/tls/control.rs` `RootCert::Default`): istiod's
/// certificate is checked against the system's roots, here the file
/// `SSL_CERT_FILE` names. An agent whose system roots hold istiod's root
/// takes its mesh; one whose hold another root is refused by TLS and
/// says so in its dump; an empty store stops the agent at start-up.
#[test]
fn istiods_certificate_may_be_checked_against_the_systems_roots() -> Result<()> {
    let world = World::new("xdssys")?;
    world.publish_mesh("v1")?;
    let stranger = TestPki::generate()?;
    let stranger_root = world.w.dir.path().join("stranger-root.pem");
    std::fs::write(&stranger_root, &stranger.root_pem)?;
    let no_dir = world.w.dir.path().join("no-system-certs");
    std::fs::create_dir(&no_dir)?;
    let no_dir = no_dir.display().to_string();
    let (empty, ca) = (world.empty.display().to_string(), world.w.shared_ca());
    let ca = ca.display().to_string();
    let start = |tag: &str, n: u8, system_roots: &std::path::Path| -> Result<Agent> {
        let node = if n == 1 { &world.w.n1 } else { &world.w.n2 };
        let pod = format!("dataplane-node{n}");
        let system = std::path::Path::new("SYSTEM");
        let mut flags = xds_flags(world.istiod()?.addr, system, &world.token, &pod);
        let node_name = format!("node{n}");
        flags
            .extend(["--config", &empty, "--node", &node_name, "--ca-dir", &ca].map(str::to_owned));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let roots = system_roots.display().to_string();
        // The system's store is these files alone: no directory the
        // test's own environment may name (`SSL_CERT_DIR`).
        Agent::start_with_env(
            tag,
            node,
            &flags,
            &[("SSL_CERT_FILE", &roots), ("SSL_CERT_DIR", &no_dir)],
        )
    };

    let trusting = start("xsys1", 1, &world.root)?;
    wait_until("the agent trusting istiod's root to hold its state", || {
        Ok(workload_names(&config_dump(&trusting)?).contains(&"remote".to_owned()))
    })?;
    let distrusting = start("xsys2", 2, &stranger_root)?;
    let mut refused = String::new();
    wait_until("the agent trusting another root to be refused", || {
        let dump = config_dump(&distrusting)?;
        refused = dump["xds"]["lastError"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Ok(!refused.is_empty())
    })?;
    assert!(refused.contains("certificate"), "{refused}");
    let dump = config_dump(&distrusting)?;
    assert!(dump["xds"]["connectedSince"].is_null(), "{}", dump["xds"]);
    assert!(
        workload_names(&dump).is_empty(),
        "{:?}",
        workload_names(&dump)
    );

    // A system store with no root at all stops the agent at start-up,
    // saying so, rather than running with nothing to trust.
    let no_roots = world.w.dir.path().join("no-roots.pem");
    std::fs::write(&no_roots, "")?;
    let refused = match start("xsys3", 1, &no_roots) {
        Ok(_) => anyhow::bail!("an agent started with an empty system root store"),
        Err(err) => format!("{err:#}"),
    };
    assert!(
        refused.contains("exited during start-up") && refused.contains("holds no usable root"),
        "{refused}"
    );
    Ok(())
}
