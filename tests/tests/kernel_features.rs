//! What the agent needs from the kernel, probed on the kernel the tests run
//! on (the host's, and each kernel of `cargo xtask vm-test`): every required
//! feature is found, the fallbacks match the kernel's release, a feature the
//! kernel lacks stops the agent with a message naming it, and the
//! namespace-cookie fallback gives the kernel's own cookies.
//!
//! The fallbacks are asserted on log text: the README promises the agent
//! says so in its log, and nothing else reports them.

use std::{os::fd::AsFd, os::unix::net::UnixDatagram, process::Command, time::Duration};

use dataplane_tests::{
    Agent, BpffsDir, Cgroup, Netns, TempDir, agent_binary, spawn_in, topology::Node,
};
use dataplane_user::{
    features::{self, Fallback},
    preflight::parse_release,
};

/// Exit code the agent documents for "the host lacks something".
const EXIT_ENVIRONMENT: i32 = 3;
const LIMIT: Duration = Duration::from_secs(30);

/// The running kernel's `(major, minor)`: the oracle the probes are
/// checked against.
fn kernel_version() -> (u32, u32) {
    parse_release(&features::kernel_release()).expect("a kernel release")
}

#[test]
fn every_required_feature_is_present_and_fallbacks_match_the_release() {
    let support = features::probe();
    let missing: Vec<String> = support.missing.iter().map(|r| r.message()).collect();
    assert!(missing.is_empty(), "{}: {missing:?}", support.release);
    assert!(
        support.undecided.is_empty(),
        "{}: {:?}",
        support.release,
        support.undecided
    );
    let version = kernel_version();
    assert_eq!(
        support.fallbacks.contains(&Fallback::RaiseMemlock),
        version < (5, 11),
        "memcg accounting of BPF memory is in 5.11: {support:?}"
    );
    assert_eq!(
        support.fallbacks.contains(&Fallback::NetnsCookieByProgram),
        version < (5, 14),
        "SO_NETNS_COOKIE is in 5.14: {support:?}"
    );
    assert_eq!(
        support.fallbacks.contains(&Fallback::OrigDstByTuple),
        version < (5, 15),
        "bpf_get_netns_cookie in cgroup/getsockopt programs is in 5.15: {support:?}"
    );
}

#[test]
fn a_feature_no_kernel_has_is_reported_missing() {
    assert_eq!(features::is_supported(features::NEVER_SUPPORTED), Ok(false));
}

#[test]
fn the_agent_refuses_a_kernel_without_a_feature_with_the_precise_message() -> anyhow::Result<()> {
    let bpffs = BpffsDir::new("kfmiss")?;
    let cgroup = Cgroup::new("kfmiss")?;
    let state = TempDir::new("kfmiss")?;
    let mut cmd = Command::new(agent_binary()?);
    cmd.arg("run")
        .arg("--instance")
        .arg("kfmiss")
        .arg("--bpffs")
        .arg(bpffs.path())
        .arg("--cgroup")
        .arg(cgroup.path())
        .arg("--state-dir")
        .arg(state.path())
        .arg("--on-exit")
        .arg("detach")
        .env(features::TEST_UNSUPPORTED_ENV, "sk-lookup");
    let out = spawn_in(cmd, None, None)?.wait(LIMIT)?;
    let stderr = out.stderr;
    assert_eq!(out.code, Some(EXIT_ENVIRONMENT), "{stderr}");
    assert!(
        stderr.contains("needs sk_lookup programs: kernel >= 5.9"),
        "{stderr}"
    );
    assert!(!stderr.contains("verifier"), "{stderr}");
    let left: Vec<_> = std::fs::read_dir(bpffs.path())?.collect();
    assert!(left.is_empty(), "pinned before refusing: {left:?}");
    Ok(())
}

/// A socket created inside `netns` (it stays there).
fn socket_in(netns: &Netns) -> anyhow::Result<UnixDatagram> {
    Ok(netns.run(|| UnixDatagram::pair().map(|(a, _)| a))??)
}

#[test]
fn netns_cookies_from_the_probe_program_are_the_kernels() -> anyhow::Result<()> {
    let a = Netns::new("kfcka")?;
    let b = Netns::new("kfckb")?;
    let in_a = socket_in(&a)?;
    let in_b = socket_in(&b)?;
    let a1 = features::netns_cookie_by_program(in_a.as_fd())?;
    let a2 = features::netns_cookie_by_program(socket_in(&a)?.as_fd())?;
    let b1 = features::netns_cookie_by_program(in_b.as_fd())?;
    assert_eq!(a1, a2, "one namespace, one cookie");
    assert_ne!(a1, b1, "two namespaces, two cookies");
    // Where the kernel also answers SO_NETNS_COOKIE, both must agree.
    if features::has_so_netns_cookie() {
        assert_eq!(a1, a.cookie()?);
        assert_eq!(b1, b.cookie()?);
    }
    Ok(())
}

#[test]
fn the_agent_logs_the_fallbacks_it_uses() -> anyhow::Result<()> {
    let node = Node::new("kflog", 1)?;
    let agent = Agent::start("kflog", &node, &[])?;
    let log = agent.log_text();
    let version = kernel_version();
    assert_eq!(
        log.contains("no SO_NETNS_COOKIE (kernel >= 5.14)"),
        version < (5, 14),
        "{log}"
    );
    assert_eq!(
        log.contains("raising RLIMIT_MEMLOCK to unlimited"),
        version < (5, 11),
        "{log}"
    );
    assert_eq!(
        log.contains("keyed by connection tuple alone"),
        version < (5, 15),
        "{log}"
    );
    // The getsockopt program attached (the attach line lists them) is the
    // one the kernel can run.
    assert_eq!(log.contains("dp_gsopt_tuple"), version < (5, 15), "{log}");
    Ok(())
}
