//! The `dataplane` binary as an operator meets it: it refuses to start on a
//! host that lacks what it needs with a message naming the fix, and on
//! SIGTERM it keeps or removes its kernel state exactly as `--on-exit` says;
//! a restarted agent adopts the pinned state only if its maps are defined
//! exactly as the new object's.

use std::{
    ffi::CString,
    os::unix::process::CommandExt,
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use aya::maps::MapData;
use dataplane_common::maps;
use dataplane_tests::{BpffsDir, Cgroup, ChildGuard, TempDir, agent_binary, spawn_in};
use dataplane_user::{preflight::mount_points, redirect::PinLayout};
use nix::sys::signal::Signal;

const LIMIT: Duration = Duration::from_secs(30);
/// Exit code the agent documents for "the host lacks something".
const EXIT_ENVIRONMENT: i32 = 3;

fn agent() -> anyhow::Result<Command> {
    Ok(Command::new(agent_binary()?))
}

/// Runs the agent to completion (it is expected to fail fast).
fn run_to_exit(cmd: Command) -> anyhow::Result<(Option<i32>, String)> {
    let out = spawn_in(cmd, None, None)?.wait(LIMIT)?;
    Ok((out.code, out.stderr))
}

/// Makes the child see a private copy of the mount table in which every
/// mount at `targets` is detached, so the agent meets a host without them
/// while the real host keeps them.
fn without_mounts(cmd: &mut Command, targets: Vec<PathBuf>) -> anyhow::Result<()> {
    let targets: Vec<CString> = targets
        .iter()
        .map(|p| CString::new(p.as_os_str().as_encoded_bytes()))
        .collect::<Result<_, _>>()?;
    let root = CString::new("/")?;
    // SAFETY: unshare/mount/umount2 are plain system calls on memory
    // allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let flags = libc::MS_REC | libc::MS_PRIVATE;
            if libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                flags,
                std::ptr::null(),
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            for target in &targets {
                // Stacked mounts: peel until nothing is left (bounded).
                for _ in 0..8 {
                    if libc::umount2(target.as_ptr(), libc::MNT_DETACH) != 0 {
                        break;
                    }
                }
            }
            Ok(())
        });
    }
    Ok(())
}

#[test]
fn refuses_to_run_without_capabilities() -> anyhow::Result<()> {
    let mut cmd = agent()?;
    cmd.arg("run");
    // Dropping to an unprivileged user clears every capability (std also
    // drops supplementary groups when a root parent sets the uid).
    cmd.uid(65534).gid(65534);
    let (code, stderr) = run_to_exit(cmd)?;
    assert_eq!(code, Some(EXIT_ENVIRONMENT), "{stderr}");
    assert!(stderr.contains("missing capabilities"), "{stderr}");
    for cap in ["CAP_BPF", "CAP_NET_ADMIN", "CAP_SYS_ADMIN"] {
        assert!(stderr.contains(cap), "{cap} not named: {stderr}");
    }
    assert!(stderr.contains("run as root, or grant them"), "{stderr}");
    Ok(())
}

#[test]
fn refuses_to_run_without_bpffs() -> anyhow::Result<()> {
    let mut cmd = agent()?;
    cmd.arg("run");
    without_mounts(&mut cmd, mount_points("bpf"))?;
    let (code, stderr) = run_to_exit(cmd)?;
    assert_eq!(code, Some(EXIT_ENVIRONMENT), "{stderr}");
    assert!(
        stderr.contains("/sys/fs/bpf is not on a bpf filesystem"),
        "{stderr}"
    );
    assert!(stderr.contains("mount -t bpf bpf /sys/fs/bpf"), "{stderr}");
    Ok(())
}

#[test]
fn refuses_to_run_on_cgroup_v1_only() -> anyhow::Result<()> {
    let mut cmd = agent()?;
    cmd.arg("run");
    without_mounts(&mut cmd, mount_points("cgroup2"))?;
    let (code, stderr) = run_to_exit(cmd)?;
    assert_eq!(code, Some(EXIT_ENVIRONMENT), "{stderr}");
    assert!(
        stderr.contains("no cgroup v2 hierarchy is mounted"),
        "{stderr}"
    );
    assert!(stderr.contains("mount -t cgroup2"), "{stderr}");
    Ok(())
}

#[test]
fn refuses_a_cgroup_that_is_not_cgroup_v2() -> anyhow::Result<()> {
    let dir = std::env::temp_dir();
    let mut cmd = agent()?;
    cmd.arg("run").arg("--cgroup").arg(&dir);
    let (code, stderr) = run_to_exit(cmd)?;
    assert_eq!(code, Some(EXIT_ENVIRONMENT), "{stderr}");
    assert!(stderr.contains("is not a cgroup v2 directory"), "{stderr}");
    Ok(())
}

#[test]
fn rejects_a_bad_config_file_with_its_position() -> anyhow::Result<()> {
    let dir = BpffsDir::new("cfg")?; // only for a unique name
    let file = std::env::temp_dir().join(
        dir.path()
            .file_name()
            .ok_or_else(|| anyhow::anyhow!("no name"))?,
    );
    std::fs::write(
        &file,
        "workloads:\n- uid: a\n  name: b\n  namespace: c\n  servceAccount: typo\n",
    )?;
    let mut cmd = agent()?;
    cmd.arg("run").arg("--config").arg(&file);
    let result = run_to_exit(cmd);
    let _ = std::fs::remove_file(&file);
    let (code, stderr) = result?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("servceAccount"), "{stderr}");
    assert!(stderr.contains("line 5"), "{stderr}");
    Ok(())
}

/// A running agent attached to a test cgroup with its pins in a test bpffs
/// directory and its state (control socket, CA) in a test directory: tests
/// running at once must not share the default state directory.
fn start_agent(
    cgroup: &Cgroup,
    bpffs: &BpffsDir,
    state: &TempDir,
    on_exit: &str,
) -> anyhow::Result<ChildGuard> {
    let mut cmd = agent()?;
    cmd.arg("run")
        .arg("--instance")
        .arg("life")
        .arg("--state-dir")
        .arg(state.path())
        .arg("--bpffs")
        .arg(bpffs.path())
        .arg("--cgroup")
        .arg(cgroup.path())
        .arg("--on-exit")
        .arg(on_exit);
    spawn_in(cmd, None, None)
}

fn link_pins(pins: &PinLayout) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(pins.links_dir())
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The link pins of an attached agent with no pod enrolled: one per cgroup
/// program, sorted. The getsockopt program is the one the kernel can run
/// (see [`cgroup_link_pins`]).
const CGROUP_LINK_PINS: [&str; 10] = [
    "cgroup_connect4_dp_connect4",
    "cgroup_connect6_dp_connect6",
    "cgroup_getpeername4_dp_getpeername4",
    "cgroup_getpeername6_dp_getpeername6",
    GETSOCKOPT_LINK_PIN,
    "cgroup_recvmsg4_dp_dns_recvmsg4",
    "cgroup_recvmsg6_dp_dns_recvmsg6",
    "cgroup_sendmsg4_dp_dns_sendmsg4",
    "cgroup_sendmsg6_dp_dns_sendmsg6",
    "cgroup_sockops_dp_sockops",
];

const GETSOCKOPT_LINK_PIN: &str = "cgroup_getsockopt_dp_getsockopt";

/// [`CGROUP_LINK_PINS`] on this kernel: before 5.15 (no namespace cookie
/// in sockopt programs) the agent attaches `dp_gsopt_tuple` instead.
fn cgroup_link_pins() -> Vec<&'static str> {
    let getsockopt = if dataplane_user::features::sockopt_knows_netns() {
        GETSOCKOPT_LINK_PIN
    } else {
        "cgroup_getsockopt_dp_gsopt_tuple"
    };
    CGROUP_LINK_PINS
        .iter()
        .map(|pin| {
            if *pin == GETSOCKOPT_LINK_PIN {
                getsockopt
            } else {
                pin
            }
        })
        .collect()
}

/// Waits until every link is pinned (the agent is attached).
fn wait_attached(pins: &PinLayout, agent: &mut ChildGuard) -> anyhow::Result<()> {
    let deadline = Instant::now() + LIMIT;
    while link_pins(pins).len() < CGROUP_LINK_PINS.len() {
        anyhow::ensure!(agent.is_running(), "agent exited before attaching");
        anyhow::ensure!(Instant::now() < deadline, "agent did not attach in time");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// IDs of the links attached to `cgroup`, from the kernel's own view.
fn cgroup_link_ids(pins: &PinLayout) -> anyhow::Result<Vec<u32>> {
    link_pins(pins)
        .iter()
        .map(|name| {
            let link = aya::programs::links::PinnedLink::from_pin(pins.links_dir().join(name))?;
            let fd: aya::programs::links::FdLink = link.into();
            Ok(fd.info()?.id())
        })
        .collect()
}

#[test]
fn sigterm_with_detach_leaves_nothing() -> anyhow::Result<()> {
    let bpffs = BpffsDir::new("lifedet")?;
    let cgroup = Cgroup::new("lifedet")?;
    let state = TempDir::new("lifedet")?;
    let pins = PinLayout::new(bpffs.path(), "life");
    let mut agent = start_agent(&cgroup, &bpffs, &state, "detach")?;
    wait_attached(&pins, &mut agent)?;
    agent.signal(Signal::SIGTERM)?;
    let out = agent.wait(LIMIT)?;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!pins.dir().exists(), "pins left: {}", pins.dir().display());
    assert!(
        !bpffs.path().join("dataplane").exists(),
        "empty parent directories left behind"
    );
    Ok(())
}

#[test]
fn sigterm_with_keep_leaves_state_for_the_next_agent() -> anyhow::Result<()> {
    let bpffs = BpffsDir::new("lifekeep")?;
    let cgroup = Cgroup::new("lifekeep")?;
    let state = TempDir::new("lifekeep")?;
    let pins = PinLayout::new(bpffs.path(), "life");

    let mut first = start_agent(&cgroup, &bpffs, &state, "keep")?;
    wait_attached(&pins, &mut first)?;
    let first_links = cgroup_link_ids(&pins)?;
    first.signal(Signal::SIGTERM)?;
    let out = first.wait(LIMIT)?;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    // Documented: programs stay attached and maps pinned.
    assert_eq!(link_pins(&pins), cgroup_link_pins());
    assert_eq!(cgroup_link_ids(&pins)?, first_links);

    // The next agent re-adopts: new links replace the old generation.
    let mut second = start_agent(&cgroup, &bpffs, &state, "detach")?;
    let deadline = Instant::now() + LIMIT;
    loop {
        let ids = cgroup_link_ids(&pins).unwrap_or_default();
        if ids.len() == CGROUP_LINK_PINS.len() && ids.iter().all(|id| !first_links.contains(id)) {
            break;
        }
        anyhow::ensure!(second.is_running(), "second agent exited");
        anyhow::ensure!(Instant::now() < deadline, "links were not replaced");
        std::thread::sleep(Duration::from_millis(20));
    }
    second.signal(Signal::SIGTERM)?;
    let out = second.wait(LIMIT)?;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!pins.dir().exists());
    Ok(())
}

/// A map pinned by an agent with another layout (here `ENROLLED_NETNS` with
/// 16-byte values where this agent's are 8) is not adopted: the agent
/// refuses to start, naming the map, the difference and the fix, and leaves
/// the old state as it found it. (aya alone would reuse the map and run the
/// new programs against it.)
#[test]
fn refuses_a_pinned_map_with_another_definition() -> anyhow::Result<()> {
    let bpffs = BpffsDir::new("lifedrift")?;
    let cgroup = Cgroup::new("lifedrift")?;
    let state = TempDir::new("lifedrift")?;
    let pins = PinLayout::new(bpffs.path(), "life");
    std::fs::create_dir_all(pins.maps_dir())?;
    let pin = pins.map(maps::ENROLLED_NETNS);
    let old: aya::maps::HashMap<MapData, u64, [u8; 16]> =
        aya::maps::HashMap::create(maps::ENROLLED_CAPACITY, 0)?;
    old.pin(&pin)?;

    let agent = start_agent(&cgroup, &bpffs, &state, "detach")?;
    let out = agent.wait(LIMIT)?;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    for expected in [
        "pinned map `ENROLLED_NETNS`",
        pin.to_string_lossy().as_ref(),
        "value size 16 vs 8",
        "dataplane run --on-exit detach",
        pins.dir().to_string_lossy().as_ref(),
    ] {
        assert!(
            out.stderr.contains(expected),
            "no {expected:?} in: {}",
            out.stderr
        );
    }
    // Nothing was attached, and the old map is still there, untouched.
    assert!(link_pins(&pins).is_empty(), "{:?}", link_pins(&pins));
    let info = MapData::from_pin(&pin)?.info()?;
    assert_eq!((info.key_size(), info.value_size()), (8, 16));
    Ok(())
}

#[test]
fn version_lists_every_embedded_program() -> anyhow::Result<()> {
    let out = Command::new(agent_binary()?).arg("version").output()?;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout)?;
    // Columns are padded to the longest name: compare words.
    let rows: Vec<String> = text
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    let has_row = |prefix: &str| rows.iter().any(|r| r.starts_with(prefix));
    assert!(
        has_row("dp_connect4 cgroup_sock_addr cgroup/connect4"),
        "{text}"
    );
    assert!(
        has_row("dp_connect6 cgroup_sock_addr cgroup/connect6"),
        "{text}"
    );
    assert!(
        has_row("dp_getsockopt cgroup_sockopt cgroup/getsockopt"),
        "{text}"
    );
    assert!(
        has_row("dp_gsopt_tuple cgroup_sockopt cgroup/getsockopt"),
        "{text}"
    );
    assert!(
        has_row("dp_getpeername4 cgroup_sock_addr cgroup/getpeername4"),
        "{text}"
    );
    assert!(
        has_row("dp_getpeername6 cgroup_sock_addr cgroup/getpeername6"),
        "{text}"
    );
    for hook in ["sendmsg4", "sendmsg6", "recvmsg4", "recvmsg6"] {
        assert!(
            has_row(&format!("dp_dns_{hook} cgroup_sock_addr cgroup/{hook}")),
            "{text}"
        );
    }
    assert!(has_row("dp_sk_lookup sk_lookup"), "{text}");
    assert!(has_row("dp_proxy_syn sched_cls tc ingress of lo"), "{text}");
    assert!(has_row("dp_sockops sock_ops"), "{text}");
    assert!(text.contains("aya 0.14.0"), "{text}");
    let json = Command::new(agent_binary()?)
        .args(["version", "--json"])
        .output()?;
    let parsed: serde_json::Value = serde_json::from_slice(&json.stdout)?;
    assert_eq!(parsed["programs"].as_array().map(Vec::len), Some(13));
    Ok(())
}

#[test]
fn a_second_agent_of_the_same_instance_refuses_to_start_and_changes_nothing() -> anyhow::Result<()>
{
    let node = dataplane_tests::topology::Node::new("lifelock", 1)?;
    let mut first = dataplane_tests::Agent::start("lifelock", &node, &[])?;
    let pid = first
        .pid()
        .ok_or_else(|| anyhow::anyhow!("first agent not running"))?;
    let socket = dataplane_user::control::socket_path(first.state_dir(), first.instance());
    let socket_inode = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&socket)?);

    let mut second = agent()?;
    second
        .arg("run")
        .arg("--instance")
        .arg(first.instance())
        .arg("--state-dir")
        .arg(first.state_dir())
        .arg("--bpffs")
        .arg(first.bpffs())
        .arg("--cgroup")
        .arg(node.cgroup().path())
        .args(["--readiness-addr", "127.0.0.1:0"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0"]);
    let (code, stderr) = run_to_exit(second)?;
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("another agent of instance") && stderr.contains(&format!("pid {pid}")),
        "the refusal names the running agent: {stderr}"
    );
    // The first agent still owns its socket and answers on it.
    assert_eq!(
        std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&socket)?),
        socket_inode
    );
    assert!(first.status()?.ready);
    assert_eq!(first.stop()?, Some(0));
    assert!(!socket.exists(), "the first agent removes its own socket");
    Ok(())
}

#[test]
fn a_silent_control_client_is_disconnected() -> anyhow::Result<()> {
    use std::io::Read as _;
    let node = dataplane_tests::topology::Node::new("lifesilent", 1)?;
    let agent = dataplane_tests::Agent::start("lifesilent", &node, &[])?;
    let socket = dataplane_user::control::socket_path(agent.state_dir(), agent.instance());
    let mut silent = std::os::unix::net::UnixStream::connect(&socket)?;
    // Hang guard only: the agent closes well before it.
    silent.set_read_timeout(Some(LIMIT))?;
    let mut buf = [0u8; 16];
    let read = silent.read(&mut buf);
    assert!(
        matches!(read, Ok(0)),
        "the agent should close a client that sends nothing: {read:?}"
    );
    // Others are still served.
    assert!(agent.status()?.ready);
    Ok(())
}

#[test]
fn control_clients_beyond_the_limit_are_refused_at_once_when_every_one_is_busy()
-> anyhow::Result<()> {
    use std::io::Write as _;
    let node = dataplane_tests::topology::Node::new("lifemany", 1)?;
    let agent = dataplane_tests::Agent::start("lifemany", &node, &[])?;
    let socket = dataplane_user::control::socket_path(agent.state_dir(), agent.instance());
    // Every slot taken by a client in the middle of its request (a silent
    // one would give its slot up to the newcomer: `cni_plugin` tests it).
    let busy: Vec<_> = (0..dataplane_user::control::MAX_CLIENTS)
        .map(|_| {
            let mut client = std::os::unix::net::UnixStream::connect(&socket)?;
            client.write_all(b"{")?;
            Ok(client)
        })
        .collect::<std::io::Result<_>>()?;
    // A client's slot is its own for good once the agent has seen its
    // first bytes; until then a newcomer could still take it.
    let served = |state: &str| -> anyhow::Result<f64> {
        let samples = dataplane_tests::observe::scrape(&agent)?;
        Ok(dataplane_tests::observe::value(
            &samples,
            "dataplane_control_clients",
            &[("state", state)],
        )
        .unwrap_or(-1.0))
    };
    dataplane_tests::traffic::wait_until("every client to be seen busy", || {
        Ok(served("busy")? == dataplane_user::control::MAX_CLIENTS as f64)
    })?;
    // One more is answered at once, before it even sends its request.
    let mut extra = std::os::unix::net::UnixStream::connect(&socket)?;
    extra.set_read_timeout(Some(LIMIT))?;
    let mut refused = String::new();
    std::io::Read::read_to_string(&mut extra, &mut refused)?;
    assert!(refused.contains("control connections already"), "{refused}");
    let samples = dataplane_tests::observe::scrape(&agent)?;
    assert_eq!(
        dataplane_tests::observe::sum(&samples, "dataplane_control_clients_refused_total"),
        1.0
    );
    assert_eq!(served("silent")?, 0.0);
    // Their slots come back once they go.
    drop(busy);
    dataplane_tests::traffic::wait_until("a slot to be free again", || {
        Ok(agent.call(&dataplane_user::control::Request::List).is_ok())
    })?;
    Ok(())
}
